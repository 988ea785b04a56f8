-- Traces (issue 46 item 5): a run's OpenTelemetry trace context, stored with
-- the run so that every process that claims it (after a crash, an approval
-- wait, a drain) continues the same trace. `trace_id` is the W3C trace id (16
-- bytes, here a uuid's), `trace_span_id` the id of the run's own root span (8
-- bytes as a bigint); both are made when the run is inserted, whichever path
-- inserts it (enqueue, eager start, retry, fork, schedule).
--
-- Added without a default first, then given one: adding a column with a
-- volatile default would rewrite the whole table. Rows from before this
-- migration keep nulls; the host derives their trace from the run id.
ALTER TABLE agent_run ADD COLUMN trace_id uuid;
ALTER TABLE agent_run ADD COLUMN trace_span_id bigint;
ALTER TABLE agent_run ALTER COLUMN trace_id SET DEFAULT gen_random_uuid();
ALTER TABLE agent_run
    ALTER COLUMN trace_span_id SET DEFAULT ('x' || substr(md5(gen_random_uuid()::text), 1, 16))::bit(64)::bigint;
