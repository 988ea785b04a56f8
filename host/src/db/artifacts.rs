//! Compiled components (`plugin_artifact`), keyed by component digest,
//! engine compatibility hash and the id of the artifact key of their MAC
//! (hosts with different keys keep separate rows). The sandbox writes and checks them; nothing
//! else reads them.

use sqlx::PgExecutor;

/// A stored artifact: the serialized component and its MAC.
#[derive(Debug, sqlx::FromRow)]
pub struct Artifact {
    pub artifact: Vec<u8>,
    pub mac: Vec<u8>,
}

pub async fn get(
    db: impl PgExecutor<'_>,
    digest: &str,
    engine: &str,
    key_id: &str,
) -> Result<Option<Artifact>, sqlx::Error> {
    sqlx::query_as("SELECT artifact, mac FROM plugin_artifact WHERE digest = $1 AND engine = $2 AND key_id = $3")
        .bind(digest)
        .bind(engine)
        .bind(key_id)
        .fetch_optional(db)
        .await
}

/// Stores (or replaces: a rejected artifact is overwritten by the recompiled
/// one) the artifact of `digest` for `engine` under the key `key_id`.
pub async fn put(
    db: impl PgExecutor<'_>,
    digest: &str,
    engine: &str,
    key_id: &str,
    artifact: &[u8],
    mac: &[u8],
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO plugin_artifact (digest, engine, key_id, artifact, mac, size_bytes) VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (digest, engine, key_id) DO UPDATE
         SET artifact = excluded.artifact, mac = excluded.mac, size_bytes = excluded.size_bytes, created_at = now()",
    )
    .bind(digest)
    .bind(engine)
    .bind(key_id)
    .bind(artifact)
    .bind(mac)
    .bind(artifact.len() as i32)
    .execute(db)
    .await?;
    Ok(())
}
