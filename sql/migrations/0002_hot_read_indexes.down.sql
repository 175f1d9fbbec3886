-- 0002 downgrade: drop the indexes and columns 0002 added (SQLite >= 3.35).

DROP INDEX harel_spawns_parent;
DROP INDEX harel_outbox_target;
ALTER TABLE harel_outbox DROP COLUMN created_at;
DROP INDEX harel_timers_fire_at;
DROP INDEX harel_executions_parent;
DROP INDEX harel_executions_definition_roots;
DROP INDEX harel_executions_roots;
DROP INDEX harel_executions_definition;
DROP INDEX harel_executions_status;
ALTER TABLE harel_executions DROP COLUMN finished_at;
ALTER TABLE harel_executions DROP COLUMN parent_id;
ALTER TABLE harel_executions DROP COLUMN active_path;
ALTER TABLE harel_executions DROP COLUMN outcome;
ALTER TABLE harel_executions DROP COLUMN status;
