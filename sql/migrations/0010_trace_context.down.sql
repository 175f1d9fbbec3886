-- 0010 downgrade: drop the trace context columns (SQLite >= 3.35); the links are forgotten.

ALTER TABLE harel_timers DROP COLUMN traceparent;
ALTER TABLE harel_spawns DROP COLUMN traceparent;
ALTER TABLE harel_outbox DROP COLUMN traceparent;
