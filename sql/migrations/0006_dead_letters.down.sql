-- 0006 downgrade: dead letters become pending rows again (a dead entry's or spawn's seq is
-- restored), and attempts and last errors are forgotten (SQLite >= 3.35 for DROP COLUMN).

DROP INDEX harel_timers_dead;
DROP INDEX harel_timers_fire_at;
CREATE INDEX harel_timers_fire_at ON harel_timers (fire_at);
DROP INDEX harel_spawns_dead;
DROP INDEX harel_outbox_dead;
UPDATE harel_outbox SET seq = -seq WHERE seq < 0;
UPDATE harel_spawns SET seq = -seq WHERE seq < 0;
ALTER TABLE harel_timers DROP COLUMN dead_at;
ALTER TABLE harel_timers DROP COLUMN last_error;
ALTER TABLE harel_timers DROP COLUMN attempts;
ALTER TABLE harel_spawns DROP COLUMN dead_at;
ALTER TABLE harel_spawns DROP COLUMN last_error;
ALTER TABLE harel_spawns DROP COLUMN attempts;
ALTER TABLE harel_outbox DROP COLUMN dead_at;
ALTER TABLE harel_outbox DROP COLUMN last_error;
ALTER TABLE harel_outbox DROP COLUMN attempts;
