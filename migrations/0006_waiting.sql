-- A person in the loop: a resumable run whose agent calls a tool that needs
-- approval (or the durable `wait` tool) is suspended: status `waiting`, no
-- lease, no worker, no sandbox. A decision (or the clock) puts it back in the
-- queue, and it is resumed by replay like a run that lost its worker.

ALTER TABLE agent_run DROP CONSTRAINT agent_run_status_check;
ALTER TABLE agent_run ADD CONSTRAINT agent_run_status_check
    CHECK (status IN ('queued', 'running', 'waiting', 'completed', 'failed', 'cancelled'));

-- How often the run was suspended: a resume after a decision is an attempt
-- too, but only lost workers count against the attempts bound.
ALTER TABLE agent_run ADD COLUMN waits integer NOT NULL DEFAULT 0 CHECK (waits >= 0);

-- A waiting turn is its conversation's active turn: the next one waits.
DROP INDEX one_running_per_conversation;
CREATE UNIQUE INDEX one_running_per_conversation
    ON agent_run (conversation_id) WHERE status IN ('running', 'waiting');

-- Serves /metrics' count of waiting runs.
CREATE INDEX agent_run_waiting ON agent_run (id) WHERE status = 'waiting';

-- What a suspended run waits for: a person's decision on a tool call, or a
-- time. One row per suspended call, decided once.
CREATE TABLE run_suspension (
    run_id        uuid NOT NULL REFERENCES agent_run (id),
    -- The tool call's ordinal in the run (`call_id` in the API and events).
    call_index    integer NOT NULL CHECK (call_index >= 1),
    -- Its position in the call log (`run_call`).
    position      integer NOT NULL,
    kind          text NOT NULL CHECK (kind IN ('approval', 'wait')),
    tool          text NOT NULL,
    args          jsonb NOT NULL,
    requested_at  timestamptz NOT NULL DEFAULT now(),
    -- An approval's deadline (then it is rejected), or the wait's end.
    expires_at    timestamptz NOT NULL,
    decision      text CHECK (decision IN ('approve', 'reject', 'edit', 'elapsed')),
    decided_args  jsonb,
    reason        text,
    decided_at    timestamptz,
    decided_by    text,
    -- When a resumed attempt began the approved call: a later resume finds it
    -- set and treats the call's outcome as unknown (at most once holds).
    call_started_at timestamptz,
    PRIMARY KEY (run_id, call_index),
    CHECK ((decision IS NULL) = (decided_at IS NULL))
);
-- The scheduler's read: undecided suspensions by deadline.
CREATE INDEX run_suspension_due ON run_suspension (expires_at) WHERE decision IS NULL;

CREATE OR REPLACE FUNCTION agent_run_transition_check() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    resumable boolean := (OLD.plugin_manifest ->> 'durability') IS NOT DISTINCT FROM 'resume';
BEGIN
    IF NOT ((OLD.status = 'queued' AND NEW.status IN ('running', 'cancelled'))
         OR (OLD.status = 'running' AND NEW.status IN ('completed', 'failed', 'cancelled'))
         -- the hand-back of a resumable run: attempt raised, lease cleared
         OR (OLD.status = 'running' AND NEW.status = 'queued' AND resumable
             AND NEW.attempt = OLD.attempt + 1 AND NEW.claim_expires_at IS NULL)
         -- a resumable run suspended: no lease
         OR (OLD.status = 'running' AND NEW.status = 'waiting' AND resumable
             AND NEW.waits = OLD.waits + 1 AND NEW.claim_expires_at IS NULL)
         -- decided (or its time came): back to the queue as a new attempt
         OR (OLD.status = 'waiting' AND NEW.status = 'queued' AND NEW.attempt = OLD.attempt + 1)
         -- stopped while waiting
         OR (OLD.status = 'waiting' AND NEW.status = 'cancelled')) THEN
        RAISE EXCEPTION 'agent_run %: illegal status transition % -> %', OLD.id, OLD.status, NEW.status
            USING ERRCODE = 'check_violation', CONSTRAINT = 'agent_run_status_transition';
    END IF;
    RETURN NEW;
END
$$;
