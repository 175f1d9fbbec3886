-- 0011: flow control. Every outbox entry, spawn and timer carries its flow key (by default
-- the root key of the execution it concerns: an entry's target, "" for none; a spawn's
-- child; a timer's execution), and the flows table holds the settings of the keys that have
-- some: priority, a concurrency limit, a rate, paused. Claims honour them in their one
-- statement (sql/queries.sql, "Flow control").
--
-- flow_rank places an outbox entry or a spawn in the round-robin across keys: a key's items
-- take ranks 1, 2, 3, ... from the rank its first one got, which is where the claims stand
-- (harel_flow_clock: the highest rank claimed so far). Claims take items by rank, then seq:
-- one of each key with items before the second of any. Timers are ranked when claimed.
-- flowed is 1 while the item's key has a row in harel_flows (set_flow writes it on the
-- key's items): the claims' walk of the keys without settings never meets the others.
-- What claims write beside (the clock, the rate's log) is written by statements of the
-- claim's batch, not by triggers: a trigger is compiled into every statement that writes
-- its column, and libsql compiles every statement at each call.

ALTER TABLE harel_outbox ADD COLUMN flow_key TEXT NOT NULL DEFAULT '';
ALTER TABLE harel_outbox ADD COLUMN flow_rank INTEGER NOT NULL DEFAULT 0;
ALTER TABLE harel_outbox ADD COLUMN flowed INTEGER NOT NULL DEFAULT 0;
ALTER TABLE harel_spawns ADD COLUMN flow_key TEXT NOT NULL DEFAULT '';
ALTER TABLE harel_spawns ADD COLUMN flow_rank INTEGER NOT NULL DEFAULT 0;
ALTER TABLE harel_spawns ADD COLUMN flowed INTEGER NOT NULL DEFAULT 0;
ALTER TABLE harel_timers ADD COLUMN flow_key TEXT NOT NULL DEFAULT '';
ALTER TABLE harel_timers ADD COLUMN flowed INTEGER NOT NULL DEFAULT 0;
-- The claim that took an item last, when it honoured flows (a number of its own): its rate's
-- log finds what it took by it (log_flow_claims_*).
ALTER TABLE harel_outbox ADD COLUMN claim_token INTEGER;
ALTER TABLE harel_spawns ADD COLUMN claim_token INTEGER;
ALTER TABLE harel_timers ADD COLUMN claim_token INTEGER;

-- Items stored before 0011: their root key, and ranks 1, 2, 3, ... in each key by seq.
UPDATE harel_outbox
SET flow_key = substr(coalesce(target_id, ''), 1, instr(coalesce(target_id, '') || '.', '.') - 1);
UPDATE harel_outbox SET flow_rank = ranked.n
FROM (SELECT seq, row_number() OVER (PARTITION BY flow_key ORDER BY abs(seq)) AS n
      FROM harel_outbox) AS ranked
WHERE harel_outbox.seq = ranked.seq;
UPDATE harel_spawns SET flow_key = substr(child_id, 1, instr(child_id || '.', '.') - 1);
UPDATE harel_spawns SET flow_rank = ranked.n
FROM (SELECT seq, row_number() OVER (PARTITION BY flow_key ORDER BY abs(seq)) AS n
      FROM harel_spawns) AS ranked
WHERE harel_spawns.seq = ranked.seq;
UPDATE harel_timers SET flow_key = substr(execution_id, 1, instr(execution_id || '.', '.') - 1);

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
