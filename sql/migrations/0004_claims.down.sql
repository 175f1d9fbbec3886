-- 0004 downgrade: drop the claim columns (SQLite >= 3.35); claims held are forgotten.

ALTER TABLE harel_timers DROP COLUMN claimed_until;
ALTER TABLE harel_timers DROP COLUMN claimed_by;
ALTER TABLE harel_spawns DROP COLUMN claimed_until;
ALTER TABLE harel_spawns DROP COLUMN claimed_by;
ALTER TABLE harel_outbox DROP COLUMN claimed_until;
ALTER TABLE harel_outbox DROP COLUMN claimed_by;
