-- 0002: index-backed hot reads. Listing reads plain summary columns (kept in step with the
-- JSON by the store's CAS write; the JSON stays the source of truth) through indexes that
-- match its filters and its ORDER BY id; the timer sweep seeks by fire_at; the relays' purge
-- seeks by target/parent. A row whose JSON is not valid gets NULL summary columns here.

ALTER TABLE harel_executions ADD COLUMN status TEXT;
ALTER TABLE harel_executions ADD COLUMN outcome TEXT;
ALTER TABLE harel_executions ADD COLUMN active_path TEXT;
ALTER TABLE harel_executions ADD COLUMN parent_id TEXT;
ALTER TABLE harel_executions ADD COLUMN finished_at REAL;

UPDATE harel_executions SET
    status = json_extract(data, '$.status'),
    outcome = json_extract(data, '$.outcome'),
    active_path = json_extract(data, '$.active_path'),
    parent_id = json_extract(data, '$.parent_id'),
    finished_at = json_extract(data, '$.finished_at')
WHERE json_valid(data);

CREATE INDEX harel_executions_status ON harel_executions (status, id);
CREATE INDEX harel_executions_definition ON harel_executions (definition_id, status, id);
CREATE INDEX harel_executions_roots ON harel_executions (status, id)
WHERE parent_id IS NULL;
CREATE INDEX harel_executions_definition_roots ON harel_executions (definition_id, status, id)
WHERE parent_id IS NULL;
-- A parent's children (operator tree walks, purge of a tree); roots are not in it.
CREATE INDEX harel_executions_parent ON harel_executions (parent_id, id)
WHERE parent_id IS NOT NULL;

CREATE INDEX harel_timers_fire_at ON harel_timers (fire_at);

-- Epoch seconds from SQLite's clock at insert; NULL for entries written before 0002.
ALTER TABLE harel_outbox ADD COLUMN created_at REAL;
CREATE INDEX harel_outbox_target ON harel_outbox (target_id);

CREATE INDEX harel_spawns_parent ON harel_spawns (parent_id);
