-- 0005: times for operators, all epoch seconds on the database's clock (one clock for every
-- writer). harel_executions.created_at is set by the insert CAS, updated_at by every CAS write;
-- rows written before 0005 keep NULL in both (their history holds no such time): newest-first
-- listings put them last, and a time window (updated_after/updated_before) leaves them out.
-- harel_outbox.source_id names the execution whose commit emitted the entry (NULL before
-- 0005), harel_spawns.created_at when the spawn was written (NULL before 0005).

ALTER TABLE harel_executions ADD COLUMN created_at REAL;
ALTER TABLE harel_executions ADD COLUMN updated_at REAL;
-- Newest-first listings and time windows: one index, read per status (a listing without a
-- status filter merges the four), its NULL times first in each status's range.
CREATE INDEX harel_executions_updated ON harel_executions (status, updated_at, id);
ALTER TABLE harel_outbox ADD COLUMN source_id TEXT;
ALTER TABLE harel_spawns ADD COLUMN created_at REAL;
