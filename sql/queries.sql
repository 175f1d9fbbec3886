-- Every statement the store runs, as named blocks. The suffix of a name says what comes back:
--   name    all rows (a list of tuples)
--   name^   one row or None
--   name$   the first column of one row, or None
--   name!   nothing but the number of rows changed
-- Parameters are positional (`?` or `?N`): the libsql driver takes no named parameters.

-- name: begin!
-- Take the write lock up front, so a writer waits in busy_timeout here rather than failing
-- half-way through a batch when its read lock cannot be upgraded.
BEGIN IMMEDIATE;

-- name: version_table_exists$
SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'alembic_version';

-- name: schema_revision$
SELECT version_num FROM alembic_version;

-- name: create_version_table!
-- Exactly the table Alembic creates, so a store-made file and an Alembic-made one agree.
CREATE TABLE alembic_version (
    version_num VARCHAR(32) NOT NULL,
    CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num)
);

-- name: insert_revision!
INSERT INTO alembic_version (version_num) VALUES (?);

-- name: update_revision!
UPDATE alembic_version SET version_num = ?;

-- name: insert_execution!
-- The CAS for a brand-new execution (in-memory version 0): no row may exist yet.
INSERT INTO harel_executions (id, definition_id, data, version) VALUES (?, ?, ?, ?)
ON CONFLICT (id) DO NOTHING;

-- name: update_execution!
-- The version CAS: exactly one writer moves a row from version ?4 to ?3.
UPDATE harel_executions SET data = ?2, version = ?3 WHERE id = ?1 AND version = ?4;

-- name: execution_version$
SELECT version FROM harel_executions WHERE id = ?;

-- name: load_execution$
SELECT data FROM harel_executions WHERE id = ?;

-- name: load_for_event^
-- The worker's per-event pair in one round trip: the execution and its dedupe marker.
SELECT (SELECT data FROM harel_executions WHERE id = ?1),
       EXISTS (SELECT 1 FROM harel_processed_events WHERE execution_id = ?1 AND event_id = ?2);

-- name: is_processed$
SELECT 1 FROM harel_processed_events WHERE execution_id = ? AND event_id = ?;

-- name: insert_outbox$
INSERT INTO harel_outbox (target_id, event) VALUES (?, ?) RETURNING seq;

-- name: mark_processed!
INSERT OR IGNORE INTO harel_processed_events (execution_id, event_id) VALUES (?, ?);

-- name: insert_spawn!
INSERT INTO harel_spawns (parent_id, child_id, root_path, context) VALUES (?, ?, ?, ?);

-- name: schedule_timer!
-- Re-arming the same path replaces its fire_at.
INSERT INTO harel_timers (execution_id, path, fire_at) VALUES (?, ?, ?)
ON CONFLICT (execution_id, path) DO UPDATE SET fire_at = excluded.fire_at;

-- name: cancel_timer!
DELETE FROM harel_timers WHERE execution_id = ? AND path = ?;

-- name: append_trace!
-- The next index is computed inline (first step is 0) and survives the ring trim.
INSERT INTO harel_trace (execution_id, idx, entry)
SELECT ?1, COALESCE((SELECT MAX(idx) FROM harel_trace WHERE execution_id = ?1), -1) + 1, ?2;

-- name: trim_trace!
-- Keep the last ?2 steps of one execution.
DELETE FROM harel_trace WHERE execution_id = ?1
AND idx <= (SELECT MAX(idx) FROM harel_trace WHERE execution_id = ?1) - ?2;

-- name: read_trace
SELECT idx, entry FROM harel_trace WHERE execution_id = ? ORDER BY idx;

-- name: list_executions
-- One keyset page: rows after the cursor's id (?1), filtered by definition (?2, or NULL for
-- any), status (?3, a JSON array of any-of, or NULL for any) and roots only (?4), ?5 rows.
SELECT id, definition_id, version,
       json_extract(data, '$.status'), json_extract(data, '$.outcome'),
       json_extract(data, '$.active_path'), json_extract(data, '$.parent_id'),
       json_extract(data, '$.finished_at')
FROM harel_executions
WHERE id > ?1
  AND (?2 IS NULL OR definition_id = ?2)
  AND (?3 IS NULL OR json_extract(data, '$.status') IN (SELECT value FROM json_each(?3)))
  AND (NOT ?4 OR json_extract(data, '$.parent_id') IS NULL)
ORDER BY id
LIMIT ?5;

-- name: pending_outbox
SELECT seq, target_id, event FROM harel_outbox ORDER BY seq;

-- name: ack_outbox!
DELETE FROM harel_outbox WHERE seq = ?;

-- name: pending_spawns
SELECT seq, parent_id, child_id, root_path, context FROM harel_spawns ORDER BY seq;

-- name: ack_spawn!
DELETE FROM harel_spawns WHERE seq = ?;

-- name: due_timers
SELECT execution_id, path, fire_at FROM harel_timers WHERE fire_at <= ? ORDER BY fire_at;

-- name: delete_timer!
-- Only the timer as it was swept: a concurrent re-schedule to a new time survives.
DELETE FROM harel_timers WHERE execution_id = ? AND path = ? AND fire_at = ?;

-- name: purge_execution!
-- The purge CAS.
DELETE FROM harel_executions WHERE id = ? AND version = ?;

-- name: purge_processed!
DELETE FROM harel_processed_events WHERE execution_id = ?;

-- name: purge_trace!
DELETE FROM harel_trace WHERE execution_id = ?;

-- name: purge_timers!
DELETE FROM harel_timers WHERE execution_id = ?;

-- name: purge_outbox!
DELETE FROM harel_outbox WHERE target_id = ?;

-- name: purge_spawns!
DELETE FROM harel_spawns WHERE parent_id = ?;

-- name: ids_in_range
-- Ids with a prefix, as the primary-key range [?1, ?2): case-sensitive, with no character
-- that means anything but itself. Where the prefix has no successor string, ?2 is an empty
-- BLOB, which sorts after every TEXT value.
SELECT id FROM harel_executions WHERE id >= ?1 AND id < ?2 ORDER BY id;

-- name: publish_definition!
-- The primary key keeps the version stored first.
INSERT OR IGNORE INTO harel_definitions (definition_id, version, digest, source, published_at)
VALUES (?, ?, ?, ?, ?);

-- name: load_definition^
SELECT definition_id, version, digest, source, published_at
FROM harel_definitions WHERE definition_id = ? AND version = ?;
