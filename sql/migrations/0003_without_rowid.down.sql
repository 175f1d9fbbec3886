-- 0003 downgrade: the three tables back as rowid tables, rebuilt the same way.

CREATE TABLE harel_trace_0002 (
    execution_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    entry TEXT NOT NULL,
    PRIMARY KEY (execution_id, idx)
);
INSERT INTO harel_trace_0002 (execution_id, idx, entry)
SELECT execution_id, idx, entry FROM harel_trace;
DROP TABLE harel_trace;
ALTER TABLE harel_trace_0002 RENAME TO harel_trace;

CREATE TABLE harel_timers_0002 (
    execution_id TEXT NOT NULL,
    path TEXT NOT NULL,
    fire_at REAL NOT NULL,
    PRIMARY KEY (execution_id, path)
);
INSERT INTO harel_timers_0002 (execution_id, path, fire_at)
SELECT execution_id, path, fire_at FROM harel_timers;
DROP TABLE harel_timers;
ALTER TABLE harel_timers_0002 RENAME TO harel_timers;
CREATE INDEX harel_timers_fire_at ON harel_timers (fire_at);

CREATE TABLE harel_processed_events_0002 (
    execution_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    PRIMARY KEY (execution_id, event_id)
);
INSERT INTO harel_processed_events_0002 (execution_id, event_id)
SELECT execution_id, event_id FROM harel_processed_events;
DROP TABLE harel_processed_events;
ALTER TABLE harel_processed_events_0002 RENAME TO harel_processed_events;
