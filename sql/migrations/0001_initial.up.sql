-- 0001: the seven tables of the store (spec: "Schema — the six tables" + published definitions).

CREATE TABLE harel_executions (
    id TEXT PRIMARY KEY,
    definition_id TEXT NOT NULL,
    data TEXT NOT NULL,
    version INTEGER NOT NULL
);

CREATE TABLE harel_outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    target_id TEXT,
    event TEXT NOT NULL
);

CREATE TABLE harel_processed_events (
    execution_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    PRIMARY KEY (execution_id, event_id)
);

CREATE TABLE harel_timers (
    execution_id TEXT NOT NULL,
    path TEXT NOT NULL,
    fire_at REAL NOT NULL,
    PRIMARY KEY (execution_id, path)
);

CREATE TABLE harel_spawns (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    parent_id TEXT NOT NULL,
    child_id TEXT NOT NULL,
    root_path TEXT NOT NULL,
    context TEXT NOT NULL
);

CREATE TABLE harel_trace (
    execution_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    entry TEXT NOT NULL,
    PRIMARY KEY (execution_id, idx)
);

CREATE TABLE harel_definitions (
    definition_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    digest TEXT NOT NULL,
    source TEXT NOT NULL,
    published_at REAL,
    PRIMARY KEY (definition_id, version)
);
