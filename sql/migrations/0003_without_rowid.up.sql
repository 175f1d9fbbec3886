-- 0003: the dedupe markers, the timers and the trace ring as WITHOUT ROWID tables. Each is
-- looked up by its primary key only, so the key's b-tree can hold the row itself: an insert
-- writes one b-tree instead of a rowid table and a primary-key index beside it (a typical
-- commit goes from 15 WAL pages to 8 with the CAS write of the same change). Each table is
-- rebuilt: create, copy, drop, rename, recreate its indexes, in the migration's transaction.

CREATE TABLE harel_processed_events_0003 (
    execution_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    PRIMARY KEY (execution_id, event_id)
) WITHOUT ROWID;
INSERT INTO harel_processed_events_0003 (execution_id, event_id)
SELECT execution_id, event_id FROM harel_processed_events;
DROP TABLE harel_processed_events;
ALTER TABLE harel_processed_events_0003 RENAME TO harel_processed_events;

CREATE TABLE harel_timers_0003 (
    execution_id TEXT NOT NULL,
    path TEXT NOT NULL,
    fire_at REAL NOT NULL,
    PRIMARY KEY (execution_id, path)
) WITHOUT ROWID;
INSERT INTO harel_timers_0003 (execution_id, path, fire_at)
SELECT execution_id, path, fire_at FROM harel_timers;
DROP TABLE harel_timers;
ALTER TABLE harel_timers_0003 RENAME TO harel_timers;
CREATE INDEX harel_timers_fire_at ON harel_timers (fire_at);

CREATE TABLE harel_trace_0003 (
    execution_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    entry TEXT NOT NULL,
    PRIMARY KEY (execution_id, idx)
) WITHOUT ROWID;
INSERT INTO harel_trace_0003 (execution_id, idx, entry)
SELECT execution_id, idx, entry FROM harel_trace;
DROP TABLE harel_trace;
ALTER TABLE harel_trace_0003 RENAME TO harel_trace;
