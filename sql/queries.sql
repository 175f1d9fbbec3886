-- Every statement the store runs, as named blocks. The suffix of a name says what comes back:
--   name    all rows (a list of tuples)
--   name^   one row or None
--   name=   exactly one row: a reply with none (a server or a proxy gone wrong) is a
--           StoreError naming the query, as a row of the wrong shape is
--   name$   the first column of one row, or None
--   name!   nothing but the number of rows changed
-- Parameters are positional (`?` or `?N`): the libsql driver takes no named parameters.

-- Every write is one batch (harel_store/batch.py) between these. A local connection runs
-- it statement by statement; a remote one sends it as one Hrana batch whose steps each run
-- only if the one before succeeded, COMMIT last, ROLLBACK if the COMMIT did not run.

-- name: begin!
-- Take the write lock up front, so a writer waits in busy_timeout here rather than failing
-- half-way through a batch when its read lock cannot be upgraded.
BEGIN IMMEDIATE;

-- name: commit!
COMMIT;

-- name: rollback!
ROLLBACK;

-- A local group commit (harel_store/connection/local.py): several commits in one
-- transaction, each in its own savepoint, so that one that fails is undone alone.
-- name: savepoint!
SAVEPOINT harel_member;

-- name: release_savepoint!
RELEASE harel_member;

-- name: rollback_to_savepoint!
ROLLBACK TO harel_member;

-- name: guard_changed$
-- A remote batch's guard: fails when the statement before it changed no row (json() of a
-- text that is not JSON raises an error), so the steps after it are skipped and the batch
-- rolls back. changes() is the connection's last INSERT/UPDATE/DELETE. A local connection
-- reads the row count instead.
SELECT CASE WHEN changes() = 0 THEN json('harel-store: the guarded statement changed no row') END;

-- name: guard_rows$
-- As guard_changed, for a statement that must change exactly ?1 rows.
SELECT CASE WHEN changes() <> ?1 THEN json('harel-store: the guarded statement changed another number of rows') END;

-- name: branch_end$
-- A remote batch's step after the steps it runs on one side of a gate (flows_gate): run
-- once the last step of the side taken has, so that what follows hangs on one step.
SELECT 1;

-- name: clock$
-- row: now real
-- The database's clock, epoch seconds: every time the store writes is on it.
SELECT (julianday('now') - 2440587.5) * 86400.0;

-- name: data_version$
-- row: version int
-- A local file's count of the commits other connections made since this one last looked
-- (it moves when another connection commits; its own commits leave it): retention sizes
-- its writes by it (harel_store.pace). Local files only.
PRAGMA data_version;

-- name: checkpoint^
-- row: busy int, log int, checkpointed int
-- Write the WAL's committed pages back into a local file, waiting for no one (a reader's
-- snapshot or a writer stops it where it is): after each of its writes, retention pays for
-- the pages it wrote rather than leave them to the next commit that crosses the WAL's
-- automatic checkpoint. Local files only.
PRAGMA wal_checkpoint(PASSIVE);

-- name: ping$
-- row: one int
-- Whether the server answers at all (and accepts the token).
SELECT 1;

-- name: version_table_exists$
-- row: found int
SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'alembic_version';

-- name: schema_revision$
-- row: version_num text
SELECT version_num FROM alembic_version;

-- name: create_version_table!
-- Exactly the table Alembic creates, so a store-made file and an Alembic-made one agree.
CREATE TABLE IF NOT EXISTS alembic_version (
    version_num VARCHAR(32) NOT NULL,
    CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num)
);

-- name: claim_revision!
-- The first migration's guard: the revision row is written only where there is none, so
-- of two processes migrating a fresh database one claims it and the other conflicts.
INSERT INTO alembic_version (version_num) SELECT ?1 WHERE NOT EXISTS (SELECT 1 FROM alembic_version);

-- name: update_revision!
-- A later migration's guard: it moves the revision from ?2 to ?1, or changes nothing when
-- another process moved it first.
UPDATE alembic_version SET version_num = ?1 WHERE version_num = ?2;

-- name: insert_execution!
-- The CAS for a brand-new execution (in-memory version 0): no row may exist yet. The summary
-- columns (?5..?9: status, outcome, active_path, parent_id, finished_at) mirror the JSON.
-- created_at and updated_at are epoch seconds from the database's clock, one clock for every
-- writer ('now' is the same for the whole statement: both get the same value).
INSERT INTO harel_executions
    (id, definition_id, data, version, status, outcome, active_path, parent_id, finished_at,
     created_at, updated_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9,
        (julianday('now') - 2440587.5) * 86400.0, (julianday('now') - 2440587.5) * 86400.0)
ON CONFLICT (id) DO NOTHING;

-- The version CAS: exactly one writer moves a row from version ?4 to ?3, with its summary
-- columns (?5..?9 as in insert_execution). SQLite rewrites an index's entry whenever the
-- SET list names one of its columns, even to the value it has, so the CAS comes in three
-- shapes and the store picks the one that names only what changed. A column left out of
-- SET is checked in WHERE to hold the new value already: a wrong guess about the stored
-- summary changes no row (read as a conflict the store retries with update_execution),
-- never a stale summary beside new data. Every shape sets updated_at (the database's clock),
-- so each rewrites the row's entry in harel_executions_updated; none touches created_at.

-- name: update_execution!
-- Every summary column: for a row whose stored summary the store does not know.
UPDATE harel_executions
SET data = ?2, version = ?3, status = ?5, outcome = ?6, active_path = ?7, parent_id = ?8,
    finished_at = ?9, updated_at = (julianday('now') - 2440587.5) * 86400.0
WHERE id = ?1 AND version = ?4;

-- name: update_execution_data!
-- status and parent_id unchanged (the common commit): of the indexes only
-- harel_executions_updated is rewritten.
UPDATE harel_executions
SET data = ?2, version = ?3, outcome = ?6, active_path = ?7, finished_at = ?9,
    updated_at = (julianday('now') - 2440587.5) * 86400.0
WHERE id = ?1 AND version = ?4 AND status IS ?5 AND parent_id IS ?8;

-- name: update_execution_status!
-- status changed, parent_id unchanged: the status indexes are rewritten, the parent's not.
UPDATE harel_executions
SET data = ?2, version = ?3, status = ?5, outcome = ?6, active_path = ?7, finished_at = ?9,
    updated_at = (julianday('now') - 2440587.5) * 86400.0
WHERE id = ?1 AND version = ?4 AND parent_id IS ?8;

-- name: execution_version$
-- row: version int
SELECT version FROM harel_executions WHERE id = ?;

-- name: load_execution^
-- row: data text, version int
-- The record and its version column: the CAS compares the column, so a load takes the
-- version from it, not from the JSON (which a client that moved the column alone left
-- behind; taking the JSON's would conflict on every commit, for ever). No id column: each
-- cell costs the hot path (a row that does not fit is named by its JSON's start).
SELECT data, version FROM harel_executions WHERE id = ?;

-- name: load_for_event=
-- row: data text?, version int?, processed int
-- The worker's per-event pair in one round trip: the execution (as load_execution reads it;
-- NULLs when there is none) and its dedupe marker. Always one row.
SELECT e.data, e.version,
       EXISTS (SELECT 1 FROM harel_processed_events WHERE execution_id = ?1 AND event_id = ?2)
FROM (SELECT 1) LEFT JOIN harel_executions AS e ON e.id = ?1;

-- name: awaited
-- row: id text, data text, version int
-- What the wait_for calls of a store wait on, read at once: of the executions in ?1, a JSON
-- object of id -> [status, ...], those now at one of their statuses, with their record.
-- One primary-key lookup a waited execution.
SELECT e.id, e.data, e.version FROM json_each(?1) AS w
JOIN harel_executions AS e ON e.id = w.key
WHERE e.status IN (SELECT value FROM json_each(w.value));

-- name: awaited_changes
-- row: now real, id text?, status text?
-- What may have changed for wait_for's calls, at a cost in proportion to the change, not to
-- the calls: the database's clock now, and the executions at one of the statuses in ?1 (a
-- JSON array) last written at or after ?2 (epoch seconds, that clock). One range of the
-- covering index harel_executions_updated a status. Always one row at least (NULL ids).
SELECT n.now, e.id, e.status
FROM (SELECT (julianday('now') - 2440587.5) * 86400.0 AS now) AS n
LEFT JOIN harel_executions AS e
    ON e.status IN (SELECT value FROM json_each(?1)) AND e.updated_at >= ?2;

-- name: is_processed$
-- row: found int
SELECT 1 FROM harel_processed_events WHERE execution_id = ? AND event_id = ?;

-- name: insert_outbox$
-- row: seq int
-- created_at is epoch seconds from SQLite's clock, so every writer's entries share one clock;
-- source_id is the execution whose commit emits the entry; traceparent the commit's trace
-- context (0010), NULL when it ran inside no span. Likewise for spawns and timers.
-- ?5 is its flow key (0011). Its rank follows its key's last live one, or starts where the
-- claims stand (the flow clock) when the key has none: a key that was idle joins the
-- round-robin at once, and one with a backlog goes on from its own. flowed: whether the
-- key has settings. Two seeks of harel_outbox_flow and the clock, a probe of the flows.
INSERT INTO harel_outbox
    (target_id, source_id, event, created_at, traceparent, flow_key, flow_rank, flowed)
VALUES (?1, ?2, ?3, (julianday('now') - 2440587.5) * 86400.0, ?4, ?5,
        max(coalesce((SELECT max(flow_rank) FROM harel_outbox WHERE flow_key = ?5 AND seq > 0), 0) + 1,
            coalesce((SELECT rank FROM harel_flow_clock WHERE kind = 'outbox'), 0)),
        EXISTS (SELECT 1 FROM harel_flows WHERE key = ?5))
RETURNING seq;

-- name: mark_processed!
-- recorded_at: the database's clock (0007), for forget_processed; a marker recorded again
-- keeps its first time.
INSERT OR IGNORE INTO harel_processed_events (execution_id, event_id, recorded_at)
VALUES (?, ?, (julianday('now') - 2440587.5) * 86400.0);

-- name: insert_spawn!
-- ?6: the flow key; ranked as insert_outbox ranks.
INSERT INTO harel_spawns
    (parent_id, child_id, root_path, context, created_at, traceparent, flow_key, flow_rank, flowed)
VALUES (?1, ?2, ?3, ?4, (julianday('now') - 2440587.5) * 86400.0, ?5, ?6,
        max(coalesce((SELECT max(flow_rank) FROM harel_spawns WHERE flow_key = ?6 AND seq > 0), 0) + 1,
            coalesce((SELECT rank FROM harel_flow_clock WHERE kind = 'spawn'), 0)),
        EXISTS (SELECT 1 FROM harel_flows WHERE key = ?6));

-- name: schedule_timer!
-- Re-arming the same path replaces its fire_at.
-- Re-arming also drops a relay's claim, its attempts and a dead letter it was: the timer is
-- due anew, at its new time, with the trace context of the commit that re-armed it.
-- ?5: the flow key (timers are ranked when claimed: no rank).
INSERT INTO harel_timers (execution_id, path, fire_at, traceparent, flow_key, flowed)
VALUES (?1, ?2, ?3, ?4, ?5, EXISTS (SELECT 1 FROM harel_flows WHERE key = ?5))
ON CONFLICT (execution_id, path) DO UPDATE
SET fire_at = excluded.fire_at, claimed_by = NULL, claimed_until = NULL, attempts = 0,
    last_error = NULL, dead_at = NULL, traceparent = excluded.traceparent,
    flow_key = excluded.flow_key, flowed = excluded.flowed;

-- name: cancel_timer!
DELETE FROM harel_timers WHERE execution_id = ? AND path = ?;

-- name: append_trace$
-- row: idx int
-- The next index is computed inline (first step is 0; the MAX is one primary-key seek) and
-- survives the ring trim; it comes back so a local batch runs the trim only once the ring
-- is full.
INSERT INTO harel_trace (execution_id, idx, entry, recorded_at)
SELECT ?1, COALESCE((SELECT MAX(idx) FROM harel_trace WHERE execution_id = ?1), -1) + 1, ?2,
       (julianday('now') - 2440587.5) * 86400.0
RETURNING idx;

-- name: trim_trace!
-- Keep the last ?2 steps of one execution (a MAX seek rather than the appended index, which
-- a remote batch cannot pass from step to step).
DELETE FROM harel_trace
WHERE execution_id = ?1 AND idx <= (SELECT MAX(idx) FROM harel_trace WHERE execution_id = ?1) - ?2;

-- name: read_trace
-- row: idx int, entry text
SELECT idx, entry FROM harel_trace WHERE execution_id = ? ORDER BY idx;

-- name: trace_view
-- row: idx int, recorded_at real?, entry text
-- The trace with each step's time (harel-store trace): its latest ?2 steps (-1: all), in order.
SELECT idx, recorded_at, entry FROM (
    SELECT idx, recorded_at, entry FROM harel_trace WHERE execution_id = ?1
    ORDER BY idx DESC LIMIT ?2)
ORDER BY idx;

-- name: list_executions
-- row: id text, definition_id text, version int, status text, outcome text?, active_path text?, parent_id text?, finished_at real?, created_at real?, updated_at real?
-- One keyset page without filters: a primary-key range, ids from ?1 (the cursor's id followed
-- by a NUL, the least string above it; or an id prefix) up to ?3 (exclusive: the least string
-- above an id prefix, or an empty BLOB, above every string), ?2 rows.
-- Every listing reads the summary columns, never the JSON. A row whose summary is NULL (its
-- JSON was already corrupt when 0002 backfilled it) is listed by none of them.
SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
       created_at, updated_at
FROM harel_executions WHERE id >= ?1 AND id < ?3 AND status IS NOT NULL ORDER BY id LIMIT ?2;

-- name: list_by_status
-- row: id text, definition_id text, version int, status text, outcome text?, active_path text?, parent_id text?, finished_at real?, created_at real?, updated_at real?
-- A keyset page of the rows whose status is any of ?2..?5 (NULL: unused slot), ids in
-- [?1, ?7) as in list_executions, ?6 rows.
-- One LIMITed seek per status in its (status, id) index, merged: cost grows with the page.
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions WHERE status = ?2 AND id >= ?1 AND id < ?7 ORDER BY id LIMIT ?6)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions WHERE status = ?3 AND id >= ?1 AND id < ?7 ORDER BY id LIMIT ?6)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions WHERE status = ?4 AND id >= ?1 AND id < ?7 ORDER BY id LIMIT ?6)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions WHERE status = ?5 AND id >= ?1 AND id < ?7 ORDER BY id LIMIT ?6)
ORDER BY id LIMIT ?6;

