-- 0010: the W3C trace context of the commit that wrote an outbox entry, a spawn or a timer
-- (`traceparent`, "00-<trace id>-<span id>-<flags>"), when that commit ran inside a span of
-- an application that records OpenTelemetry traces; NULL otherwise and for every row written
-- before 0010. A relay's handler span links to it, in any process.

ALTER TABLE harel_outbox ADD COLUMN traceparent TEXT;
ALTER TABLE harel_spawns ADD COLUMN traceparent TEXT;
ALTER TABLE harel_timers ADD COLUMN traceparent TEXT;
