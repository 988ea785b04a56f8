-- Limits on model calls shared by every process on the database (issue 46):
-- leases in a table. A call takes one row per limit that applies to it
-- (`limit_key`: a provider, or provider/model, with `@tenant` when the limit
-- is per tenant): a waiting row at arrival, granted in arrival order by any
-- process that polls the limit, ended when the call returns. Requests and
-- tokens per minute are the granted rows of the last minute; concurrency is
-- the granted rows not ended whose lease has not lapsed (a process that died
-- mid-call frees its slots when `expires_at` passes). Rows are deleted once
-- they have left the minute, so a limit holds at most its requests per minute
-- of them, and each grant is one transaction under the limit's advisory lock.
CREATE TABLE model_lease (
    id          uuid PRIMARY KEY,
    limit_key   text NOT NULL,
    -- Arrival order: the waiting queue is FIFO across processes and tenants.
    arrival     bigint GENERATED ALWAYS AS IDENTITY,
    run_id      uuid,
    tenant_id   text,
    arrived_at  timestamptz NOT NULL DEFAULT now(),
    -- Null while the call waits.
    granted_at  timestamptz,
    ended_at    timestamptz,
    -- Waiting: the waiter's heartbeat (a dead waiter's row is dropped);
    -- granted: the call's bound (a dead caller's slot is freed).
    expires_at  timestamptz NOT NULL,
    -- Estimated when granted, the provider's reported usage once ended.
    tokens      bigint NOT NULL DEFAULT 0 CHECK (tokens >= 0)
);
CREATE INDEX model_lease_limit ON model_lease (limit_key, arrival);

-- A provider's 429 with Retry-After pauses the limit for every process.
CREATE TABLE model_limit_pause (
    limit_key     text PRIMARY KEY,
    paused_until  timestamptz NOT NULL
);

-- Model tokens per tenant (the run owner's) and UTC day, by provider and
-- model, as the providers report them: what daily token budgets are checked
-- against. One upsert per model call.
CREATE TABLE model_usage_day (
    tenant_id          text NOT NULL,
    day                date NOT NULL,
    provider           text NOT NULL,
    model              text NOT NULL,
    calls              bigint NOT NULL DEFAULT 0,
    prompt_tokens      bigint NOT NULL DEFAULT 0,
    completion_tokens  bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, day, provider, model)
);
