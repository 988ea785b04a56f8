-- Steering (issue 45): instructions queued for a turn that is running (or
-- queued, or waiting), taken by the guest at its next host-call boundary.
-- The API only inserts; the run's claim holder, which owns the run's
-- journal, journals `steer_received` (announced_at) and `steer_taken`
-- (taken_at) and marks the rows with a statement fenced by its claim token.
-- A take records the call-log position it was made at: a resumed attempt
-- that reaches the same position without its reading in the log takes the
-- same rows again (and any queued since), never other ones, and never twice.
CREATE TABLE run_steer (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id         uuid NOT NULL REFERENCES agent_run (id),
    content        text NOT NULL CHECK (length(content) BETWEEN 1 AND 65536),
    -- Who queued it: the run's owner, or `busy` (a message sent to the busy
    -- conversation with the multitask strategy `steer`).
    source         text NOT NULL DEFAULT 'api' CHECK (source IN ('api', 'busy')),
    created_at     timestamptz NOT NULL DEFAULT now(),
    announced_at   timestamptz,
    taken_at       timestamptz,
    -- The call-log position of the take (null: a run that records nothing).
    taken_position integer
);
CREATE INDEX run_steer_run ON run_steer (run_id, id);

-- A take is a reading of the run's call log.
ALTER TABLE run_call DROP CONSTRAINT run_call_import_check;
ALTER TABLE run_call ADD CONSTRAINT run_call_import_check
    CHECK (import IN ('call-tool', 'check-cancel', 'wall-clock', 'monotonic-clock', 'list-tools', 'take-instructions'));
