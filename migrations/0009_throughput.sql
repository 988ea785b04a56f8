-- Fewer writes per run. The reaper's lease index is dropped: every claim
-- wrote an entry into it, and every heartbeat (which moves
-- claim_expires_at) could not be a HOT update while claim_expires_at was
-- indexed. The reaper's read (running rows whose lease lapsed) is served by
-- agent_run_running_by_tenant (0004; WHERE status = 'running'), whose
-- entries are the running runs only, bounded by the slots of every process
-- (waiting runs are not in it), and the reaper re-checks the lease in its
-- write as before.
DROP INDEX agent_run_running_lease;
