-- 0006: attempts and dead letters for the relays' rows (outbox entries, spawns, timers).
--
-- attempts counts the claims of a row (a claim counts one as it hands the row out, so a
-- handler that kills its process still counts); last_error is what the last worker that
-- could not deliver it said (`fail`). A claim given a max_attempts turns a row whose
-- attempts reached it into a dead letter instead of handing it out: dead_at is then when,
-- epoch seconds on the database's clock (NULL: a live row).
--
-- A dead outbox entry or spawn also has its seq stored negated, so it sorts below every live
-- row: a claim, which walks the primary key from seq 1 up, never meets one, however many
-- there are, and no index of the live rows (which every commit would write) is needed.
-- (seq < 0 exactly when dead_at IS NOT NULL.) A dead timer keeps its key; the fire_at
-- index that claims and the sweep walk becomes partial, holding live timers only, so a dead
-- one is never met either. The dead letters of each kind are indexed on their own, in the
-- order they died (partial indexes: a live row has no entry, so no commit writes one).

ALTER TABLE harel_outbox ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE harel_outbox ADD COLUMN last_error TEXT;
ALTER TABLE harel_outbox ADD COLUMN dead_at REAL;
ALTER TABLE harel_spawns ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE harel_spawns ADD COLUMN last_error TEXT;
ALTER TABLE harel_spawns ADD COLUMN dead_at REAL;
ALTER TABLE harel_timers ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE harel_timers ADD COLUMN last_error TEXT;
ALTER TABLE harel_timers ADD COLUMN dead_at REAL;

CREATE INDEX harel_outbox_dead ON harel_outbox (dead_at, seq DESC) WHERE dead_at IS NOT NULL;
CREATE INDEX harel_spawns_dead ON harel_spawns (dead_at, seq DESC) WHERE dead_at IS NOT NULL;
DROP INDEX harel_timers_fire_at;
-- Its key ends with dead_at (NULL in every entry: a live timer's), so the index covers the
-- queries' `dead_at IS NULL` and the sweep and the counts never read the table.
CREATE INDEX harel_timers_fire_at ON harel_timers (fire_at, execution_id, path, dead_at)
WHERE dead_at IS NULL;
CREATE INDEX harel_timers_dead ON harel_timers (dead_at) WHERE dead_at IS NOT NULL;