-- name: list_by_definition
-- row: id text, definition_id text, version int, status text, outcome text?, active_path text?, parent_id text?, finished_at real?, created_at real?, updated_at real?
-- As list_by_status, for definition ?2 and statuses ?3..?6 (all four: any status), ?7 rows,
-- ids in [?1, ?8).
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions WHERE status = ?3 AND definition_id = ?2 AND id >= ?1 AND id < ?8 ORDER BY id LIMIT ?7)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions WHERE status = ?4 AND definition_id = ?2 AND id >= ?1 AND id < ?8 ORDER BY id LIMIT ?7)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions WHERE status = ?5 AND definition_id = ?2 AND id >= ?1 AND id < ?8 ORDER BY id LIMIT ?7)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions WHERE status = ?6 AND definition_id = ?2 AND id >= ?1 AND id < ?8 ORDER BY id LIMIT ?7)
ORDER BY id LIMIT ?7;

-- name: list_roots
-- row: id text, definition_id text, version int, status text, outcome text?, active_path text?, parent_id text?, finished_at real?, created_at real?, updated_at real?
-- As list_by_status, roots only (parent_id IS NULL selects the partial index).
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions WHERE status = ?2 AND parent_id IS NULL AND id >= ?1 AND id < ?7 ORDER BY id LIMIT ?6)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions WHERE status = ?3 AND parent_id IS NULL AND id >= ?1 AND id < ?7 ORDER BY id LIMIT ?6)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions WHERE status = ?4 AND parent_id IS NULL AND id >= ?1 AND id < ?7 ORDER BY id LIMIT ?6)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions WHERE status = ?5 AND parent_id IS NULL AND id >= ?1 AND id < ?7 ORDER BY id LIMIT ?6)
ORDER BY id LIMIT ?6;

-- name: list_roots_by_definition
-- row: id text, definition_id text, version int, status text, outcome text?, active_path text?, parent_id text?, finished_at real?, created_at real?, updated_at real?
-- As list_by_definition, roots only. INDEXED BY: with the id range closed at both ends the
-- planner (no ANALYZE statistics) rates the full definition index as good as the partial one,
-- which skips every child execution.
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions INDEXED BY harel_executions_definition_roots
    WHERE status = ?3 AND definition_id = ?2 AND parent_id IS NULL AND id >= ?1 AND id < ?8 ORDER BY id LIMIT ?7)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions INDEXED BY harel_executions_definition_roots
    WHERE status = ?4 AND definition_id = ?2 AND parent_id IS NULL AND id >= ?1 AND id < ?8 ORDER BY id LIMIT ?7)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions INDEXED BY harel_executions_definition_roots
    WHERE status = ?5 AND definition_id = ?2 AND parent_id IS NULL AND id >= ?1 AND id < ?8 ORDER BY id LIMIT ?7)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions INDEXED BY harel_executions_definition_roots
    WHERE status = ?6 AND definition_id = ?2 AND parent_id IS NULL AND id >= ?1 AND id < ?8 ORDER BY id LIMIT ?7)
ORDER BY id LIMIT ?7;

-- Listings in update order (0005) read harel_executions_updated, one LIMITed seek per status
-- slot (NULL: unused), merged as above. The timed rows of a page lie in a closed range of
-- updated_at, so the seek stops at the range's end whatever the table holds; the keyset
-- (the cursor's time and id) only steps over the ties at the range's first time. A
-- definition_id (NULL: any) and roots only (1, else 0) are checked on each row the seek reads:
-- a page costs the rows they skip (no index of their own: each would be rewritten by every
-- commit, as updated_at moves).

-- name: list_newest
-- row: id text, definition_id text, version int, status text, outcome text?, active_path text?, parent_id text?, finished_at real?, created_at real?, updated_at real?
-- Newest first, (updated_at, id) descending; the rows of statuses ?5..?8 with ?1 <= updated_at
-- <= ?2, a row at ?2 only below id ?3 (the cursor; '' on a first page: none at ?2, so an
-- exclusive upper bound). Rows whose updated_at is NULL (written before 0005) come last, by
-- id descending: those below id ?4 (an empty BLOB, above every id: all; '': none). ?9
-- definition_id, ?10 roots only, ?11 rows; ids in [?12, ?13) (an id prefix's range, checked
-- on each row read: `+id` keeps the planner from seeking (status, id) instead of the time
-- range; '' and an empty BLOB: any id).
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions
    WHERE status = ?5 AND updated_at >= ?1 AND updated_at <= ?2 AND (updated_at < ?2 OR id < ?3)
      AND (?9 IS NULL OR definition_id = ?9) AND (?10 = 0 OR parent_id IS NULL)
      AND +id >= ?12 AND +id < ?13
    ORDER BY updated_at DESC, id DESC LIMIT ?11)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions
    WHERE status = ?6 AND updated_at >= ?1 AND updated_at <= ?2 AND (updated_at < ?2 OR id < ?3)
      AND (?9 IS NULL OR definition_id = ?9) AND (?10 = 0 OR parent_id IS NULL)
      AND +id >= ?12 AND +id < ?13
    ORDER BY updated_at DESC, id DESC LIMIT ?11)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions
    WHERE status = ?7 AND updated_at >= ?1 AND updated_at <= ?2 AND (updated_at < ?2 OR id < ?3)
      AND (?9 IS NULL OR definition_id = ?9) AND (?10 = 0 OR parent_id IS NULL)
      AND +id >= ?12 AND +id < ?13
    ORDER BY updated_at DESC, id DESC LIMIT ?11)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions
    WHERE status = ?8 AND updated_at >= ?1 AND updated_at <= ?2 AND (updated_at < ?2 OR id < ?3)
      AND (?9 IS NULL OR definition_id = ?9) AND (?10 = 0 OR parent_id IS NULL)
      AND +id >= ?12 AND +id < ?13
    ORDER BY updated_at DESC, id DESC LIMIT ?11)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions
    WHERE status = ?5 AND updated_at IS NULL AND id < ?4
      AND (?9 IS NULL OR definition_id = ?9) AND (?10 = 0 OR parent_id IS NULL)
      AND +id >= ?12 AND +id < ?13
    ORDER BY id DESC LIMIT ?11)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions
    WHERE status = ?6 AND updated_at IS NULL AND id < ?4
      AND (?9 IS NULL OR definition_id = ?9) AND (?10 = 0 OR parent_id IS NULL)
      AND +id >= ?12 AND +id < ?13
    ORDER BY id DESC LIMIT ?11)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions
    WHERE status = ?7 AND updated_at IS NULL AND id < ?4
      AND (?9 IS NULL OR definition_id = ?9) AND (?10 = 0 OR parent_id IS NULL)
      AND +id >= ?12 AND +id < ?13
    ORDER BY id DESC LIMIT ?11)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions
    WHERE status = ?8 AND updated_at IS NULL AND id < ?4
      AND (?9 IS NULL OR definition_id = ?9) AND (?10 = 0 OR parent_id IS NULL)
      AND +id >= ?12 AND +id < ?13
    ORDER BY id DESC LIMIT ?11)
ORDER BY updated_at DESC, id DESC LIMIT ?11;

-- name: list_oldest
-- row: id text, definition_id text, version int, status text, outcome text?, active_path text?, parent_id text?, finished_at real?, created_at real?, updated_at real?
-- Oldest first, (updated_at, id) ascending, for a time window: the rows of statuses ?4..?7
-- with ?2 <= updated_at < ?1, a row at ?2 only above id ?3 (the cursor; '' on a first page:
-- every id, so an inclusive lower bound). ?8 definition_id, ?9 roots only, ?10 rows; ids in
-- [?11, ?12) as in list_newest. A NULL updated_at is in no window.
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions
    WHERE status = ?4 AND updated_at < ?1 AND updated_at >= ?2 AND (updated_at > ?2 OR id > ?3)
      AND (?8 IS NULL OR definition_id = ?8) AND (?9 = 0 OR parent_id IS NULL)
      AND +id >= ?11 AND +id < ?12
    ORDER BY updated_at, id LIMIT ?10)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions
    WHERE status = ?5 AND updated_at < ?1 AND updated_at >= ?2 AND (updated_at > ?2 OR id > ?3)
      AND (?8 IS NULL OR definition_id = ?8) AND (?9 = 0 OR parent_id IS NULL)
      AND +id >= ?11 AND +id < ?12
    ORDER BY updated_at, id LIMIT ?10)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions
    WHERE status = ?6 AND updated_at < ?1 AND updated_at >= ?2 AND (updated_at > ?2 OR id > ?3)
      AND (?8 IS NULL OR definition_id = ?8) AND (?9 = 0 OR parent_id IS NULL)
      AND +id >= ?11 AND +id < ?12
    ORDER BY updated_at, id LIMIT ?10)
UNION ALL
SELECT * FROM (
    SELECT id, definition_id, version, status, outcome, active_path, parent_id, finished_at,
           created_at, updated_at
    FROM harel_executions
    WHERE status = ?7 AND updated_at < ?1 AND updated_at >= ?2 AND (updated_at > ?2 OR id > ?3)
      AND (?8 IS NULL OR definition_id = ?8) AND (?9 = 0 OR parent_id IS NULL)
      AND +id >= ?11 AND +id < ?12
    ORDER BY updated_at, id LIMIT ?10)
ORDER BY updated_at, id LIMIT ?10;

-- The relays' queues (0004, 0006). An outbox entry or a spawn is live while its seq is
-- positive; a dead letter's seq is stored negated, below every live row (seq < 0 exactly
-- when dead_at IS NOT NULL). A timer is live while dead_at IS NULL, and the fire_at index
-- holds live timers only. So every read and claim of the live rows below walks an index from
-- its first live row and never meets a dead letter, however many there are.

-- name: pending_outbox
-- row: seq int, target_id text?, event text
-- The oldest ?1 live entries (-1: all), claimed or not.
SELECT seq, target_id, event FROM harel_outbox WHERE seq > 0 ORDER BY seq LIMIT ?1;

