-- Sub-agents (issue 45): a run starts child runs of agents its manifest
-- grants (`agent:<plugin>`), each a run of its own (its own conversation and
-- journal) under the parent's owner, tenant and quotas, and awaits one, any
-- or all of them (`await-agents`), suspended with nothing held while it
-- waits: status `waiting`, a `run_suspension` of kind `children`.
--
-- A child's start is a recorded tool call of its parent, and its enqueue
-- carries an idempotency key made of the parent and the call's ordinal, so
-- a resumed parent that re-issues the call finds the child it started
-- before (`(parent_run_id, parent_call)` is unique too).
ALTER TABLE agent_run ADD COLUMN parent_run_id uuid REFERENCES agent_run (id);
-- The parent's tool-call ordinal that started this run.
ALTER TABLE agent_run ADD COLUMN parent_call integer;
-- 0 for a run nobody's agent started; a child's is its parent's plus one.
ALTER TABLE agent_run ADD COLUMN depth smallint NOT NULL DEFAULT 0 CHECK (depth BETWEEN 0 AND 16);
ALTER TABLE agent_run ADD CONSTRAINT agent_run_parent_call
    CHECK ((parent_run_id IS NULL) = (parent_call IS NULL));
CREATE UNIQUE INDEX agent_run_children ON agent_run (parent_run_id, parent_call) WHERE parent_run_id IS NOT NULL;

-- A parent waits for its children; the join wakes it.
ALTER TABLE run_suspension DROP CONSTRAINT run_suspension_kind_check;
ALTER TABLE run_suspension ADD CONSTRAINT run_suspension_kind_check
    CHECK (kind IN ('approval', 'wait', 'children'));
ALTER TABLE run_suspension DROP CONSTRAINT run_suspension_decision_check;
ALTER TABLE run_suspension ADD CONSTRAINT run_suspension_decision_check
    CHECK (decision IN ('approve', 'reject', 'edit', 'elapsed', 'joined'));

-- Whether an `await-agents` suspension's children are joined: `args` is
-- the call's `{runs: [ids], mode: "all" | "any"}` as the host wrote it.
-- "all": none of them is still active; "any": one of them has ended.
CREATE FUNCTION agent_children_joined(parent uuid, args jsonb) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN args ->> 'mode' = 'any'
        THEN EXISTS (SELECT 1 FROM agent_run c
                     WHERE c.parent_run_id = parent
                       AND c.id IN (SELECT r::uuid FROM jsonb_array_elements_text(args -> 'runs') AS r)
                       AND c.status IN ('completed', 'failed', 'cancelled'))
        ELSE NOT EXISTS (SELECT 1 FROM agent_run c
                         WHERE c.parent_run_id = parent
                           AND c.id IN (SELECT r::uuid FROM jsonb_array_elements_text(args -> 'runs') AS r)
                           AND c.status IN ('queued', 'running', 'waiting'))
    END
$$;

-- waiting -> queued for a parent whose awaited children are joined, in the
-- transaction that ended the child (whichever writes it: the holder's
-- finish, the reaper, a stop): the parent's row is locked first, so this
-- and the parent's own suspension (which locks it and reads its children)
-- serialise, and a child's ending is never missed. The decision is written
-- once (`joined`), the parent re-queued as a new attempt, `agents_joined`
-- journaled on the parent (which holds no journal while it waits), and the
-- claimers and the parent's tails woken.
CREATE FUNCTION agent_run_child_ended() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    parent record;
    s record;
BEGIN
    SELECT id, status, conversation_id INTO parent FROM agent_run WHERE id = NEW.parent_run_id FOR UPDATE;
    IF parent.status IS DISTINCT FROM 'waiting' THEN
        RETURN NULL;
    END IF;
    FOR s IN SELECT call_index, args FROM run_suspension
             WHERE run_id = parent.id AND kind = 'children' AND decision IS NULL FOR UPDATE LOOP
        IF agent_children_joined(parent.id, s.args) THEN
            UPDATE run_suspension SET decision = 'joined', decided_at = now(), decided_by = 'child'
            WHERE run_id = parent.id AND call_index = s.call_index;
            UPDATE agent_run SET status = 'queued', attempt = attempt + 1 WHERE id = parent.id AND status = 'waiting';
            INSERT INTO run_event (run_id, seq, type, payload)
            SELECT parent.id, coalesce(max(seq), 0) + 1, 'agents_joined',
                   jsonb_build_object('call_id', s.call_index, 'run_id', NEW.id, 'status', NEW.status)
            FROM run_event WHERE run_id = parent.id;
            PERFORM pg_notify('run_enqueued', parent.conversation_id::text);
            PERFORM pg_notify('run_events_' || replace(parent.id::text, '-', ''), 'decided');
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

CREATE TRIGGER agent_run_child_ended
    AFTER UPDATE OF status ON agent_run
    FOR EACH ROW
    WHEN (NEW.parent_run_id IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status
          AND NEW.status IN ('completed', 'failed', 'cancelled'))
    EXECUTE FUNCTION agent_run_child_ended();

-- A child is a tool call of its parent: the audit of a stop's cascade and
-- the console's tree read a run's children.
CREATE INDEX agent_run_active_children ON agent_run (parent_run_id)
    WHERE parent_run_id IS NOT NULL AND status IN ('queued', 'running', 'waiting');
