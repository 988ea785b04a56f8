-- Plugins are content addressed: the component bytes live here, so any
-- process can run any run, and a run executes exactly the digest it was
-- enqueued with.
CREATE TABLE plugin_component (
    digest      text PRIMARY KEY CHECK (digest ~ '^sha256:[0-9a-f]{64}$'),
    component   bytea NOT NULL,
    size_bytes  integer NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- A name points at one digest (with its manifest); re-pointing a name never
-- changes what an already enqueued run executes.
CREATE TABLE plugin (
    name        text PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9_-]{0,62}$'),
    digest      text NOT NULL REFERENCES plugin_component (digest),
    manifest    jsonb NOT NULL DEFAULT '{}'::jsonb,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- The manifest a run executes with, pinned at enqueue beside the digest.
ALTER TABLE agent_run ADD COLUMN plugin_manifest jsonb;
