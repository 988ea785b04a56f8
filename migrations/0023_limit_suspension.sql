-- A model call of a resumable run that would wait long for a shared limit
-- (issue 46) suspends the run: a `run_suspension` of kind `limit`, woken by
-- its time like a durable wait, after which the call is asked again. One
-- call may suspend so more than once: its row is taken again each time.
ALTER TABLE run_suspension DROP CONSTRAINT run_suspension_kind_check;
ALTER TABLE run_suspension ADD CONSTRAINT run_suspension_kind_check
    CHECK (kind IN ('approval', 'wait', 'children', 'limit'));
