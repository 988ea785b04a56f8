-- Compiled components: the native code Cranelift made of a stored component
-- for one engine configuration (wasmtime's precompile compatibility hash),
-- written by the first process that compiled it (an upload's validation or
-- a first run), so a process that never saw the digest deserializes instead
-- of compiling. Only the host writes here (no API takes precompiled bytes);
-- `mac` is an HMAC-SHA256 over (digest, engine, artifact) under the host's
-- secret artifact key, which a process checks before it loads the bytes,
-- recompiling when it does not match; `key_id` (the first 16 bytes of the
-- key's SHA-256, hex) keeps hosts with different keys apart: each finds,
-- checks and replaces only its own key's rows.
CREATE TABLE plugin_artifact (
    digest      text NOT NULL REFERENCES plugin_component (digest) ON DELETE CASCADE,
    engine      text NOT NULL CHECK (engine ~ '^[0-9a-f]{64}$'),
    key_id      text NOT NULL CHECK (key_id ~ '^[0-9a-f]{32}$'),
    artifact    bytea NOT NULL,
    mac         bytea NOT NULL CHECK (octet_length(mac) = 32),
    size_bytes  integer NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (digest, engine, key_id)
);
-- Native code hardly compresses and is read whole: no pglz on the way in or out.
ALTER TABLE plugin_artifact ALTER COLUMN artifact SET STORAGE EXTERNAL;

-- The language a component was written in (python, javascript, rust or
-- unknown), read from its toolchain's marks at upload, for the console.
ALTER TABLE plugin_component ADD COLUMN language text NOT NULL DEFAULT 'unknown';
