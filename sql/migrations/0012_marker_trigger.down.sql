-- 0012 downgrade: the commits of the revision before keep markers_since themselves.

DROP TRIGGER harel_processed_events_since;
