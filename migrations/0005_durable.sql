-- Durable resume: a run whose plugin declares `"durability": "resume"`
-- survives its worker. Every host call it makes is recorded in run_call;
-- when its worker dies (or a drain runs out of budget) the run goes back to
-- the queue, another process replays the log and goes on live.

-- Which attempt of the run this is (1: the first claim). Raised only by the
-- running -> queued hand-back, so the trigger below can tell it apart.
ALTER TABLE agent_run ADD COLUMN attempt integer NOT NULL DEFAULT 1 CHECK (attempt >= 1);
-- The seed of the guest's WASI random generators, drawn at the first claim:
-- every attempt draws the same numbers.
ALTER TABLE agent_run ADD COLUMN seed uuid;

-- Which host call a journal row followed: the run host numbers every append
-- (a guest's emit, a tool's event or delta) in order, and a merged delta
-- carries the number of its last piece. A resumed run does not journal again
-- what an earlier attempt already did (numbers up to max(op)). Null for rows
-- outside that order (enqueue, claim, resume, the ending).
ALTER TABLE run_event ADD COLUMN op bigint;

-- The recorded call log: every nondeterministic host call of a resumable
-- run, in order, with what identifies it and its result. A call-tool row is
-- written (fenced) before the tool runs, with outcome null, and completed
-- before the guest sees the answer: a row with a null outcome is a call whose
-- result is unknown. Trimmed with the journal once the run is terminal.
CREATE TABLE run_call (
    run_id      uuid NOT NULL REFERENCES agent_run (id),
    position    integer NOT NULL CHECK (position >= 1),
    import      text NOT NULL CHECK (import IN ('call-tool', 'check-cancel', 'wall-clock', 'monotonic-clock')),
    -- The tool's name (call-tool only).
    name        text,
    -- sha256 of the arguments, hex (call-tool only).
    args_hash   text,
    -- The run host's append count when the call was made, and after it ended.
    ops_before  bigint NOT NULL,
    ops_after   bigint,
    -- 'ok' or the refusal's kind; null while the outcome is unknown.
    outcome     text,
    -- The answer (a tool's JSON text, a refusal's message, a clock reading).
    result      text,
    attempt     integer NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, position)
);

-- One more legal transition: running -> queued, only as the hand-back of a
-- resumable run (attempt raised by one, the claim cleared). Terminal states
-- stay sticky.
CREATE OR REPLACE FUNCTION agent_run_transition_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT ((OLD.status = 'queued' AND NEW.status IN ('running', 'cancelled'))
         OR (OLD.status = 'running' AND NEW.status IN ('completed', 'failed', 'cancelled'))
         OR (OLD.status = 'running' AND NEW.status = 'queued'
             AND NEW.attempt = OLD.attempt + 1
             AND NEW.claim_expires_at IS NULL
             -- IS NOT DISTINCT FROM: a run without a manifest must be refused,
             -- not slip through as NULL.
             AND (OLD.plugin_manifest ->> 'durability') IS NOT DISTINCT FROM 'resume')) THEN
        RAISE EXCEPTION 'agent_run %: illegal status transition % -> %', OLD.id, OLD.status, NEW.status
            USING ERRCODE = 'check_violation', CONSTRAINT = 'agent_run_status_transition';
    END IF;
    RETURN NEW;
END
$$;
