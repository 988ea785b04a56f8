-- Fewer writes per run. The reaper's lease index is dropped: every claim
-- wrote an entry into it, and every heartbeat (which moves
-- claim_expires_at) could not be a HOT update while claim_expires_at was
-- indexed. The reaper's read (running rows whose lease lapsed) scans
-- one_running_per_conversation instead, whose entries are exactly the
-- active runs (running or waiting: bounded by the slots of every process),
-- and re-checks the lease in its write as before.
DROP INDEX agent_run_running_lease;
