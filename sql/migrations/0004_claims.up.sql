-- 0004: claimable relays. A worker claims outbox entries, spawns and due timers for a lease
-- (claimed_until: epoch seconds on the database's clock); until it runs out no other worker
-- is handed them. NULL: never claimed. The claim queries walk the primary key (outbox,
-- spawns) or the fire_at index (timers) from the oldest row and skip the few rows under a
-- live lease, so no new index is needed: a claim reads about `limit` rows however long the
-- backlog.

ALTER TABLE harel_outbox ADD COLUMN claimed_by TEXT;
ALTER TABLE harel_outbox ADD COLUMN claimed_until REAL;
ALTER TABLE harel_spawns ADD COLUMN claimed_by TEXT;
ALTER TABLE harel_spawns ADD COLUMN claimed_until REAL;
ALTER TABLE harel_timers ADD COLUMN claimed_by TEXT;
ALTER TABLE harel_timers ADD COLUMN claimed_until REAL;
