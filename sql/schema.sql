-- The whole schema at head. tests/test_migrations.py proves the migration chain builds exactly this.

CREATE TABLE harel_executions (
    id TEXT PRIMARY KEY,
    definition_id TEXT NOT NULL,
    data TEXT NOT NULL,
    version INTEGER NOT NULL,
    -- Summary columns, written with data by every CAS write (data stays the source of truth).
    status TEXT,
    outcome TEXT,
    active_path TEXT,
    parent_id TEXT,
    finished_at REAL,
    -- Epoch seconds on the database's clock (0005): the insert CAS sets both, every later CAS
    -- write updated_at. NULL for rows written before 0005.
    created_at REAL,
    updated_at REAL,
    -- The recording time of the execution's oldest dedupe marker (0007; NULL: it has none).
    -- forget_processed finds the old markers through it (see harel_processed_events).
    markers_since REAL
);

CREATE INDEX harel_executions_status ON harel_executions (status, id);
CREATE INDEX harel_executions_definition ON harel_executions (definition_id, status, id);
CREATE INDEX harel_executions_roots ON harel_executions (status, id)
WHERE parent_id IS NULL;
CREATE INDEX harel_executions_definition_roots ON harel_executions (definition_id, status, id)
WHERE parent_id IS NULL;
CREATE INDEX harel_executions_parent ON harel_executions (parent_id, id)
WHERE parent_id IS NOT NULL;
-- Newest-first listings and time windows, per status (NULL times first in each status).
CREATE INDEX harel_executions_updated ON harel_executions (status, updated_at, id);
-- The executions with dedupe markers, the oldest marker first (0007): written when an
-- execution gets its first marker, not on every commit that records one.
CREATE INDEX harel_executions_markers ON harel_executions (markers_since)
WHERE markers_since IS NOT NULL;
-- The final roots, least recently updated first (0007): purge_finished's walk. A commit of a
-- running execution never writes it. NULL updated_at (rows written before 0005) first.
CREATE INDEX harel_executions_final_roots ON harel_executions (updated_at)
WHERE parent_id IS NULL AND status IN ('finished', 'failed', 'cancelled');
-- The final children, least recently updated first, with their parent (0009): purge_finished
-- finds among them those whose parent row is gone, the roots of their own trees.
CREATE INDEX harel_executions_final_children ON harel_executions (updated_at, parent_id)
WHERE parent_id IS NOT NULL AND status IN ('finished', 'failed', 'cancelled');

CREATE TABLE harel_outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    target_id TEXT,
    event TEXT NOT NULL,
    created_at REAL, -- epoch seconds (SQLite's clock) at insert; NULL before 0002
    -- A relay's claim (0004): the worker and the end of its lease, epoch seconds on the
    -- database's clock; NULL: never claimed. Likewise in harel_spawns and harel_timers.
    claimed_by TEXT,
    claimed_until REAL,
    source_id TEXT, -- the execution whose commit emitted it (0005); NULL before 0005
    -- A relay's attempts (0006): claims counted, the last worker's error (`fail`), and when
    -- a claim made it a dead letter (epoch seconds, the database's clock; NULL: live). A dead
    -- entry's seq is stored negated (seq < 0 exactly when dead_at IS NOT NULL): below every
    -- live entry, out of the claims' walk. Likewise in harel_spawns; a dead timer keeps its key.
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    dead_at REAL,
    -- The W3C traceparent of the commit that wrote it, when that commit ran inside a span
    -- (0010); NULL otherwise. Likewise in harel_spawns and harel_timers.
    traceparent TEXT
);

CREATE INDEX harel_outbox_target ON harel_outbox (target_id);
-- Dead letters in the order they died (a live row has no entry: no commit writes one).
CREATE INDEX harel_outbox_dead ON harel_outbox (dead_at, seq DESC) WHERE dead_at IS NOT NULL;

CREATE TABLE harel_processed_events (
    execution_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    -- When the marker was recorded, epoch seconds on the database's clock (0007; markers
    -- recorded before 0007 have the time the migration ran). No index of its own: the
    -- execution's markers_since leads to the old ones.
    recorded_at REAL,
    PRIMARY KEY (execution_id, event_id)
) WITHOUT ROWID;

CREATE TABLE harel_timers (
    execution_id TEXT NOT NULL,
    path TEXT NOT NULL,
    fire_at REAL NOT NULL,
    claimed_by TEXT,
    claimed_until REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    dead_at REAL,
    traceparent TEXT,
    PRIMARY KEY (execution_id, path)
) WITHOUT ROWID;

-- The sweep and the claims walk live timers only, soonest first.
-- Its key ends with dead_at (NULL in every entry: a live timer's), so the index covers the
-- queries' `dead_at IS NULL` and the sweep and the counts never read the table.
CREATE INDEX harel_timers_fire_at ON harel_timers (fire_at, execution_id, path, dead_at)
WHERE dead_at IS NULL;
CREATE INDEX harel_timers_dead ON harel_timers (dead_at) WHERE dead_at IS NOT NULL;

CREATE TABLE harel_spawns (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    parent_id TEXT NOT NULL,
    child_id TEXT NOT NULL,
    root_path TEXT NOT NULL,
    context TEXT NOT NULL,
    claimed_by TEXT,
    claimed_until REAL,
    created_at REAL, -- epoch seconds (the database's clock) at insert (0005); NULL before
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    dead_at REAL,
    traceparent TEXT
);

CREATE INDEX harel_spawns_parent ON harel_spawns (parent_id);
CREATE INDEX harel_spawns_dead ON harel_spawns (dead_at, seq DESC) WHERE dead_at IS NOT NULL;

CREATE TABLE harel_trace (
    execution_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    entry TEXT NOT NULL,
    recorded_at REAL, -- epoch seconds (the database's clock) when recorded (0008); NULL before
    PRIMARY KEY (execution_id, idx)
) WITHOUT ROWID;

CREATE TABLE harel_definitions (
    definition_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    digest TEXT NOT NULL,
    source TEXT NOT NULL,
    published_at REAL,
    PRIMARY KEY (definition_id, version)
);
