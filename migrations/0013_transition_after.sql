-- Fewer writes per run: the status-transition check becomes an AFTER row
-- trigger that the two transitions of every run's hot path pass over in its
-- WHEN clause. A BEFORE row trigger on UPDATE makes the executor fetch and
-- lock each row again before its update and call the function for it,
-- whatever the WHEN clause says; an AFTER row trigger whose WHEN is false
-- queues nothing. The claim (queued -> running) and the ending (running ->
-- completed, failed or cancelled) are legal from every state they start in,
-- so the check has nothing to say about them; every other change of status
-- (queued -> cancelled, a hand-back, a suspension, a decision, anything
-- illegal) still calls agent_run_transition_check (0006), which refuses what
-- its table does not admit, and the refusal rolls the statement back.
--
-- What changes: an AFTER trigger runs after the row's CHECK constraints, so
-- a change the constraints already refuse (a terminal run set back to
-- running or queued: `finished_at` is set, agent_run_check1) is refused by
-- the constraint, not by the trigger. Terminal states stay sticky either way
-- (tests/run_core.rs, terminal_states_are_sticky_in_the_schema).
DROP TRIGGER agent_run_status_transition ON agent_run;
CREATE TRIGGER agent_run_status_transition
    AFTER UPDATE OF status ON agent_run
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status
        AND NOT ((OLD.status = 'queued' AND NEW.status = 'running')
              OR (OLD.status = 'running' AND NEW.status IN ('completed', 'failed', 'cancelled'))))
    EXECUTE FUNCTION agent_run_transition_check();
