-- A tenant's share of each process's run slots, set by the operator
-- (`agent-host tenants share`). A tenant without a row takes the process's
-- --tenant-slot-share-pct. Each worker reads this table on its heartbeat.
CREATE TABLE tenant_limit (
    tenant_id      text PRIMARY KEY CHECK (length(tenant_id) BETWEEN 1 AND 200),
    slot_share_pct integer NOT NULL CHECK (slot_share_pct BETWEEN 1 AND 100),
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- Schedules are capped per tenant (counted at create) and fired fairly
-- across tenants.
CREATE INDEX schedule_tenant ON schedule (tenant_id);
-- Whether a schedule's owner still holds a valid token, asked on each firing.
CREATE INDEX api_token_user ON api_token (user_id);
