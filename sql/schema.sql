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
    traceparent TEXT,
    -- Flow control (0011): the item's flow key (the root key of the execution it concerns,
    -- or what the store's flow_key function says), its place in the round-robin across
    -- keys, and whether its key has settings in harel_flows (set_flow writes it).
    flow_key TEXT NOT NULL DEFAULT '',
    flow_rank INTEGER NOT NULL DEFAULT 0,
    flowed INTEGER NOT NULL DEFAULT 0,
    claim_token INTEGER -- the flow-honouring claim that took it last (log_flow_claims_*)
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
-- A marker's insert keeps its execution's markers_since (0012): within the insert's statement.
CREATE TRIGGER harel_processed_events_since AFTER INSERT ON harel_processed_events
BEGIN
    UPDATE harel_executions SET markers_since = NEW.recorded_at
    WHERE id = NEW.execution_id
      AND (markers_since IS NULL OR markers_since > NEW.recorded_at);
END;

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
    flow_key TEXT NOT NULL DEFAULT '', -- timers are ranked when claimed: no flow_rank
    flowed INTEGER NOT NULL DEFAULT 0,
    claim_token INTEGER,
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
    traceparent TEXT,
    flow_key TEXT NOT NULL DEFAULT '',
    flow_rank INTEGER NOT NULL DEFAULT 0,
    flowed INTEGER NOT NULL DEFAULT 0,
    claim_token INTEGER -- the flow-honouring claim that took it last (log_flow_claims_*)
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

-- Flow control (0011): see sql/migrations/0011_flows.up.sql.
-- The claims' walk of the keys without settings, by rank (a live item's; flowed ones apart).
CREATE INDEX harel_outbox_rank ON harel_outbox (flow_rank, seq) WHERE seq > 0 AND flowed = 0;
CREATE INDEX harel_spawns_rank ON harel_spawns (flow_rank, seq) WHERE seq > 0 AND flowed = 0;
-- A key's live items by rank: its next rank, its walk in a claim, what it has pending.
CREATE INDEX harel_outbox_flow ON harel_outbox (flow_key, flow_rank, seq) WHERE seq > 0;
CREATE INDEX harel_spawns_flow ON harel_spawns (flow_key, flow_rank, seq) WHERE seq > 0;
CREATE INDEX harel_timers_flow ON harel_timers (flow_key, fire_at) WHERE dead_at IS NULL;
-- What the keys with settings hold: a concurrency limit counts it. Only their claims write it.
CREATE INDEX harel_outbox_flow_held ON harel_outbox (flow_key, claimed_until)
WHERE claimed_by IS NOT NULL AND flowed = 1;
CREATE INDEX harel_spawns_flow_held ON harel_spawns (flow_key, claimed_until)
WHERE claimed_by IS NOT NULL AND flowed = 1;
CREATE INDEX harel_timers_flow_held ON harel_timers (flow_key, claimed_until)
WHERE claimed_by IS NOT NULL AND flowed = 1;
-- What each worker holds: workers() and release_worker (a relay's start), and the highest
-- rank a worker holds (the clock's advance after its claim: one seek).
CREATE INDEX harel_outbox_worker ON harel_outbox (claimed_by, flowed, flow_rank)
WHERE claimed_by IS NOT NULL;
CREATE INDEX harel_spawns_worker ON harel_spawns (claimed_by, flowed, flow_rank)
WHERE claimed_by IS NOT NULL;
CREATE INDEX harel_timers_worker ON harel_timers (claimed_by, claimed_until)
WHERE claimed_by IS NOT NULL;

-- The settings of the keys that have some (set_flow). No row: priority 0, no limit, no
-- rate, not paused. rate_count claims at most per rate_seconds, both NULL or neither.
-- freed_at: when an item of a key with a concurrency limit last stopped being held (acked,
-- failed, released: touch_flows), so that a server's change notifications of this table (a
-- rowid table: sqld sends none of a WITHOUT ROWID one) wake the relays waiting for its
-- room, as they do on a change of settings.
CREATE TABLE harel_flows (
    key TEXT PRIMARY KEY,
    priority INTEGER NOT NULL DEFAULT 0,
    concurrency INTEGER,
    paused INTEGER NOT NULL DEFAULT 0,
    rate_count INTEGER,
    rate_seconds REAL,
    updated_at REAL,
    freed_at REAL
);

-- The claims of the keys with a rate, when they were made (the database's clock), kept for
-- as long as the key's rate window: a rate counts them, acked or not.
CREATE TABLE harel_flow_claims (
    key TEXT NOT NULL,
    claimed_at REAL NOT NULL
);
CREATE INDEX harel_flow_claims_key ON harel_flow_claims (key, claimed_at);

-- What each key with settings may have claimed now (the claims' and peek_work's one rule):
-- room 0 while paused; else the least of what its concurrency limit leaves (its items held
-- under a live lease, every kind, counted) and what its rate leaves (its claims within the
-- window counted, acked or not); NULL: no limit. A key's priority beside it.
CREATE VIEW harel_flow_room (key, priority, room) AS
SELECT key, priority,
       CASE
           WHEN paused THEN 0
           WHEN concurrency IS NULL AND rate_count IS NULL THEN NULL
           ELSE max(0, min(
               CASE WHEN concurrency IS NULL THEN 9223372036854775807 ELSE concurrency
                   - (SELECT count(*) FROM harel_outbox WHERE flow_key = f.key
                      AND claimed_by IS NOT NULL AND flowed = 1
                      AND claimed_until > (julianday('now') - 2440587.5) * 86400.0)
                   - (SELECT count(*) FROM harel_spawns WHERE flow_key = f.key
                      AND claimed_by IS NOT NULL AND flowed = 1
                      AND claimed_until > (julianday('now') - 2440587.5) * 86400.0)
                   - (SELECT count(*) FROM harel_timers WHERE flow_key = f.key
                      AND claimed_by IS NOT NULL AND flowed = 1
                      AND claimed_until > (julianday('now') - 2440587.5) * 86400.0) END,
               CASE WHEN rate_count IS NULL THEN 9223372036854775807 ELSE rate_count
                   - (SELECT count(*) FROM harel_flow_claims WHERE key = f.key
                      AND claimed_at > (julianday('now') - 2440587.5) * 86400.0 - f.rate_seconds) END))
       END
FROM harel_flows AS f;

-- Where the claims stand in the round-robin, per kind: the highest rank claimed so far at
-- priority 0 (a claim's batch moves it: advance_clock_*). A key with no live item starts its
-- next one here (insert_outbox, insert_spawn), and a key's backlog starts here again when it
-- is unpaused or its limit lifted (rerank_*).
CREATE TABLE harel_flow_clock (
    kind TEXT PRIMARY KEY,
    rank INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO harel_flow_clock (kind, rank) VALUES ('outbox', 0), ('spawn', 0);
