-- 0007 downgrade: drop the retention indexes and the markers' times (SQLite >= 3.35).

DROP INDEX harel_executions_final_roots;
DROP INDEX harel_executions_markers;
ALTER TABLE harel_executions DROP COLUMN markers_since;
ALTER TABLE harel_processed_events DROP COLUMN recorded_at;
