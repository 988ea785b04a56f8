-- The run core: a run is a row. Every invariant the design names lives here,
-- in the schema, so no code path (or hand-written SQL) can route around it.

-- Bearer tokens, stored as sha256 of the secret; never the secret itself.
CREATE TABLE api_token (
    token_hash  bytea PRIMARY KEY,
    user_id     text NOT NULL CHECK (length(user_id) BETWEEN 1 AND 200),
    tenant_id   text NOT NULL CHECK (length(tenant_id) BETWEEN 1 AND 200),
    admin       boolean NOT NULL DEFAULT false,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE conversation (
    id          uuid PRIMARY KEY,
    owner_id    text NOT NULL,
    tenant_id   text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- The durable transcript. run_event is a delivery buffer; this table remembers.
CREATE TABLE message (
    id              uuid PRIMARY KEY,
    conversation_id uuid NOT NULL REFERENCES conversation (id),
    run_id          uuid,
    role            text NOT NULL CHECK (role IN ('user', 'assistant')),
    content         text NOT NULL,
    status          text NOT NULL CHECK (status IN ('queued', 'complete', 'draft', 'partial')),
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX message_conversation ON message (conversation_id, created_at);

CREATE TABLE agent_run (
    id                uuid PRIMARY KEY,
    -- Arrival order: FIFO within a conversation and across the queue. A
    -- sequence, not created_at, so two runs enqueued in one instant still order.
    queue_pos         bigint GENERATED ALWAYS AS IDENTITY,
    conversation_id   uuid NOT NULL REFERENCES conversation (id),
    owner_id          text NOT NULL,
    tenant_id         text NOT NULL,
    user_message_id   uuid NOT NULL REFERENCES message (id),
    plugin            text NOT NULL,
    plugin_digest     text,
    status            text NOT NULL DEFAULT 'queued'
                      CHECK (status IN ('queued', 'running', 'completed', 'failed', 'cancelled')),
    -- Snapshot of the request as posted; nulled by retention.
    request           jsonb,
    config            jsonb NOT NULL DEFAULT '{}'::jsonb,
    idempotency_key   text,
    cancel_requested  boolean NOT NULL DEFAULT false,
    -- The claim: token (the fence), lease, holder. Compared only with the
    -- database's now(), never with a process clock.
    claim_token       uuid,
    claim_expires_at  timestamptz,
    worker_id         text,
    last_heartbeat_at timestamptz,
    error             text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    started_at        timestamptz,
    finished_at       timestamptz,
    CHECK (status = 'queued' OR status = 'cancelled' OR claim_token IS NOT NULL),
    CHECK ((status IN ('completed', 'failed', 'cancelled')) = (finished_at IS NOT NULL))
);

-- The guarantee behind "one turn at a time": the claim's NOT EXISTS filter is
-- only an optimisation; this index is what two racing claimers cannot pass.
CREATE UNIQUE INDEX one_running_per_conversation
    ON agent_run (conversation_id) WHERE status = 'running';
-- Serves the claim: queued rows in arrival order.
CREATE INDEX agent_run_queued ON agent_run (queue_pos) WHERE status = 'queued';
-- Serves the claim's head-of-conversation check (FIFO within a conversation).
CREATE INDEX agent_run_queued_by_conversation
    ON agent_run (conversation_id, queue_pos) WHERE status = 'queued';
-- Serves the reaper: running rows by lease expiry.
CREATE INDEX agent_run_running_lease
    ON agent_run (claim_expires_at) WHERE status = 'running';
CREATE INDEX agent_run_conversation ON agent_run (conversation_id, queue_pos);
-- Idempotent enqueue: one run per (owner, key).
CREATE UNIQUE INDEX agent_run_idempotency
    ON agent_run (owner_id, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- Legal transitions only; terminal states are sticky. Nothing moves a run out
-- of completed, failed or cancelled, and nothing re-queues a run that started
-- (at-most-once: a run whose worker died ends failed).
CREATE FUNCTION agent_run_transition_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT ((OLD.status = 'queued' AND NEW.status IN ('running', 'cancelled'))
         OR (OLD.status = 'running' AND NEW.status IN ('completed', 'failed', 'cancelled'))) THEN
        RAISE EXCEPTION 'agent_run %: illegal status transition % -> %', OLD.id, OLD.status, NEW.status
            USING ERRCODE = 'check_violation', CONSTRAINT = 'agent_run_status_transition';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER agent_run_status_transition
    BEFORE UPDATE OF status ON agent_run
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION agent_run_transition_check();

-- The journal: every event of a run, in seq order, replayable from a cursor.
CREATE TABLE run_event (
    run_id      uuid NOT NULL REFERENCES agent_run (id),
    seq         integer NOT NULL CHECK (seq >= 1),
    type        text NOT NULL,
    payload     jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, seq)
);
-- Exactly one ending per run, whoever writes it.
CREATE UNIQUE INDEX run_event_one_complete ON run_event (run_id) WHERE type = 'complete';
