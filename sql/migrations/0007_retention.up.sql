-- 0007: retention (purge_finished, forget_processed, harel-store gc).
--
-- A dedupe marker gets the time it was recorded (epoch seconds on the database's clock), so
-- the markers older than any redelivery can be forgotten. A marker recorded before 0007 gets
-- the time this migration ran: it was recorded no later than that, so it is forgotten no
-- sooner than its true age allows.
--
-- No index on recorded_at: every commit that handles an event would write one (a WAL page
-- more per commit). The ledger's time is found through its executions instead:
-- harel_executions.markers_since is the recording time of the execution's oldest marker
-- (NULL: it has none). A commit writes it only when the execution had none (or the clock
-- went back), so its index is written about once per execution, not once per event;
-- forget_processed walks that index, oldest first, to the executions with old markers.

ALTER TABLE harel_processed_events ADD COLUMN recorded_at REAL;
UPDATE harel_processed_events SET recorded_at = (julianday('now') - 2440587.5) * 86400.0;
ALTER TABLE harel_executions ADD COLUMN markers_since REAL;
UPDATE harel_executions
SET markers_since = (
    SELECT MIN(recorded_at) FROM harel_processed_events WHERE execution_id = harel_executions.id)
WHERE EXISTS (SELECT 1 FROM harel_processed_events WHERE execution_id = harel_executions.id);
CREATE INDEX harel_executions_markers ON harel_executions (markers_since)
WHERE markers_since IS NOT NULL;

-- purge_finished walks the final roots oldest first. A partial index holds them alone: a
-- commit writes it only when a root enters a final status (or a final one is written
-- again), never on the commits of a running execution. Rows last written before 0005 have
-- no updated_at: they sort first, and purge_finished takes them as older than any time.
CREATE INDEX harel_executions_final_roots ON harel_executions (updated_at)
WHERE parent_id IS NULL AND status IN ('finished', 'failed', 'cancelled');
