-- Completion webhooks: a run may name a URL (from the operator's allow-list)
-- to be told when it ends. The delivery is an outbox row written by a
-- trigger in the very transaction of the terminal write, whoever writes it
-- (worker, reaper, stop, backstop), so a crash between the ending and the
-- POST never loses it; any process delivers pending rows.
ALTER TABLE agent_run ADD COLUMN webhook text;

CREATE TABLE webhook_delivery (
    -- The `webhook-id` header: the same on every attempt.
    id               uuid PRIMARY KEY,
    run_id           uuid NOT NULL UNIQUE REFERENCES agent_run (id),
    url              text NOT NULL,
    payload          jsonb NOT NULL,
    status           text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts         integer NOT NULL DEFAULT 0,
    -- When the next attempt may start (a sender pushes it forward while it sends).
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    delivered_at     timestamptz
);
CREATE INDEX webhook_delivery_due ON webhook_delivery (next_attempt_at) WHERE status = 'pending';

CREATE FUNCTION agent_run_webhook_outbox() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO webhook_delivery (id, run_id, url, payload)
    VALUES (gen_random_uuid(), NEW.id, NEW.webhook,
            jsonb_strip_nulls(jsonb_build_object('run_id', NEW.id, 'conversation_id', NEW.conversation_id,
                                                 'status', NEW.status, 'error', NEW.error,
                                                 'finished_at', NEW.finished_at)))
    ON CONFLICT (run_id) DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER agent_run_webhook_outbox
    AFTER UPDATE OF status ON agent_run
    FOR EACH ROW
    WHEN (NEW.webhook IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status
          AND NEW.status IN ('completed', 'failed', 'cancelled'))
    EXECUTE FUNCTION agent_run_webhook_outbox();

-- Schedules: runs on a cron expression. Each firing is one run however many
-- processes are up: the firing's time is the run's idempotency key (unique
-- per owner in agent_run), and the schedule row is locked while it fires. A
-- schedule whose firings were missed (every process down) fires once, then
-- goes on from now.
CREATE TABLE schedule (
    id               uuid PRIMARY KEY,
    owner_id         text NOT NULL,
    tenant_id        text NOT NULL,
    plugin           text NOT NULL,
    content          text NOT NULL,
    config           jsonb NOT NULL DEFAULT '{}'::jsonb,
    -- Runs go into this conversation (queued behind its turns); null: a new
    -- conversation per firing.
    conversation_id  uuid REFERENCES conversation (id),
    cron             text NOT NULL,
    timezone         text NOT NULL DEFAULT 'UTC',
    webhook          text,
    paused           boolean NOT NULL DEFAULT false,
    next_fire_at     timestamptz NOT NULL,
    last_fired_at    timestamptz,
    last_run_id      uuid,
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX schedule_due ON schedule (next_fire_at) WHERE NOT paused;
CREATE INDEX schedule_owner ON schedule (owner_id, created_at, id);
