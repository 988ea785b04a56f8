-- Operator controls: tokens with an id, an expiry and a revocation; stream
-- tickets; plugins owned by a tenant (or published to all); an append-only
-- audit trail.

-- Tokens. Existing tokens get an id and never expire (as before).
ALTER TABLE api_token ADD COLUMN id uuid NOT NULL DEFAULT gen_random_uuid();
ALTER TABLE api_token ADD CONSTRAINT api_token_id_key UNIQUE (id);
-- An operator-level admin: manages every tenant's tokens, publishes plugins.
ALTER TABLE api_token ADD COLUMN operator boolean NOT NULL DEFAULT false;
ALTER TABLE api_token ADD COLUMN expires_at timestamptz;
ALTER TABLE api_token ADD COLUMN revoked_at timestamptz;
ALTER TABLE api_token ADD COLUMN last_used_at timestamptz;
ALTER TABLE api_token ADD CONSTRAINT api_token_operator_is_admin CHECK (admin OR NOT operator);

-- A short-lived, run-scoped ticket an EventSource presents instead of the
-- token (it cannot send headers). Only its sha256 is stored; it is worth
-- nothing once its token is revoked or expired, or past its own expiry.
CREATE TABLE stream_ticket (
    ticket_hash  bytea PRIMARY KEY,
    token_id     uuid NOT NULL REFERENCES api_token (id) ON DELETE CASCADE,
    run_id       uuid NOT NULL REFERENCES agent_run (id) ON DELETE CASCADE,
    expires_at   timestamptz NOT NULL
);
CREATE INDEX stream_ticket_by_token ON stream_ticket (token_id, expires_at);

-- Plugins belong to a tenant; a null tenant is published to every tenant.
-- A name is unique per tenant and once among the published. Existing
-- plugins stay published (what every tenant could run before).
ALTER TABLE plugin ADD COLUMN tenant_id text CHECK (tenant_id IS NULL OR length(tenant_id) BETWEEN 1 AND 200);
ALTER TABLE plugin DROP CONSTRAINT plugin_pkey;
CREATE UNIQUE INDEX plugin_published_name ON plugin (name) WHERE tenant_id IS NULL;
CREATE UNIQUE INDEX plugin_tenant_name ON plugin (tenant_id, name) WHERE tenant_id IS NOT NULL;

-- The audit trail: who did what, when. Never a secret, never message text.
CREATE TABLE audit_event (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at            timestamptz NOT NULL DEFAULT now(),
    -- The acting token's user and tenant; `cli` for the operator's command line.
    actor_user    text NOT NULL,
    actor_tenant  text,
    actor_token   uuid,
    -- The tenant whose object it was (who may read the row).
    tenant_id     text,
    action        text NOT NULL CHECK (action ~ '^[a-z][a-z_.]{0,62}$'),
    target        text NOT NULL,
    detail        jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX audit_event_by_tenant ON audit_event (tenant_id, id);

-- Append-only in the schema, not only in code.
CREATE FUNCTION audit_event_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_event is append-only';
END
$$;
CREATE TRIGGER audit_event_append_only
    BEFORE UPDATE OR DELETE ON audit_event
    FOR EACH ROW EXECUTE FUNCTION audit_event_append_only();
