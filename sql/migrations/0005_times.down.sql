-- 0005 downgrade: drop the time columns and their index (SQLite >= 3.35); the times and the
-- outbox entries' source are forgotten.

ALTER TABLE harel_spawns DROP COLUMN created_at;
ALTER TABLE harel_outbox DROP COLUMN source_id;
DROP INDEX harel_executions_updated;
ALTER TABLE harel_executions DROP COLUMN updated_at;
ALTER TABLE harel_executions DROP COLUMN created_at;
