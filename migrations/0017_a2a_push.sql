-- A2A push notifications: a task (a run) may carry configs, each a URL the
-- client chose (under the operator's webhook allow-list) with the token and
-- credentials sent back with each notification. A notification is a row of
-- the completion-webhook outbox (`webhook_delivery`), written by a trigger
-- in the very transaction of the task's state change, so it is signed,
-- retried and never lost to a crash exactly as a completion webhook is.
CREATE TABLE a2a_push_config (
    run_id      uuid NOT NULL REFERENCES agent_run (id),
    id          text NOT NULL CHECK (length(id) BETWEEN 1 AND 200),
    url         text NOT NULL,
    token       text,
    auth_scheme text,
    -- The headers each notification carries (`X-A2A-Notification-Token`,
    -- `Authorization`): written once here, copied into each delivery.
    headers     jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(headers) = 'object'),
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, id)
);

-- Whether a run has configs: the trigger below fires only for those, so a
-- run without any (nearly all) pays nothing at its state changes.
ALTER TABLE agent_run ADD COLUMN a2a_push boolean NOT NULL DEFAULT false;

-- A run's completion webhook is still one delivery; its push notifications
-- are one per config and state change.
ALTER TABLE webhook_delivery ADD COLUMN push_config text;
ALTER TABLE webhook_delivery ADD COLUMN headers jsonb;
ALTER TABLE webhook_delivery DROP CONSTRAINT webhook_delivery_run_id_key;
CREATE UNIQUE INDEX webhook_delivery_completion ON webhook_delivery (run_id) WHERE push_config IS NULL;
CREATE INDEX webhook_delivery_run ON webhook_delivery (run_id);

CREATE OR REPLACE FUNCTION agent_run_webhook_outbox() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO webhook_delivery (id, run_id, url, payload)
    VALUES (gen_random_uuid(), NEW.id, NEW.webhook,
            jsonb_strip_nulls(jsonb_build_object('run_id', NEW.id, 'conversation_id', NEW.conversation_id,
                                                 'status', NEW.status, 'error', NEW.error,
                                                 'finished_at', NEW.finished_at)))
    ON CONFLICT (run_id) WHERE push_config IS NULL DO NOTHING;
    RETURN NULL;
END
$$;

-- A run's status as an A2A task state (`stream::a2a::state_of`).
CREATE FUNCTION a2a_task_state(status text, awaiting_approval boolean) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE status
        WHEN 'queued' THEN 'TASK_STATE_SUBMITTED'
        WHEN 'running' THEN 'TASK_STATE_WORKING'
        WHEN 'waiting' THEN CASE WHEN awaiting_approval THEN 'TASK_STATE_INPUT_REQUIRED' ELSE 'TASK_STATE_WORKING' END
        WHEN 'completed' THEN 'TASK_STATE_COMPLETED'
        WHEN 'failed' THEN 'TASK_STATE_FAILED'
        WHEN 'cancelled' THEN 'TASK_STATE_CANCELED'
    END
$$;

-- One notification of `state` to each of the run's configs (`only`: just
-- that one): the A2A `StreamResponse` of a status update.
CREATE FUNCTION a2a_push(run uuid, conversation uuid, state text, error text, only_config text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO webhook_delivery (id, run_id, url, payload, headers, push_config)
    SELECT gen_random_uuid(), run, c.url,
           jsonb_build_object('statusUpdate', jsonb_build_object(
               'taskId', run, 'contextId', conversation,
               'status', jsonb_strip_nulls(jsonb_build_object(
                   'state', state,
                   'timestamp', to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'),
                   'message', CASE WHEN error IS NOT NULL THEN jsonb_build_object(
                       'messageId', gen_random_uuid(), 'contextId', conversation, 'taskId', run,
                       'role', 'ROLE_AGENT', 'parts', jsonb_build_array(jsonb_build_object('text', error))) END)))),
           c.headers, c.id
    FROM a2a_push_config c
    WHERE c.run_id = run AND (only_config IS NULL OR c.id = only_config)
$$;

-- A state change of a run with configs: running and waiting are both
-- WORKING (an approval's INPUT_REQUIRED is told when its suspension is
-- written, below), so a durable wait sends nothing.
CREATE FUNCTION agent_run_a2a_push() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM a2a_push(NEW.id, NEW.conversation_id, a2a_task_state(NEW.status, false),
                     CASE WHEN NEW.status = 'failed' THEN NEW.error END, NULL);
    RETURN NULL;
END
$$;

CREATE TRIGGER agent_run_a2a_push
    AFTER UPDATE OF status ON agent_run
    FOR EACH ROW
    WHEN (NEW.a2a_push AND OLD.status IS DISTINCT FROM NEW.status
          AND NOT (OLD.status IN ('running', 'waiting') AND NEW.status IN ('running', 'waiting')))
    EXECUTE FUNCTION agent_run_a2a_push();

CREATE FUNCTION run_suspension_a2a_push() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM a2a_push(r.id, r.conversation_id, 'TASK_STATE_INPUT_REQUIRED', NULL, NULL)
    FROM agent_run r WHERE r.id = NEW.run_id;
    RETURN NULL;
END
$$;

CREATE TRIGGER run_suspension_a2a_push
    AFTER INSERT ON run_suspension
    FOR EACH ROW
    WHEN (NEW.kind = 'approval')
    EXECUTE FUNCTION run_suspension_a2a_push();

-- Forks (`POST /v1/runs/{id}/fork`): a run made from another's recorded
-- calls, in a new conversation. Its first claim loads the call log copied
-- from the original (up to the fork's point) and replays it, then runs live.
ALTER TABLE agent_run ADD COLUMN forked_from uuid;
ALTER TABLE agent_run ADD COLUMN fork_after integer;
