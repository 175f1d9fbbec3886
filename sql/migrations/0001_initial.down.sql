-- 0001 downgrade: drop everything 0001 created.

DROP TABLE harel_definitions;
DROP TABLE harel_trace;
DROP TABLE harel_spawns;
DROP TABLE harel_timers;
DROP TABLE harel_processed_events;
DROP TABLE harel_outbox;
DROP TABLE harel_executions;
