-- 0012: a marker keeps its execution's markers_since in the statement that records it.
--
-- markers_since is the recording time of the execution's oldest marker (0007). A commit
-- kept it with a statement of its own after the marker's insert (note_marker): one server
-- step a commit, on a remote primary one of the few a typical commit takes. A trigger on
-- the insert does it within the insert's statement. A marker recorded again is ignored
-- (INSERT OR IGNORE keeps its first time) and fires nothing: its time is no older than
-- markers_since already. Most inserts find markers_since set and older, and write nothing.
CREATE TRIGGER harel_processed_events_since AFTER INSERT ON harel_processed_events
BEGIN
    UPDATE harel_executions SET markers_since = NEW.recorded_at
    WHERE id = NEW.execution_id
      AND (markers_since IS NULL OR markers_since > NEW.recorded_at);
END;

-- Set from the markers once more, where it is missing or later than the oldest (each
-- execution's oldest marker found once): markers recorded at 0011 with no note_marker after
-- them (a process opened at 0012 and still writing after a downgrade) would never be
-- forgotten.
UPDATE harel_executions
SET markers_since = oldest.since
FROM (SELECT execution_id, MIN(recorded_at) AS since
      FROM harel_processed_events GROUP BY execution_id) AS oldest
WHERE harel_executions.id = oldest.execution_id
  AND (harel_executions.markers_since IS NULL OR harel_executions.markers_since > oldest.since);