-- The claims. Each is one UPDATE ... RETURNING: one statement, atomic against every other
-- worker. It hands worker ?1 the oldest ?2 live rows that no live lease holds (nor a `fail`
-- that made them wait: claimed_until is then their retry time, with nobody's name), leases
-- them for ?3 seconds on the database's clock (one 'now' for the whole statement) and counts
-- one attempt of each; given a max_attempts (NULL: none) it passes over rows whose attempts
-- reached it. Outbox entries and spawns are taken by flow_rank, then seq (0011: round-robin
-- across flow keys, first in, first out inside one): the subquery walks harel_*_rank from
-- the lowest rank, stepping over rows other workers hold, so its cost does not grow with the
-- backlog. RETURNING gives rows in no set order: the store sorts them.
--
-- Flow control (0011). Each claim is two statements, of which a claim runs one: the plain
-- one while no key has settings (NOT EXISTS harel_flows: one probe), the *_flows one
-- otherwise, which honours the settings. A local connection reads flows_in_use first and
-- runs only the one that fits (the _flows ones cost more to compile); a remote batch runs
-- the one on its side of flows_gate (which fails while some key has settings), and either
-- one that ran when it does not fit would change nothing. Both sit in the claim's one
-- transaction, so every worker and process sees a change of settings at its next claim.
--
-- With a max_attempts, the claim's batch first runs mark_dead_*: of the first ?2 rows a
-- claim could take (as it walks them; no row of a paused key, nor of one at its limit),
-- those whose attempts reached ?1 become dead letters, in the same transaction (RETURNING
-- names them for the log). A row past the limit at max_attempts is passed over by the claim
-- and made dead by a later one, once the rows before it are taken.

-- name: mark_dead_outbox
-- row: seq int, attempts int, last_error text?
UPDATE harel_outbox
SET seq = -seq, claimed_by = NULL, claimed_until = NULL,
    dead_at = (julianday('now') - 2440587.5) * 86400.0
WHERE seq IN (
    SELECT seq FROM (
        SELECT seq, attempts FROM harel_outbox INDEXED BY harel_outbox_rank
        WHERE seq > 0 AND flowed = 0
          AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
          AND NOT EXISTS (SELECT 1 FROM harel_flows)
        ORDER BY flow_rank, seq LIMIT ?2)
    WHERE attempts >= ?1)
RETURNING -seq, attempts, last_error;

-- name: mark_dead_outbox_flows
-- row: seq int, attempts int, last_error text?
-- mark_dead_outbox when some key has settings: the keys without them walked as there, and
-- each key with room (harel_flow_room) its own first ?2: never an item a claim may not take.
UPDATE harel_outbox
SET seq = -seq, claimed_by = NULL, claimed_until = NULL,
    dead_at = (julianday('now') - 2440587.5) * 86400.0
WHERE seq IN (
    SELECT seq FROM (
        SELECT seq, attempts FROM harel_outbox INDEXED BY harel_outbox_rank
        WHERE seq > 0 AND flowed = 0
          AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
          AND EXISTS (SELECT 1 FROM harel_flows)
        ORDER BY flow_rank, seq LIMIT ?2)
    WHERE attempts >= ?1
    UNION ALL
    SELECT i.seq FROM harel_flow_room AS f CROSS JOIN harel_outbox AS i
    WHERE (f.room IS NULL OR f.room > 0) AND i.attempts >= ?1 AND i.seq IN (
        SELECT seq FROM harel_outbox
        WHERE flow_key = f.key AND seq > 0
          AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
        ORDER BY flow_rank, seq LIMIT ?2))
RETURNING -seq, attempts, last_error;

-- name: claim_outbox
-- row: seq int, target_id text?, event text, created_at any, traceparent any, flow_rank int, priority int
-- A claim also hands its relay when each item was written and the trace context it was
-- written in (0010): the relay's lag and its handler span's link. Those two are read as
-- `any`: a value of another type (a foreign client's) is read as none by the store
-- (harel_store/queues.py), never a reply that does not fit, which would stop every claim.
-- And its turn (0011): its rank and its key's priority, which a relay handles a round's
-- items by (the claim hands them out oldest first).
UPDATE harel_outbox
SET claimed_by = ?1, claimed_until = (julianday('now') - 2440587.5) * 86400.0 + ?3,
    attempts = attempts + 1
WHERE seq IN (
    SELECT seq FROM harel_outbox
    WHERE seq > 0 AND flowed = 0
      AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
      AND (?4 IS NULL OR attempts < ?4)
      AND NOT EXISTS (SELECT 1 FROM harel_flows)
    ORDER BY flow_rank, seq LIMIT ?2)
RETURNING seq, target_id, event, created_at, traceparent,
          flow_rank, 0;

-- name: claim_outbox_flows
-- row: seq int, target_id text?, event text, created_at any, traceparent any, flow_rank int, priority int
-- claim_outbox when some key has settings (a claim runs the one that fits: see
-- "Flow control" below). The keys without settings are walked as claim_outbox walks them;
-- each key with room (harel_flow_room) is walked on its own, by rank, up to its room, the
-- walks merged by priority, rank and seq (a recursive query whose queue is ordered: it stops
-- once ?2 rows came out); the two merged the same way. ?5: the claim's token, by which its
-- batch logs what it took for the keys with a rate (log_flow_claims).
WITH RECURSIVE
    flow (key, priority, room) AS MATERIALIZED (
        SELECT key, priority, min(coalesce(room, ?2), ?2) FROM harel_flow_room),
    walk (key, priority, room, n, rank, seq) AS (
        SELECT key, priority, room, 0, -1, 0 FROM flow WHERE room > 0
        UNION ALL
        SELECT w.key, w.priority, w.room, w.n + 1, i.flow_rank, i.seq
        FROM walk AS w JOIN harel_outbox AS i ON i.seq = (
            SELECT seq FROM harel_outbox
            WHERE flow_key = w.key AND seq > 0 AND (flow_rank, seq) > (w.rank, w.seq)
              AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
              AND (?4 IS NULL OR attempts < ?4)
            ORDER BY flow_rank, seq LIMIT 1)
        WHERE w.n < w.room
        ORDER BY 2 DESC, 5, 6 LIMIT ?2 + (SELECT count(*) FROM flow WHERE room > 0))
UPDATE harel_outbox
SET claimed_by = ?1, claimed_until = (julianday('now') - 2440587.5) * 86400.0 + ?3,
    attempts = attempts + 1, claim_token = ?5
WHERE seq IN (
    SELECT seq FROM (
        SELECT * FROM (
            SELECT 0 AS priority, flow_rank AS rank, seq FROM harel_outbox
            WHERE seq > 0 AND flowed = 0
              AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
              AND (?4 IS NULL OR attempts < ?4)
              AND EXISTS (SELECT 1 FROM harel_flows)
            ORDER BY flow_rank, seq LIMIT ?2)
        UNION ALL
        SELECT priority, rank, seq FROM walk WHERE n > 0)
    ORDER BY priority DESC, rank, seq LIMIT ?2)
RETURNING seq, target_id, event, created_at, traceparent,
          flow_rank, coalesce((SELECT priority FROM harel_flows WHERE key = harel_outbox.flow_key), 0);

-- What a worker does with the entries it claimed, by seq (?N: a JSON array of seqs, one
-- statement for any number; json_each's integers are exact). `+claimed_by`: each row is found by
-- its seq, never through the worker's index (harel_outbox_worker), which holds all it has.

-- name: ack_outbox!
-- Delivered: gone for good, whoever holds them, live or dead (an ack discards a dead letter).
DELETE FROM harel_outbox
WHERE seq IN (SELECT value FROM json_each(?1) UNION ALL SELECT -value FROM json_each(?1));

-- name: ack_held_outbox!
-- A relay's own ack: of the entries ?2, those worker ?1 still holds (its lease run out or
-- not). One a handler consumed, one revived, or one another worker claimed since is spared.
DELETE FROM harel_outbox WHERE seq IN (SELECT value FROM json_each(?2)) AND +claimed_by = ?1;

-- name: fail_outbox!
-- Not delivered: of the entries ?2, those worker ?1 still holds under its lease record the
-- error ?3 and become claimable ?4 seconds from now (nobody holds them meanwhile).
UPDATE harel_outbox
SET last_error = ?3, claimed_by = NULL,
    claimed_until = (julianday('now') - 2440587.5) * 86400.0 + ?4
WHERE seq IN (SELECT value FROM json_each(?2)) AND +claimed_by = ?1
  AND claimed_until > (julianday('now') - 2440587.5) * 86400.0;

-- name: extend_outbox
-- row: seq int
-- Of the entries ?2, those worker ?1 still holds: leased for ?3 seconds from now.
UPDATE harel_outbox SET claimed_until = (julianday('now') - 2440587.5) * 86400.0 + ?3
WHERE seq IN (SELECT value FROM json_each(?2)) AND +claimed_by = ?1
  AND claimed_until > (julianday('now') - 2440587.5) * 86400.0
RETURNING seq;

-- name: revive_outbox!
-- Live again (a dead letter's seq restored), no attempt counted, claimable at once.
-- Its key may have got or lost settings while it was dead: flowed as it is now.
UPDATE harel_outbox
SET seq = abs(seq), attempts = 0, claimed_by = NULL, claimed_until = NULL, dead_at = NULL,
    flowed = EXISTS (SELECT 1 FROM harel_flows WHERE key = harel_outbox.flow_key)
WHERE seq IN (SELECT value FROM json_each(?1) UNION ALL SELECT -value FROM json_each(?1));

-- name: release_outbox!
-- Claimed and not handled (a relay stopping): of the entries ?2, those worker ?1 still
-- holds are claimable at once, and the claim's attempt is given back.
UPDATE harel_outbox SET claimed_by = NULL, claimed_until = NULL, attempts = max(attempts - 1, 0)
WHERE seq IN (SELECT value FROM json_each(?2)) AND +claimed_by = ?1
  AND claimed_until > (julianday('now') - 2440587.5) * 86400.0;

-- The spawns' queue, as the outbox's.

-- name: pending_spawns
-- row: seq int, parent_id text, child_id text, root_path text, context text
SELECT seq, parent_id, child_id, root_path, context FROM harel_spawns
WHERE seq > 0 ORDER BY seq LIMIT ?1;

-- name: mark_dead_spawns
-- row: seq int, attempts int, last_error text?
UPDATE harel_spawns
SET seq = -seq, claimed_by = NULL, claimed_until = NULL,
    dead_at = (julianday('now') - 2440587.5) * 86400.0
WHERE seq IN (
    SELECT seq FROM (
        SELECT seq, attempts FROM harel_spawns INDEXED BY harel_spawns_rank
        WHERE seq > 0 AND flowed = 0
          AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
          AND NOT EXISTS (SELECT 1 FROM harel_flows)
        ORDER BY flow_rank, seq LIMIT ?2)
    WHERE attempts >= ?1)
RETURNING -seq, attempts, last_error;

-- name: mark_dead_spawns_flows
-- row: seq int, attempts int, last_error text?
-- mark_dead_spawns when some key has settings: the keys without them walked as there, and
-- each key with room (harel_flow_room) its own first ?2: never an item a claim may not take.
UPDATE harel_spawns
SET seq = -seq, claimed_by = NULL, claimed_until = NULL,
    dead_at = (julianday('now') - 2440587.5) * 86400.0
WHERE seq IN (
    SELECT seq FROM (
        SELECT seq, attempts FROM harel_spawns INDEXED BY harel_spawns_rank
        WHERE seq > 0 AND flowed = 0
          AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
          AND EXISTS (SELECT 1 FROM harel_flows)
        ORDER BY flow_rank, seq LIMIT ?2)
    WHERE attempts >= ?1
    UNION ALL
    SELECT i.seq FROM harel_flow_room AS f CROSS JOIN harel_spawns AS i
    WHERE (f.room IS NULL OR f.room > 0) AND i.attempts >= ?1 AND i.seq IN (
        SELECT seq FROM harel_spawns
        WHERE flow_key = f.key AND seq > 0
          AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
        ORDER BY flow_rank, seq LIMIT ?2))
RETURNING -seq, attempts, last_error;

-- name: claim_spawns
-- row: seq int, parent_id text, child_id text, root_path text, context text, created_at any, traceparent any, flow_rank int, priority int
UPDATE harel_spawns
SET claimed_by = ?1, claimed_until = (julianday('now') - 2440587.5) * 86400.0 + ?3,
    attempts = attempts + 1
WHERE seq IN (
    SELECT seq FROM harel_spawns
    WHERE seq > 0 AND flowed = 0
      AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
      AND (?4 IS NULL OR attempts < ?4)
      AND NOT EXISTS (SELECT 1 FROM harel_flows)
    ORDER BY flow_rank, seq LIMIT ?2)
RETURNING seq, parent_id, child_id, root_path, context, created_at, traceparent,
          flow_rank, 0;

-- name: claim_spawns_flows
-- row: seq int, parent_id text, child_id text, root_path text, context text, created_at any, traceparent any, flow_rank int, priority int
WITH RECURSIVE
    flow (key, priority, room) AS MATERIALIZED (
        SELECT key, priority, min(coalesce(room, ?2), ?2) FROM harel_flow_room),
    walk (key, priority, room, n, rank, seq) AS (
        SELECT key, priority, room, 0, -1, 0 FROM flow WHERE room > 0
        UNION ALL
        SELECT w.key, w.priority, w.room, w.n + 1, i.flow_rank, i.seq
        FROM walk AS w JOIN harel_spawns AS i ON i.seq = (
            SELECT seq FROM harel_spawns
            WHERE flow_key = w.key AND seq > 0 AND (flow_rank, seq) > (w.rank, w.seq)
              AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
              AND (?4 IS NULL OR attempts < ?4)
            ORDER BY flow_rank, seq LIMIT 1)
        WHERE w.n < w.room
        ORDER BY 2 DESC, 5, 6 LIMIT ?2 + (SELECT count(*) FROM flow WHERE room > 0))
UPDATE harel_spawns
SET claimed_by = ?1, claimed_until = (julianday('now') - 2440587.5) * 86400.0 + ?3,
    attempts = attempts + 1, claim_token = ?5
WHERE seq IN (
    SELECT seq FROM (
        SELECT * FROM (
            SELECT 0 AS priority, flow_rank AS rank, seq FROM harel_spawns
            WHERE seq > 0 AND flowed = 0
              AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
              AND (?4 IS NULL OR attempts < ?4)
              AND EXISTS (SELECT 1 FROM harel_flows)
            ORDER BY flow_rank, seq LIMIT ?2)
        UNION ALL
        SELECT priority, rank, seq FROM walk WHERE n > 0)
    ORDER BY priority DESC, rank, seq LIMIT ?2)
RETURNING seq, parent_id, child_id, root_path, context, created_at, traceparent,
          flow_rank, coalesce((SELECT priority FROM harel_flows WHERE key = harel_spawns.flow_key), 0);

-- name: ack_spawns!
DELETE FROM harel_spawns
WHERE seq IN (SELECT value FROM json_each(?1) UNION ALL SELECT -value FROM json_each(?1));

-- name: ack_held_spawns!
DELETE FROM harel_spawns WHERE seq IN (SELECT value FROM json_each(?2)) AND +claimed_by = ?1;

-- name: fail_spawns!
UPDATE harel_spawns
SET last_error = ?3, claimed_by = NULL,
    claimed_until = (julianday('now') - 2440587.5) * 86400.0 + ?4
WHERE seq IN (SELECT value FROM json_each(?2)) AND +claimed_by = ?1
  AND claimed_until > (julianday('now') - 2440587.5) * 86400.0;

-- name: extend_spawns
-- row: seq int
UPDATE harel_spawns SET claimed_until = (julianday('now') - 2440587.5) * 86400.0 + ?3
WHERE seq IN (SELECT value FROM json_each(?2)) AND +claimed_by = ?1
  AND claimed_until > (julianday('now') - 2440587.5) * 86400.0
RETURNING seq;

-- name: revive_spawns!
UPDATE harel_spawns
SET seq = abs(seq), attempts = 0, claimed_by = NULL, claimed_until = NULL, dead_at = NULL,
    flowed = EXISTS (SELECT 1 FROM harel_flows WHERE key = harel_spawns.flow_key)
WHERE seq IN (SELECT value FROM json_each(?1) UNION ALL SELECT -value FROM json_each(?1));

-- name: release_spawns!
UPDATE harel_spawns SET claimed_by = NULL, claimed_until = NULL, attempts = max(attempts - 1, 0)
WHERE seq IN (SELECT value FROM json_each(?2)) AND +claimed_by = ?1
  AND claimed_until > (julianday('now') - 2440587.5) * 86400.0;

-- The timers' queue: live timers due at the caller's clock (?N: now), soonest first. Ties in
-- fire_at in primary-key order, which the fire_at index holds: a limit cuts them the same
-- way every time, with no sort. A timer is acked (delete_timer), failed, extended or revived
-- one statement each, by its key and fire_at: only as it was claimed, so a re-armed timer
-- (a new fire_at, claim dropped) is spared. Floats are bound, never read from JSON text.

-- name: due_timers
-- row: execution_id text, path text, fire_at real
SELECT execution_id, path, fire_at FROM harel_timers WHERE fire_at <= ?1 AND dead_at IS NULL
ORDER BY fire_at, execution_id, path LIMIT ?2;

-- name: mark_dead_timers
-- row: execution_id text, path text, fire_at real, attempts int, last_error text?
-- As mark_dead_outbox, for timers due at ?3: of the claimable due ones (all of them, as
-- their claim reads them), up to ?2 whose attempts reached ?1.
UPDATE harel_timers
SET claimed_by = NULL, claimed_until = NULL, dead_at = (julianday('now') - 2440587.5) * 86400.0
WHERE (execution_id, path) IN (
    SELECT execution_id, path FROM harel_timers INDEXED BY harel_timers_fire_at
    WHERE fire_at <= ?3 AND dead_at IS NULL AND attempts >= ?1
      AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
      AND NOT EXISTS (SELECT 1 FROM harel_flows)
    ORDER BY fire_at, execution_id, path LIMIT ?2)
RETURNING execution_id, path, fire_at, attempts, last_error;

-- name: mark_dead_timers_flows
-- row: execution_id text, path text, fire_at real, attempts int, last_error text?
-- mark_dead_timers when some key has settings: a timer of a key with settings only while
-- its key has room.
UPDATE harel_timers
SET claimed_by = NULL, claimed_until = NULL, dead_at = (julianday('now') - 2440587.5) * 86400.0
WHERE (execution_id, path) IN (
    SELECT execution_id, path FROM harel_timers INDEXED BY harel_timers_fire_at
    WHERE fire_at <= ?3 AND dead_at IS NULL AND attempts >= ?1
      AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
      AND EXISTS (SELECT 1 FROM harel_flows)
      AND (flowed = 0
           OR flow_key IN (SELECT key FROM harel_flow_room WHERE room IS NULL OR room > 0))
    ORDER BY fire_at, execution_id, path LIMIT ?2)
RETURNING execution_id, path, fire_at, attempts, last_error;

-- name: claim_due_timers
-- row: execution_id text, path text, fire_at real, traceparent any
-- Timers due at ?4 (the caller's clock, as for due_timers); the lease on the database's;
-- ?5 max_attempts. Round-robin across keys too: the claimable due timers are ranked in
-- their key, soonest first (n), and taken by rank, then as before. That reads every
-- claimable due timer (normally a few: they are claimed as they come due).
UPDATE harel_timers
SET claimed_by = ?1, claimed_until = (julianday('now') - 2440587.5) * 86400.0 + ?3,
    attempts = attempts + 1
WHERE (execution_id, path) IN (
    SELECT execution_id, path FROM (
        SELECT execution_id, path, fire_at,
               row_number() OVER (PARTITION BY flow_key ORDER BY fire_at, execution_id, path) AS n
        FROM harel_timers INDEXED BY harel_timers_fire_at
        WHERE fire_at <= ?4 AND dead_at IS NULL
          AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
          AND (?5 IS NULL OR attempts < ?5)
          AND NOT EXISTS (SELECT 1 FROM harel_flows))
    ORDER BY n, fire_at, execution_id, path LIMIT ?2)
RETURNING execution_id, path, fire_at, traceparent;

-- name: claim_due_timers_flows
-- row: execution_id text, path text, fire_at real, traceparent any
-- claim_due_timers when some key has settings: a timer of a key with settings only within
-- its room, by its key's priority first. ?6: the claim's token (as claim_outbox_flows).
WITH flow (key, priority, room) AS MATERIALIZED (SELECT key, priority, room FROM harel_flow_room)
UPDATE harel_timers
SET claimed_by = ?1, claimed_until = (julianday('now') - 2440587.5) * 86400.0 + ?3,
    attempts = attempts + 1, claim_token = ?6
WHERE (execution_id, path) IN (
    SELECT execution_id, path FROM (
        SELECT t.execution_id, t.path, t.fire_at, coalesce(f.priority, 0) AS priority, f.room,
               row_number() OVER (PARTITION BY t.flow_key
                                  ORDER BY t.fire_at, t.execution_id, t.path) AS n
        FROM harel_timers AS t INDEXED BY harel_timers_fire_at
        LEFT JOIN flow AS f ON t.flowed = 1 AND f.key = t.flow_key
        WHERE t.fire_at <= ?4 AND t.dead_at IS NULL
          AND (t.claimed_until IS NULL OR t.claimed_until <= (julianday('now') - 2440587.5) * 86400.0)
          AND (?5 IS NULL OR t.attempts < ?5)
          AND (t.flowed = 0 OR f.room IS NULL OR f.room > 0)
          AND EXISTS (SELECT 1 FROM harel_flows))
    WHERE n <= coalesce(room, ?2)
    ORDER BY priority DESC, n, fire_at, execution_id, path LIMIT ?2)
RETURNING execution_id, path, fire_at, traceparent;

-- name: delete_timer!
-- Only the timer as it was swept (live or dead): a concurrent re-schedule to a new time
-- survives.
DELETE FROM harel_timers WHERE execution_id = ? AND path = ? AND fire_at = ?;

-- name: ack_held_timer!
-- As ack_held_outbox, for the timer (?2, ?3) at fire_at ?4: a re-arm dropped the claim.
DELETE FROM harel_timers
WHERE execution_id = ?2 AND path = ?3 AND fire_at = ?4 AND claimed_by = ?1;

-- name: fail_timer!
-- As fail_outbox, for the timer (?2, ?3) at fire_at ?4: error ?5, claimable ?6 s from now.
UPDATE harel_timers
SET last_error = ?5, claimed_by = NULL,
    claimed_until = (julianday('now') - 2440587.5) * 86400.0 + ?6
WHERE execution_id = ?2 AND path = ?3 AND fire_at = ?4 AND claimed_by = ?1
  AND claimed_until > (julianday('now') - 2440587.5) * 86400.0;

-- name: extend_timer!
UPDATE harel_timers SET claimed_until = (julianday('now') - 2440587.5) * 86400.0 + ?5
WHERE execution_id = ?2 AND path = ?3 AND fire_at = ?4 AND claimed_by = ?1
  AND claimed_until > (julianday('now') - 2440587.5) * 86400.0;

-- name: revive_timer!
UPDATE harel_timers SET attempts = 0, claimed_by = NULL, claimed_until = NULL, dead_at = NULL,
    flowed = EXISTS (SELECT 1 FROM harel_flows WHERE key = harel_timers.flow_key)
WHERE execution_id = ? AND path = ? AND fire_at = ?;

-- name: release_timer!
UPDATE harel_timers SET claimed_by = NULL, claimed_until = NULL, attempts = max(attempts - 1, 0)
WHERE execution_id = ?2 AND path = ?3 AND fire_at = ?4 AND claimed_by = ?1
  AND claimed_until > (julianday('now') - 2440587.5) * 86400.0;

-- What a claim's batch writes beside its claims: where the claims stand (the clock) and, for
-- the keys with a rate, what it took. Statements of the batch, not triggers: a trigger is
-- compiled into every statement that writes its column, and libsql compiles each statement
-- at each call.

-- name: advance_clock!
-- The flow clock of each kind moved to the highest rank worker ?1 holds of the keys without
-- settings: one seek of each harel_*_worker. Only ever forward (what it held from before is
-- below it); nothing written when it stays.
INSERT INTO harel_flow_clock (kind, rank)
SELECT kind, r FROM (
    SELECT 'outbox' AS kind, (SELECT max(flow_rank) FROM harel_outbox
                              WHERE claimed_by = ?1 AND flowed = 0) AS r
    UNION ALL
    SELECT 'spawn', (SELECT max(flow_rank) FROM harel_spawns WHERE claimed_by = ?1 AND flowed = 0))
WHERE r IS NOT NULL
ON CONFLICT (kind) DO UPDATE SET rank = excluded.rank WHERE rank < excluded.rank;

-- name: advance_clock_flows!
-- advance_clock when some key has settings: the keys at priority 0 with settings count too
-- (the keys that wait behind a higher priority keep their place). Reads what worker ?1
-- holds.
INSERT INTO harel_flow_clock (kind, rank)
SELECT kind, r FROM (
    SELECT 'outbox' AS kind, (
        SELECT max(flow_rank) FROM harel_outbox AS i WHERE claimed_by = ?1
          AND (flowed = 0 OR EXISTS (SELECT 1 FROM harel_flows WHERE key = i.flow_key AND priority = 0))
    ) AS r
    UNION ALL
    SELECT 'spawn', (
        SELECT max(flow_rank) FROM harel_spawns AS i WHERE claimed_by = ?1
          AND (flowed = 0 OR EXISTS (SELECT 1 FROM harel_flows WHERE key = i.flow_key AND priority = 0))))
WHERE r IS NOT NULL
ON CONFLICT (kind) DO UPDATE SET rank = excluded.rank WHERE rank < excluded.rank;

-- name: log_flow_claims_outbox!
-- What the flow-honouring claim of token ?2 took for worker ?1, of the keys with a rate: a
-- row each in their log (a rate counts them, acked or not), written at once, so the claims
-- of the other kinds in the same batch count them. Each key with a rate seeks the few items
-- it holds.
INSERT INTO harel_flow_claims (key, claimed_at)
SELECT i.flow_key, (julianday('now') - 2440587.5) * 86400.0
FROM harel_flows AS f CROSS JOIN harel_outbox AS i
WHERE f.rate_count IS NOT NULL AND i.flow_key = f.key AND i.claimed_by IS NOT NULL
  AND i.flowed = 1 AND i.claimed_until > (julianday('now') - 2440587.5) * 86400.0 AND i.claimed_by = ?1 AND i.claim_token = ?2;

-- name: log_flow_claims_spawns!
INSERT INTO harel_flow_claims (key, claimed_at)
SELECT i.flow_key, (julianday('now') - 2440587.5) * 86400.0
FROM harel_flows AS f CROSS JOIN harel_spawns AS i
WHERE f.rate_count IS NOT NULL AND i.flow_key = f.key AND i.claimed_by IS NOT NULL
  AND i.flowed = 1 AND i.claimed_until > (julianday('now') - 2440587.5) * 86400.0 AND i.claimed_by = ?1 AND i.claim_token = ?2;

-- name: log_flow_claims_timers!
INSERT INTO harel_flow_claims (key, claimed_at)
SELECT i.flow_key, (julianday('now') - 2440587.5) * 86400.0
FROM harel_flows AS f CROSS JOIN harel_timers AS i
WHERE f.rate_count IS NOT NULL AND i.flow_key = f.key AND i.claimed_by IS NOT NULL
  AND i.flowed = 1 AND i.claimed_until > (julianday('now') - 2440587.5) * 86400.0 AND i.claimed_by = ?1 AND i.claim_token = ?2;

-- name: prune_flow_claims!
-- The rate log's rows no window counts any more (a key's, or one with no rate now): a
-- claims batch ends with it while some key has settings.
DELETE FROM harel_flow_claims
WHERE claimed_at <= (julianday('now') - 2440587.5) * 86400.0
    - coalesce((SELECT rate_seconds FROM harel_flows WHERE key = harel_flow_claims.key), 0);

-- name: touch_flows!
-- Room made under a limit (an ack, a fail, a release of held items: outbox entries of the
-- JSON array of seqs ?1, spawns of ?2, timers of ?3's [execution_id, path] pairs): the
-- limited keys among theirs marked freed now, so that a server's change notifications wake
-- the relays waiting for that room (a file's watch hears every commit). Run before the items
-- go, by a batch that runs it only while some key has settings.
UPDATE harel_flows SET freed_at = (julianday('now') - 2440587.5) * 86400.0
WHERE concurrency IS NOT NULL AND key IN (
    SELECT flow_key FROM harel_outbox WHERE seq IN (SELECT value FROM json_each(?1)) AND flowed = 1
    UNION ALL
    SELECT flow_key FROM harel_spawns WHERE seq IN (SELECT value FROM json_each(?2)) AND flowed = 1
    UNION ALL
    SELECT t.flow_key FROM json_each(?3) AS j JOIN harel_timers AS t
    ON t.execution_id = json_extract(j.value, '$[0]') AND t.path = json_extract(j.value, '$[1]')
    WHERE t.flowed = 1);

-- name: touch_held_flows!
-- As touch_flows, for every limited key of what worker ?1 holds (release_worker).
UPDATE harel_flows SET freed_at = (julianday('now') - 2440587.5) * 86400.0
WHERE concurrency IS NOT NULL AND key IN (
    SELECT flow_key FROM harel_outbox WHERE claimed_by = ?1 AND flowed = 1
    UNION ALL
    SELECT flow_key FROM harel_spawns WHERE claimed_by = ?1 AND flowed = 1
    UNION ALL
    SELECT flow_key FROM harel_timers WHERE claimed_by = ?1 AND flowed = 1);

-- name: work_ahead=
-- row: outbox int, spawns int, timers int, next_timer_at real?, flows int
-- What a relay could claim at ?1 (the caller's clock, as claim_due_timers takes it), without
-- claiming it: whether an outbox entry, a spawn and a timer due at ?1 are claimable (live,
-- held by no live lease nor waiting out a fail's retry), and the soonest live timer not due
-- at ?1. Each EXISTS walks its queue from its first live row, as a claim does, and stops at
-- the first claimable one; the last part is one seek of the fire_at index. A relay reads
-- this before it claims, so that an idle one writes nothing; a claim_work batch reads it
-- after its claims, so that a relay knows at once whether to claim again. The last column
-- says whether some key has settings (0011): then the first three may count items a claim
-- must leave (paused, or at their limit), and work_ahead_flows says what is claimable.
SELECT
    EXISTS (SELECT 1 FROM harel_outbox WHERE seq > 0
            AND (claimed_until IS NULL
                 OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)),
    EXISTS (SELECT 1 FROM harel_spawns WHERE seq > 0
            AND (claimed_until IS NULL
                 OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)),
    EXISTS (SELECT 1 FROM harel_timers WHERE fire_at <= ?1 AND dead_at IS NULL
            AND (claimed_until IS NULL
                 OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)),
    (SELECT min(fire_at) FROM harel_timers WHERE fire_at > ?1 AND dead_at IS NULL),
    EXISTS (SELECT 1 FROM harel_flows);

-- name: work_ahead_flows=
-- row: outbox int, spawns int, timers int, next_timer_at real?, flows int
-- work_ahead when some key has settings: an item of a key with settings counts only if its
-- key has room (harel_flow_room), so that a relay whose only work is paused or at its
-- limit sleeps. The keys without settings are walked by rank as the claims walk them (a
-- paused backlog is never stepped over), each key with room by its own index.
WITH flow (key) AS MATERIALIZED (
    SELECT key FROM harel_flow_room WHERE room IS NULL OR room > 0)
SELECT
    EXISTS (SELECT 1 FROM harel_outbox INDEXED BY harel_outbox_rank
            WHERE seq > 0 AND flowed = 0
              AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0))
    OR EXISTS (SELECT 1 FROM flow AS f CROSS JOIN harel_outbox AS i INDEXED BY harel_outbox_flow
               ON i.flow_key = f.key
               WHERE i.seq > 0 AND (i.claimed_until IS NULL OR i.claimed_until <= (julianday('now') - 2440587.5) * 86400.0)),
    EXISTS (SELECT 1 FROM harel_spawns INDEXED BY harel_spawns_rank
            WHERE seq > 0 AND flowed = 0
              AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0))
    OR EXISTS (SELECT 1 FROM flow AS f CROSS JOIN harel_spawns AS i INDEXED BY harel_spawns_flow
               ON i.flow_key = f.key
               WHERE i.seq > 0 AND (i.claimed_until IS NULL OR i.claimed_until <= (julianday('now') - 2440587.5) * 86400.0)),
    EXISTS (SELECT 1 FROM harel_timers WHERE fire_at <= ?1 AND dead_at IS NULL AND flowed = 0
            AND (claimed_until IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0))
    OR EXISTS (SELECT 1 FROM flow AS f CROSS JOIN harel_timers AS t INDEXED BY harel_timers_flow
               ON t.flow_key = f.key
               WHERE t.fire_at <= ?1 AND t.dead_at IS NULL
                 AND (t.claimed_until IS NULL OR t.claimed_until <= (julianday('now') - 2440587.5) * 86400.0)),
    (SELECT min(fire_at) FROM harel_timers WHERE fire_at > ?1 AND dead_at IS NULL),
    EXISTS (SELECT 1 FROM harel_flows);

-- name: flows_in_use$
-- row: flows int
-- Whether some key has settings: which of a claim's two statements fits (see the claims).
SELECT EXISTS (SELECT 1 FROM harel_flows);

-- name: flows_gate$
-- flows_in_use as a remote batch's gate: fails (json() of a text that is not JSON) when
-- some key has settings, so that the server runs a claim's plain statements while it
-- passed and the _flows ones once it failed, not both.
SELECT CASE WHEN EXISTS (SELECT 1 FROM harel_flows) THEN json('harel-store: some flow key has settings') END;

-- Flow control (0011): the settings of flow keys (harel_flows), which every claim honours
-- (the claims above), and what each worker holds.

-- name: set_flow!
-- Every setting of key ?1 at once (a row made or replaced).
INSERT INTO harel_flows (key, priority, concurrency, paused, rate_count, rate_seconds, updated_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, (julianday('now') - 2440587.5) * 86400.0)
ON CONFLICT (key) DO UPDATE
SET priority = excluded.priority, concurrency = excluded.concurrency, paused = excluded.paused,
    rate_count = excluded.rate_count, rate_seconds = excluded.rate_seconds,
    updated_at = excluded.updated_at;

-- name: pause_flow!
-- Key ?1 paused (?2 = 1) or resumed (?2 = 0), its other settings kept. Pausing a key with
-- no settings gives it a row of defaults, paused; resuming one leaves it without.
INSERT INTO harel_flows (key, paused, updated_at)
SELECT ?1, ?2, (julianday('now') - 2440587.5) * 86400.0 WHERE ?2 = 1 OR EXISTS (SELECT 1 FROM harel_flows WHERE key = ?1)
ON CONFLICT (key) DO UPDATE SET paused = excluded.paused, updated_at = excluded.updated_at;

-- name: clear_flow!
DELETE FROM harel_flows WHERE key = ?1;

-- name: forget_flow_claims!
-- The rate log of key ?1, when it has no rate (any more).
DELETE FROM harel_flow_claims
WHERE key = ?1 AND NOT EXISTS (SELECT 1 FROM harel_flows WHERE key = ?1 AND rate_count IS NOT NULL);

-- name: mark_flowed_outbox!
-- The live items of key ?1 marked as the flows say (flowed: the key has settings), so the
-- claims walk them as they must; those marked already are left alone (a change of a key's
-- settings writes nothing more). One range of harel_*_flow; dead ones are marked when
-- revived or re-armed.
UPDATE harel_outbox SET flowed = EXISTS (SELECT 1 FROM harel_flows WHERE key = ?1)
WHERE flow_key = ?1 AND seq > 0 AND flowed <> EXISTS (SELECT 1 FROM harel_flows WHERE key = ?1);

-- name: mark_flowed_spawns!
UPDATE harel_spawns SET flowed = EXISTS (SELECT 1 FROM harel_flows WHERE key = ?1)
WHERE flow_key = ?1 AND seq > 0 AND flowed <> EXISTS (SELECT 1 FROM harel_flows WHERE key = ?1);

-- name: mark_flowed_timers!
UPDATE harel_timers SET flowed = EXISTS (SELECT 1 FROM harel_flows WHERE key = ?1)
WHERE flow_key = ?1 AND dead_at IS NULL
  AND flowed <> EXISTS (SELECT 1 FROM harel_flows WHERE key = ?1);

-- name: rerank_items_outbox!
-- Items handed back (release) or revived, outbox entries of the JSON array of seqs ?1,
-- whose ranks are below where the claims stand: their keys' live items ranked again from
-- there, in their order (as rerank_outbox), so that what comes back takes turns with the
-- keys that came meanwhile instead of every claim until it caught up. Only such keys: an
-- item handed back at once after its claim is where the claims stand already. ?2: the
-- releasing worker (run before its release): only the items it holds under a live lease,
-- those its release hands back (NULL: a revive's, run after it).
UPDATE harel_outbox SET flow_rank = ranked.rank
FROM (SELECT seq, coalesce((SELECT rank FROM harel_flow_clock WHERE kind = 'outbox'), 0)
                  + row_number() OVER (PARTITION BY flow_key ORDER BY flow_rank, seq) - 1 AS rank
      FROM harel_outbox WHERE seq > 0 AND flow_key IN (
          SELECT flow_key FROM harel_outbox WHERE seq IN (SELECT value FROM json_each(?1))
            AND (?2 IS NULL OR (+claimed_by = ?2 AND claimed_until > (julianday('now') - 2440587.5) * 86400.0))
            AND flow_rank < coalesce((SELECT rank FROM harel_flow_clock WHERE kind = 'outbox'), 0))) AS ranked
WHERE harel_outbox.seq = ranked.seq;

-- name: rerank_items_spawns!
UPDATE harel_spawns SET flow_rank = ranked.rank
FROM (SELECT seq, coalesce((SELECT rank FROM harel_flow_clock WHERE kind = 'spawn'), 0)
                  + row_number() OVER (PARTITION BY flow_key ORDER BY flow_rank, seq) - 1 AS rank
      FROM harel_spawns WHERE seq > 0 AND flow_key IN (
          SELECT flow_key FROM harel_spawns WHERE seq IN (SELECT value FROM json_each(?1))
            AND (?2 IS NULL OR (+claimed_by = ?2 AND claimed_until > (julianday('now') - 2440587.5) * 86400.0))
            AND flow_rank < coalesce((SELECT rank FROM harel_flow_clock WHERE kind = 'spawn'), 0))) AS ranked
WHERE harel_spawns.seq = ranked.seq;

-- name: rerank_worker_outbox!
-- As rerank_items_outbox, for what worker ?1 holds under a live lease (release_worker:
-- before its release).
UPDATE harel_outbox SET flow_rank = ranked.rank
FROM (SELECT seq, coalesce((SELECT rank FROM harel_flow_clock WHERE kind = 'outbox'), 0)
                  + row_number() OVER (PARTITION BY flow_key ORDER BY flow_rank, seq) - 1 AS rank
      FROM harel_outbox WHERE seq > 0 AND flow_key IN (
          SELECT flow_key FROM harel_outbox WHERE claimed_by = ?1 AND claimed_until > (julianday('now') - 2440587.5) * 86400.0
            AND flow_rank < coalesce((SELECT rank FROM harel_flow_clock WHERE kind = 'outbox'), 0))) AS ranked
WHERE harel_outbox.seq = ranked.seq;

-- name: rerank_worker_spawns!
UPDATE harel_spawns SET flow_rank = ranked.rank
FROM (SELECT seq, coalesce((SELECT rank FROM harel_flow_clock WHERE kind = 'spawn'), 0)
                  + row_number() OVER (PARTITION BY flow_key ORDER BY flow_rank, seq) - 1 AS rank
      FROM harel_spawns WHERE seq > 0 AND flow_key IN (
          SELECT flow_key FROM harel_spawns WHERE claimed_by = ?1 AND claimed_until > (julianday('now') - 2440587.5) * 86400.0
            AND flow_rank < coalesce((SELECT rank FROM harel_flow_clock WHERE kind = 'spawn'), 0))) AS ranked
WHERE harel_spawns.seq = ranked.seq;

-- name: rerank_outbox!
-- A change of settings that leaves key ?1 unpaused (?2 = 1), of a key that has some now: its
-- live items take ranks from where the claims stand (the flow clock), in their order, as if
-- committed now. So a backlog kept while paused, or behind a limit now lifted, takes its
-- turns with the other keys instead of every claim until it caught up.
UPDATE harel_outbox SET flow_rank = ranked.rank
FROM (SELECT seq, coalesce((SELECT rank FROM harel_flow_clock WHERE kind = 'outbox'), 0)
             + row_number() OVER (ORDER BY flow_rank, seq) - 1 AS rank
      FROM harel_outbox WHERE flow_key = ?1 AND seq > 0) AS ranked
WHERE harel_outbox.seq = ranked.seq
  AND ?2 AND EXISTS (SELECT 1 FROM harel_flows WHERE key = ?1);

-- name: rerank_spawns!
UPDATE harel_spawns SET flow_rank = ranked.rank
FROM (SELECT seq, coalesce((SELECT rank FROM harel_flow_clock WHERE kind = 'spawn'), 0)
             + row_number() OVER (ORDER BY flow_rank, seq) - 1 AS rank
      FROM harel_spawns WHERE flow_key = ?1 AND seq > 0) AS ranked
WHERE harel_spawns.seq = ranked.seq
  AND ?2 AND EXISTS (SELECT 1 FROM harel_flows WHERE key = ?1);

-- name: flows
-- row: key text, priority int, concurrency int?, paused int, rate_count int?, rate_seconds real?, pending int, held int
-- The keys with settings (key ?1 alone, or all when NULL), by key, with their items: pending
-- (outbox entries and spawns live and not held, timers due and not held) and held (under a
-- live lease), all kinds. A range of each queue's flow index a key.
SELECT f.key, f.priority, f.concurrency, f.paused, f.rate_count, f.rate_seconds,
       (SELECT count(*) FROM harel_outbox WHERE flow_key = f.key AND seq > 0
        AND (claimed_by IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0))
       + (SELECT count(*) FROM harel_spawns WHERE flow_key = f.key AND seq > 0
          AND (claimed_by IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0))
       + (SELECT count(*) FROM harel_timers WHERE flow_key = f.key AND dead_at IS NULL
          AND fire_at <= (julianday('now') - 2440587.5) * 86400.0 AND (claimed_by IS NULL OR claimed_until <= (julianday('now') - 2440587.5) * 86400.0)),
       (SELECT count(*) FROM harel_outbox WHERE flow_key = f.key AND claimed_by IS NOT NULL AND flowed = 1 AND claimed_until > (julianday('now') - 2440587.5) * 86400.0)
       + (SELECT count(*) FROM harel_spawns WHERE flow_key = f.key AND claimed_by IS NOT NULL AND flowed = 1 AND claimed_until > (julianday('now') - 2440587.5) * 86400.0)
       + (SELECT count(*) FROM harel_timers WHERE flow_key = f.key AND claimed_by IS NOT NULL AND flowed = 1 AND claimed_until > (julianday('now') - 2440587.5) * 86400.0)
FROM harel_flows AS f WHERE ?1 IS NULL OR f.key = ?1 ORDER BY f.key;

-- name: held_by$
-- row: held int
-- Whether worker ?1 holds anything under a live lease: a relay's start reads it, so that one
-- that held nothing writes nothing. A seek of each harel_*_worker.
SELECT EXISTS (SELECT 1 FROM harel_outbox WHERE claimed_by = ?1 AND claimed_until > (julianday('now') - 2440587.5) * 86400.0)
    OR EXISTS (SELECT 1 FROM harel_spawns WHERE claimed_by = ?1 AND claimed_until > (julianday('now') - 2440587.5) * 86400.0)
    OR EXISTS (SELECT 1 FROM harel_timers WHERE claimed_by = ?1 AND claimed_until > (julianday('now') - 2440587.5) * 86400.0);

-- name: release_worker_outbox!
-- Failover: what worker ?1 holds under a live lease is claimable at once, each claim's
-- attempt given back (?2 = 1, as release_outbox) or kept (?2 = 0: a relay restarted under
-- its id, whose predecessor may have died of the item). One range of harel_*_worker.
UPDATE harel_outbox SET claimed_by = NULL, claimed_until = NULL, attempts = max(attempts - ?2, 0)
WHERE claimed_by = ?1 AND claimed_until > (julianday('now') - 2440587.5) * 86400.0;

-- name: release_worker_spawns!
UPDATE harel_spawns SET claimed_by = NULL, claimed_until = NULL, attempts = max(attempts - ?2, 0)
WHERE claimed_by = ?1 AND claimed_until > (julianday('now') - 2440587.5) * 86400.0;

-- name: release_worker_timers!
UPDATE harel_timers SET claimed_by = NULL, claimed_until = NULL, attempts = max(attempts - ?2, 0)
WHERE claimed_by = ?1 AND claimed_until > (julianday('now') - 2440587.5) * 86400.0;

-- name: workers
-- row: worker text, kind text, held int, lease_until real
-- What each worker holds under a live lease, by kind, and its latest lease's end: the held
-- rows of harel_*_worker, nothing else.
SELECT claimed_by, 'outbox', count(*), max(claimed_until) FROM harel_outbox
WHERE claimed_by IS NOT NULL AND claimed_until > (julianday('now') - 2440587.5) * 86400.0 GROUP BY claimed_by
UNION ALL
SELECT claimed_by, 'spawn', count(*), max(claimed_until) FROM harel_spawns
WHERE claimed_by IS NOT NULL AND claimed_until > (julianday('now') - 2440587.5) * 86400.0 GROUP BY claimed_by
UNION ALL
SELECT claimed_by, 'timer', count(*), max(claimed_until) FROM harel_timers
WHERE claimed_by IS NOT NULL AND claimed_until > (julianday('now') - 2440587.5) * 86400.0 GROUP BY claimed_by
ORDER BY 1, 2;

-- name: attempts_of
-- row: kind text, key any, path text?, fire_at real?, attempts int
-- The attempts of items, live or dead, in one read: the outbox entries and the spawns whose
-- seqs are in the JSON arrays ?1 and ?2, the timers whose [execution_id, path] are in ?3
-- (their fire_at comes back, for the store to match: no float is read from JSON text).
-- The first column names the kind as the statements do (outbox, spawns, timer).
SELECT 'outbox', abs(seq), NULL, NULL, attempts FROM harel_outbox
WHERE seq IN (SELECT value FROM json_each(?1) UNION ALL SELECT -value FROM json_each(?1))
UNION ALL
SELECT 'spawns', abs(seq), NULL, NULL, attempts FROM harel_spawns
WHERE seq IN (SELECT value FROM json_each(?2) UNION ALL SELECT -value FROM json_each(?2))
UNION ALL
SELECT 'timer', execution_id, path, fire_at, attempts FROM harel_timers
WHERE (execution_id, path) IN
    (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(?3));

-- name: dead_letters
-- row: kind text, dead_at real?, attempts int, last_error text?, seq int?, a text?, b text, c any, d text?
-- The first ?1 dead letters in the order they died (ties: outbox, spawn, timer, then by
-- key), of the kind ?2 (NULL: every kind): each kind's dead index read from its start, the
-- three merged. One shape for the three: kind, dead_at, attempts, last_error, then
--   outbox: seq, target_id, event
--   spawn:  seq, parent_id, child_id, root_path, context
--   timer:  NULL, execution_id, path, fire_at
SELECT * FROM (
    SELECT 'outbox', dead_at, attempts, last_error, -seq, target_id, event, NULL, NULL
    FROM harel_outbox WHERE dead_at IS NOT NULL AND (?2 IS NULL OR ?2 = 'outbox')
    ORDER BY dead_at, seq DESC LIMIT ?1)
UNION ALL
SELECT * FROM (
    SELECT 'spawn', dead_at, attempts, last_error, -seq, parent_id, child_id, root_path, context
    FROM harel_spawns WHERE dead_at IS NOT NULL AND (?2 IS NULL OR ?2 = 'spawn')
    ORDER BY dead_at, seq DESC LIMIT ?1)
UNION ALL
SELECT * FROM (
    SELECT 'timer', dead_at, attempts, last_error, NULL, execution_id, path, fire_at, NULL
    FROM harel_timers WHERE dead_at IS NOT NULL AND (?2 IS NULL OR ?2 = 'timer')
    ORDER BY dead_at, execution_id, path LIMIT ?1)
ORDER BY 2, 1, 5, 6, 7 LIMIT ?1;

-- The purge: executions deleted under their version CAS, with everything they own. Each
-- statement takes a JSON array: of [id, version] pairs (the CAS), or of ids (what they own).

-- name: purge_executions!
-- The purge CAS: the executions of ?1 ([[id, version], ...]) at those versions. A batch that
-- must delete all of them or none guards it with their number (Batch.guard(rows=N)).
DELETE FROM harel_executions
WHERE (id, version) IN (
    SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(?1));

-- name: purge_children_left!
-- The purge of whole trees guards this with rows=0: the children of ?1 (a JSON array of ids)
-- left once its members are gone, made by another writer after the tree was read. There
-- must be none; one found makes the batch roll back (so this deletes nothing that stays),
-- and the tree is read again.
DELETE FROM harel_executions
WHERE parent_id IN (SELECT value FROM json_each(?1));

-- What an execution owns, deleted in the purge's batch once its row is gone: after a purge
-- CAS that missed because the execution moved on, these delete nothing (no step of a
-- remote batch can branch on the one before); where no row existed at all they clear the
-- leftovers of an earlier interrupted purge. ?1: the ids, a JSON array.

-- name: purge_processed!
DELETE FROM harel_processed_events
WHERE execution_id IN (SELECT value FROM json_each(?1))
  AND NOT EXISTS (SELECT 1 FROM harel_executions WHERE id = harel_processed_events.execution_id);

-- name: purge_trace!
DELETE FROM harel_trace
WHERE execution_id IN (SELECT value FROM json_each(?1))
  AND NOT EXISTS (SELECT 1 FROM harel_executions WHERE id = harel_trace.execution_id);

-- name: purge_timers!
DELETE FROM harel_timers
WHERE execution_id IN (SELECT value FROM json_each(?1))
  AND NOT EXISTS (SELECT 1 FROM harel_executions WHERE id = harel_timers.execution_id);

-- name: purge_outbox!
DELETE FROM harel_outbox
WHERE target_id IN (SELECT value FROM json_each(?1))
  AND NOT EXISTS (SELECT 1 FROM harel_executions WHERE id = harel_outbox.target_id);

-- name: purge_spawns!
DELETE FROM harel_spawns
WHERE parent_id IN (SELECT value FROM json_each(?1))
  AND NOT EXISTS (SELECT 1 FROM harel_executions WHERE id = harel_spawns.parent_id);

-- Retention (0007): what a long-lived store may forget, oldest first, a bounded batch at a
-- time. Every time is epoch seconds on the database's clock.

-- name: finished_trees
-- row: root text, id text, version int, ripe int
-- The trees of the first ?2 final roots last updated before ?1, least recently updated
-- first (rows written before 0005, with no updated_at, before all: older than any time):
-- one row per member, each tree's root first, as (root, id, version, ripe). ripe: the
-- member is final and last updated before ?1 too; a tree goes only when every member is.
-- UNION stops at a cycle. The walk reads harel_executions_final_roots alone (INDEXED BY:
-- the planner would rather seek the status index and step over every final child).
WITH RECURSIVE
    roots (at, id) AS (
        SELECT * FROM (
            SELECT updated_at, id FROM harel_executions INDEXED BY harel_executions_final_roots
            WHERE parent_id IS NULL AND status IN ('finished', 'failed', 'cancelled')
              AND updated_at IS NULL
            LIMIT ?2)
        UNION ALL
        SELECT * FROM (
            SELECT updated_at, id FROM harel_executions INDEXED BY harel_executions_final_roots
            WHERE parent_id IS NULL AND status IN ('finished', 'failed', 'cancelled')
              AND updated_at < ?1
            ORDER BY updated_at LIMIT ?2)),
    tree (at, root, id) AS (
        SELECT * FROM (SELECT at, id, id FROM roots ORDER BY at, id LIMIT ?2)
        UNION
        SELECT tree.at, tree.root, e.id FROM harel_executions AS e JOIN tree ON e.parent_id = tree.id)
SELECT tree.root, e.id, e.version,
       COALESCE(e.status IN ('finished', 'failed', 'cancelled')
                AND (e.updated_at IS NULL OR e.updated_at < ?1), 0)
FROM tree CROSS JOIN harel_executions AS e ON e.id = tree.id -- CROSS: tree first, e by key
ORDER BY tree.at, tree.root, e.id <> tree.root, e.id;

-- name: orphan_trees
-- row: root text, id text, version int, ripe int
-- As finished_trees, for the final executions whose parent row is gone (purged alone, or
-- never there: a spawn made after gc took its parent), each the root of its own tree. The
-- walk reads harel_executions_final_children (0009) oldest first and probes each parent by
-- primary key, stepping over the final children whose parent is still there: purge_finished
-- reads it only once finished_trees has nothing to remove, when those are the children of
-- trees that cannot go yet.
WITH RECURSIVE
    roots (at, id) AS (
        SELECT * FROM (
            SELECT updated_at, id FROM harel_executions AS o
                INDEXED BY harel_executions_final_children
            WHERE parent_id IS NOT NULL AND status IN ('finished', 'failed', 'cancelled')
              AND updated_at IS NULL
              AND NOT EXISTS (SELECT 1 FROM harel_executions WHERE id = o.parent_id)
            LIMIT ?2)
        UNION ALL
        SELECT * FROM (
            SELECT updated_at, id FROM harel_executions AS o
                INDEXED BY harel_executions_final_children
            WHERE parent_id IS NOT NULL AND status IN ('finished', 'failed', 'cancelled')
              AND updated_at < ?1
              AND NOT EXISTS (SELECT 1 FROM harel_executions WHERE id = o.parent_id)
            ORDER BY updated_at LIMIT ?2)),
    tree (at, root, id) AS (
        SELECT * FROM (SELECT at, id, id FROM roots ORDER BY at, id LIMIT ?2)
        UNION
        SELECT tree.at, tree.root, e.id FROM harel_executions AS e JOIN tree ON e.parent_id = tree.id)
SELECT tree.root, e.id, e.version,
       COALESCE(e.status IN ('finished', 'failed', 'cancelled')
                AND (e.updated_at IS NULL OR e.updated_at < ?1), 0)
FROM tree CROSS JOIN harel_executions AS e ON e.id = tree.id -- CROSS: tree first, e by key
ORDER BY tree.at, tree.root, e.id <> tree.root, e.id;

-- name: forget_markers!
-- Up to ?2 markers recorded before ?1, of the first ?2 executions whose oldest marker is
-- (every one of them has at least one: markers_since is exact).
DELETE FROM harel_processed_events
WHERE (execution_id, event_id) IN (
    SELECT p.execution_id, p.event_id
    FROM (SELECT id FROM harel_executions WHERE markers_since < ?1
          ORDER BY markers_since LIMIT ?2) AS e
    JOIN harel_processed_events AS p ON p.execution_id = e.id
    WHERE p.recorded_at < ?1
    LIMIT ?2);

-- name: renew_markers_since!
-- After forget_markers, in its batch: the same executions' markers_since, the time of their
-- oldest marker left (NULL: none), written only where it moved.
UPDATE harel_executions
SET markers_since = (
    SELECT MIN(recorded_at) FROM harel_processed_events
    WHERE execution_id = harel_executions.id)
WHERE id IN (SELECT id FROM harel_executions WHERE markers_since < ?1
             ORDER BY markers_since LIMIT ?2)
  AND markers_since IS NOT (
    SELECT MIN(recorded_at) FROM harel_processed_events
    WHERE execution_id = harel_executions.id);

-- Dead letters that died before ?1, up to ?2 of each kind, oldest first (their dead indexes).

-- name: purge_dead_outbox!
DELETE FROM harel_outbox WHERE seq IN (
    SELECT seq FROM harel_outbox WHERE dead_at IS NOT NULL AND dead_at < ?1
    ORDER BY dead_at LIMIT ?2);

-- name: purge_dead_spawns!
DELETE FROM harel_spawns WHERE seq IN (
    SELECT seq FROM harel_spawns WHERE dead_at IS NOT NULL AND dead_at < ?1
    ORDER BY dead_at LIMIT ?2);

-- name: purge_dead_timers!
DELETE FROM harel_timers WHERE (execution_id, path) IN (
    SELECT execution_id, path FROM harel_timers WHERE dead_at IS NOT NULL AND dead_at < ?1
    ORDER BY dead_at LIMIT ?2);

-- name: retention_counts^
-- row: executions int, markers int, dead int
-- What a gc would remove (harel-store gc --dry-run): the executions of the trees, as
-- finished_trees and orphan_trees walk them, whose members are all final and last updated
-- before ?1 (NULL: not asked), the markers recorded before ?2, the dead letters dead before
-- ?3. The counts read what the batches would walk, to its end.
WITH RECURSIVE
    tree (root, id) AS (
        SELECT id, id FROM harel_executions INDEXED BY harel_executions_final_roots
        WHERE ?1 IS NOT NULL AND parent_id IS NULL
          AND status IN ('finished', 'failed', 'cancelled')
          AND (updated_at IS NULL OR updated_at < ?1)
        UNION ALL
        SELECT id, id FROM harel_executions AS o INDEXED BY harel_executions_final_children
        WHERE ?1 IS NOT NULL AND parent_id IS NOT NULL
          AND status IN ('finished', 'failed', 'cancelled')
          AND (updated_at IS NULL OR updated_at < ?1)
          AND NOT EXISTS (SELECT 1 FROM harel_executions WHERE id = o.parent_id)
        UNION
        SELECT tree.root, e.id FROM harel_executions AS e JOIN tree ON e.parent_id = tree.id),
    trees (members, unripe) AS (
        SELECT COUNT(*),
               SUM(COALESCE(e.status IN ('finished', 'failed', 'cancelled')
                            AND (e.updated_at IS NULL OR e.updated_at < ?1), 0) = 0)
        FROM tree CROSS JOIN harel_executions AS e ON e.id = tree.id GROUP BY tree.root)
SELECT (SELECT COALESCE(SUM(members), 0) FROM trees WHERE unripe = 0),
       (SELECT COUNT(*) FROM harel_executions AS e JOIN harel_processed_events AS p
        ON p.execution_id = e.id WHERE e.markers_since < ?2 AND p.recorded_at < ?2),
       (SELECT COUNT(*) FROM harel_outbox WHERE dead_at < ?3)
       + (SELECT COUNT(*) FROM harel_spawns WHERE dead_at < ?3)
       + (SELECT COUNT(*) FROM harel_timers WHERE dead_at < ?3);

-- name: ids_in_range
-- row: id text
-- Ids with a prefix, as the primary-key range [?1, ?2): case-sensitive, with no character
-- that means anything but itself. Where the prefix has no successor string, ?2 is an empty
-- BLOB, which sorts after every TEXT value.
SELECT id FROM harel_executions WHERE id >= ?1 AND id < ?2 ORDER BY id;

-- name: publish_definition!
-- The primary key keeps the version stored first.
INSERT OR IGNORE INTO harel_definitions (definition_id, version, digest, source, published_at)
VALUES (?, ?, ?, ?, ?);

-- name: load_definition^
-- row: definition_id text, version int, digest text, source text, published_at real?
SELECT definition_id, version, digest, source, published_at
FROM harel_definitions WHERE definition_id = ? AND version = ?;

-- name: stored_definition=
-- row: definition_id text, version int, digest text, source text, published_at real?
-- load_definition after publish_definition in the same batch: the row it stored, or the
-- one stored first, is due.
SELECT definition_id, version, digest, source, published_at
FROM harel_definitions WHERE definition_id = ? AND version = ?;

-- Operator queries (harel-store CLI)

-- name: schema_tables
-- The store's tables with their CREATE statement (its tail tells a WITHOUT ROWID table; the
-- pragma that says so, table_list, needs SQLite 3.37): SQLite's own and Alembic's
-- bookkeeping are not part of the schema.
SELECT name, sql FROM sqlite_master
WHERE type = 'table' AND name NOT LIKE 'sqlite\_%' ESCAPE '\' AND name <> 'alembic_version'
ORDER BY name;

-- name: schema_columns
SELECT name, type, "notnull", dflt_value, pk, hidden FROM pragma_table_xinfo(?) ORDER BY cid;

-- name: schema_indexes
-- Every index of one table, with its CREATE statement (NULL for automatic ones).
SELECT l.name, l."unique", l.origin, l.partial, m.sql
FROM pragma_index_list(?) AS l
LEFT JOIN sqlite_master AS m ON m.type = 'index' AND m.name = l.name
ORDER BY l.name;

-- name: schema_index_columns
-- The key columns of one index (name is NULL for an expression).
SELECT name, "desc", coll FROM pragma_index_xinfo(?) WHERE key ORDER BY seqno;

-- name: schema_foreign_keys
SELECT id, seq, "table", "from", "to", on_update, on_delete, "match"
FROM pragma_foreign_key_list(?) ORDER BY id, seq;

-- name: schema_others
-- Views and triggers, compared by their CREATE statement.
SELECT type, name, sql FROM sqlite_master WHERE type IN ('view', 'trigger') ORDER BY type, name;

-- name: count_by_status
-- row: status text?, count int
-- A row whose summary is NULL (its JSON was corrupt when 0002 backfilled it) counts as unknown
-- (named so by the caller: grouped on the bare column, the status index is read in order,
-- with no sort of an expression's values: 5x faster at a million rows).
SELECT status, COUNT(*) FROM harel_executions GROUP BY status;

-- name: pending_counts=
-- row: outbox int, spawns int, due int, later int, oldest_outbox real?, held_outbox int, held_spawns int, held_timers int, oldest_spawn real?, soonest real?, now real, dead_outbox int, dead_spawns int, dead_timers int
-- Pending (live) outbox entries and spawns, live timers due at ?1 and later than it, when the
-- oldest pending outbox entry was written (unknown before outbox rows carried created_at),
-- how many outbox entries, spawns and timers a worker holds under a live lease (the
-- database's clock; a failed row waiting for its retry has no holder), when the oldest
-- pending spawn was written (unknown before 0005), the soonest fire_at of any live timer,
-- the database's clock now, and the dead letters of each kind (0006). Each is a count or
-- one seek at an end of a key.
SELECT (SELECT COUNT(*) FROM harel_outbox WHERE seq > 0),
       (SELECT COUNT(*) FROM harel_spawns WHERE seq > 0),
       (SELECT COUNT(*) FROM harel_timers WHERE fire_at <= ?1 AND dead_at IS NULL),
       (SELECT COUNT(*) FROM harel_timers WHERE fire_at > ?1 AND dead_at IS NULL),
       (SELECT created_at FROM harel_outbox WHERE seq > 0 ORDER BY seq LIMIT 1),
       (SELECT COUNT(*) FROM harel_outbox WHERE claimed_by IS NOT NULL
        AND claimed_until > (julianday('now') - 2440587.5) * 86400.0),
       (SELECT COUNT(*) FROM harel_spawns WHERE claimed_by IS NOT NULL
        AND claimed_until > (julianday('now') - 2440587.5) * 86400.0),
       (SELECT COUNT(*) FROM harel_timers WHERE claimed_by IS NOT NULL
        AND claimed_until > (julianday('now') - 2440587.5) * 86400.0),
       (SELECT created_at FROM harel_spawns WHERE seq > 0 ORDER BY seq LIMIT 1),
       (SELECT MIN(fire_at) FROM harel_timers WHERE dead_at IS NULL),
       (julianday('now') - 2440587.5) * 86400.0,
       (SELECT COUNT(*) FROM harel_outbox WHERE seq < 0),
       (SELECT COUNT(*) FROM harel_spawns WHERE seq < 0),
       (SELECT COUNT(*) FROM harel_timers WHERE dead_at IS NOT NULL);

-- name: metrics
-- row: name text, label text?, value real?
-- Every gauge of `harel-store metrics`, in one statement, so that they are one consistent
-- read: executions by status; pending (a timer: due at ?1), claimed under a live lease and
-- dead items by kind; timers due later than ?1; when the oldest pending outbox entry and
-- spawn were written and the soonest live timer's fire_at (their ages: against `now`,
-- the database's clock, and ?1, the engine's); and the database's clock.
SELECT 'executions', COALESCE(status, 'unknown'), COUNT(*) FROM harel_executions GROUP BY 2
UNION ALL SELECT 'pending', 'outbox', (SELECT COUNT(*) FROM harel_outbox WHERE seq > 0)
UNION ALL SELECT 'pending', 'spawn', (SELECT COUNT(*) FROM harel_spawns WHERE seq > 0)
UNION ALL SELECT 'pending', 'timer',
    (SELECT COUNT(*) FROM harel_timers WHERE fire_at <= ?1 AND dead_at IS NULL)
UNION ALL SELECT 'scheduled', 'timer',
    (SELECT COUNT(*) FROM harel_timers WHERE fire_at > ?1 AND dead_at IS NULL)
UNION ALL SELECT 'claimed', 'outbox', (SELECT COUNT(*) FROM harel_outbox
    WHERE claimed_by IS NOT NULL AND claimed_until > (julianday('now') - 2440587.5) * 86400.0)
UNION ALL SELECT 'claimed', 'spawn', (SELECT COUNT(*) FROM harel_spawns
    WHERE claimed_by IS NOT NULL AND claimed_until > (julianday('now') - 2440587.5) * 86400.0)
UNION ALL SELECT 'claimed', 'timer', (SELECT COUNT(*) FROM harel_timers
    WHERE claimed_by IS NOT NULL AND claimed_until > (julianday('now') - 2440587.5) * 86400.0)
UNION ALL SELECT 'dead', 'outbox', (SELECT COUNT(*) FROM harel_outbox WHERE seq < 0)
UNION ALL SELECT 'dead', 'spawn', (SELECT COUNT(*) FROM harel_spawns WHERE seq < 0)
UNION ALL SELECT 'dead', 'timer', (SELECT COUNT(*) FROM harel_timers WHERE dead_at IS NOT NULL)
UNION ALL SELECT 'oldest_at', 'outbox',
    (SELECT created_at FROM harel_outbox WHERE seq > 0 ORDER BY seq LIMIT 1)
UNION ALL SELECT 'oldest_at', 'spawn',
    (SELECT created_at FROM harel_spawns WHERE seq > 0 ORDER BY seq LIMIT 1)
UNION ALL SELECT 'soonest_at', 'timer',
    (SELECT MIN(fire_at) FROM harel_timers WHERE dead_at IS NULL)
UNION ALL SELECT 'now', NULL, (julianday('now') - 2440587.5) * 86400.0;

-- One dead letter by its key, in the shape of dead_letters (operator commands: revive and
-- discard by key): an outbox entry's or a spawn's seq ?1 (stored negated), a timer's
-- execution_id ?1 and path ?2.

-- name: dead_outbox_entry^
-- row: kind text, dead_at real?, attempts int, last_error text?, seq int?, a text?, b text, c any, d text?
SELECT 'outbox', dead_at, attempts, last_error, -seq, target_id, event, NULL, NULL
FROM harel_outbox WHERE seq = -?1;

-- name: dead_spawn^
-- row: kind text, dead_at real?, attempts int, last_error text?, seq int?, a text?, b text, c any, d text?
SELECT 'spawn', dead_at, attempts, last_error, -seq, parent_id, child_id, root_path, context
FROM harel_spawns WHERE seq = -?1;

-- name: dead_timer^
-- row: kind text, dead_at real?, attempts int, last_error text?, seq int?, a text?, b text, c any, d text?
SELECT 'timer', dead_at, attempts, last_error, NULL, execution_id, path, fire_at, NULL
FROM harel_timers WHERE execution_id = ?1 AND path = ?2 AND dead_at IS NOT NULL;

-- One dead letter removed by its key, whatever it holds (an event or a context that no
-- longer decodes included); a live row with that key is left alone: discard by key.

-- name: revive_dead_outbox_entry!
-- The dead letter of seq ?1 live again (as revive_outbox), only while it is dead: an entry
-- revived meanwhile, and maybe claimed since, is left alone (the console's Revive).
UPDATE harel_outbox
SET seq = -seq, attempts = 0, claimed_by = NULL, claimed_until = NULL, dead_at = NULL,
    flowed = EXISTS (SELECT 1 FROM harel_flows WHERE key = harel_outbox.flow_key)
WHERE seq = -?1;

-- name: revive_dead_spawn!
UPDATE harel_spawns
SET seq = -seq, attempts = 0, claimed_by = NULL, claimed_until = NULL, dead_at = NULL,
    flowed = EXISTS (SELECT 1 FROM harel_flows WHERE key = harel_spawns.flow_key)
WHERE seq = -?1;

-- name: revive_dead_timer!
UPDATE harel_timers SET attempts = 0, claimed_by = NULL, claimed_until = NULL, dead_at = NULL,
    flowed = EXISTS (SELECT 1 FROM harel_flows WHERE key = harel_timers.flow_key)
WHERE execution_id = ?1 AND path = ?2 AND dead_at IS NOT NULL;

-- name: discard_dead_outbox_entry!
DELETE FROM harel_outbox WHERE seq = -?1;

-- name: discard_dead_spawn!
DELETE FROM harel_spawns WHERE seq = -?1;

-- name: discard_dead_timer!
DELETE FROM harel_timers WHERE execution_id = ?1 AND path = ?2 AND dead_at IS NOT NULL;

-- Up to ?1 dead letters of one kind, whatever they hold: each the rows pending_counts counts
-- as dead (an outbox entry's or a spawn's seq below 0, from -1 down: the primary key; a
-- timer's dead_at set: its dead index). discard --all, a page at a time.

-- name: discard_dead_outbox!
DELETE FROM harel_outbox
WHERE seq IN (SELECT seq FROM harel_outbox WHERE seq < 0 ORDER BY seq DESC LIMIT ?1);

-- name: discard_dead_spawns!
DELETE FROM harel_spawns
WHERE seq IN (SELECT seq FROM harel_spawns WHERE seq < 0 ORDER BY seq DESC LIMIT ?1);

-- name: discard_dead_timers!
DELETE FROM harel_timers WHERE (execution_id, path) IN (
    SELECT execution_id, path FROM harel_timers WHERE dead_at IS NOT NULL LIMIT ?1);

-- name: timers_of
-- row: path text, fire_at real
-- The execution's live timers (its dead ones are dead letters).
SELECT path, fire_at FROM harel_timers WHERE execution_id = ? AND dead_at IS NULL
ORDER BY fire_at, path LIMIT ?;

-- name: outbox_for
-- row: seq int, target_id text?, event text
SELECT seq, target_id, event FROM harel_outbox WHERE target_id = ? AND seq > 0 ORDER BY seq;

-- The operator views of the queues: pending (live) rows with their times, claims, attempts
-- and last errors, oldest (soonest) first, up to a limit. A filter on the column an index
-- starts with seeks it (the index holds the rowid, so its entries for one key are in seq
-- order); the source filter is checked on each row read, as the outbox holds only
-- undelivered entries.

-- name: outbox_view
-- row: seq int, target_id text?, source_id text?, created_at any?, claimed_by text?, claimed_until real?, attempts int, last_error text?, event text
-- ?1: a source_id (NULL: any), ?2 rows.
SELECT seq, target_id, source_id, created_at, claimed_by, claimed_until, attempts, last_error,
       event
FROM harel_outbox WHERE seq > 0 AND (?1 IS NULL OR source_id = ?1) ORDER BY seq LIMIT ?2;

-- name: outbox_view_target
-- row: seq int, target_id text?, source_id text?, created_at any?, claimed_by text?, claimed_until real?, attempts int, last_error text?, event text
-- ?1: the target_id, ?2: a source_id (NULL: any), ?3 rows.
SELECT seq, target_id, source_id, created_at, claimed_by, claimed_until, attempts, last_error,
       event
FROM harel_outbox WHERE target_id = ?1 AND seq > 0 AND (?2 IS NULL OR source_id = ?2)
ORDER BY seq LIMIT ?3;

-- name: spawns_view
-- row: seq int, parent_id text, child_id text, root_path text, created_at any?, claimed_by text?, claimed_until real?, attempts int, last_error text?, context text
SELECT seq, parent_id, child_id, root_path, created_at, claimed_by, claimed_until, attempts,
       last_error, context
FROM harel_spawns WHERE seq > 0 ORDER BY seq LIMIT ?;

-- name: spawns_view_parent
-- row: seq int, parent_id text, child_id text, root_path text, created_at any?, claimed_by text?, claimed_until real?, attempts int, last_error text?, context text
SELECT seq, parent_id, child_id, root_path, created_at, claimed_by, claimed_until, attempts,
       last_error, context
FROM harel_spawns WHERE parent_id = ? AND seq > 0 ORDER BY seq LIMIT ?;

-- name: timers_view
-- Live timers with fire_at < ?1, soonest first (ties as due_timers), ?2 rows.
-- row: execution_id text, path text, fire_at real, claimed_by text?, claimed_until real?, attempts int, last_error text?
SELECT execution_id, path, fire_at, claimed_by, claimed_until, attempts, last_error
FROM harel_timers WHERE fire_at < ?1 AND dead_at IS NULL
ORDER BY fire_at, execution_id, path LIMIT ?2;

-- name: children_of
-- row: id text, definition_id text, version int, status text, outcome text?, active_path text?, parent_id text?, finished_at real?, created_at real?, updated_at real?
-- The children whose id sorts after ?2 ('' for the first page), in id order (the parent index).
-- Operator queries read a NULL summary (see count_by_status) as status 'unknown'.
SELECT id, definition_id, version, COALESCE(status, 'unknown'), outcome, active_path,
       parent_id, finished_at, created_at, updated_at
FROM harel_executions WHERE parent_id = ? AND id > ? ORDER BY id LIMIT ?;

-- name: execution_tree
-- row: id text, definition_id text, version int, status text, outcome text?, active_path text?, parent_id text?, finished_at real?, created_at real?, updated_at real?
-- An execution (first) and all its descendants; UNION stops at a cycle.
WITH RECURSIVE tree (id) AS (
    SELECT id FROM harel_executions WHERE id = ?1
    UNION
    SELECT e.id FROM harel_executions AS e
    JOIN tree ON e.parent_id = tree.id
)
SELECT e.id, e.definition_id, e.version, COALESCE(e.status, 'unknown'), e.outcome,
       e.active_path, e.parent_id, e.finished_at, e.created_at, e.updated_at
FROM tree JOIN harel_executions AS e ON e.id = tree.id
ORDER BY e.id <> ?1, e.id;
