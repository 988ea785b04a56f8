-- A tenant's ceilings on the limits its own plugins' manifests may ask for
-- (`agent-host tenants ceiling`), beside its share of slots; a row may now
-- hold either. Checked when a tenant's admin uploads a plugin.
ALTER TABLE tenant_limit ALTER COLUMN slot_share_pct DROP NOT NULL;
ALTER TABLE tenant_limit ADD COLUMN ceilings jsonb NOT NULL DEFAULT '{}'
    CHECK (jsonb_typeof(ceilings) = 'object');

-- Retention marks what it trimmed, so a run whose request snapshot is null
-- for another reason (a retry of a trimmed run copies it) is still trimmed
-- when its own time comes. (No index for retention's once-a-minute read: one
-- would cost every run's ending an index insert.)
ALTER TABLE agent_run ADD COLUMN trimmed_at timestamptz;
UPDATE agent_run r SET trimmed_at = r.finished_at
WHERE r.finished_at IS NOT NULL AND r.request IS NULL
  AND NOT EXISTS (SELECT 1 FROM run_event e WHERE e.run_id = r.id);
