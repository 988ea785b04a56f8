-- Fair claims: the claim walks the tenants with queued work (a loose index
-- scan) and weighs each by its running runs.
CREATE INDEX agent_run_queued_by_tenant ON agent_run (tenant_id, queue_pos) WHERE status = 'queued';
CREATE INDEX agent_run_running_by_tenant ON agent_run (tenant_id) WHERE status = 'running';
-- The claim no longer scans the queue by queue_pos alone; one index fewer
-- to write on every enqueue and claim.
DROP INDEX agent_run_queued;
