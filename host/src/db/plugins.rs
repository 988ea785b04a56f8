//! The plugin registry: content-addressed components and the names that
//! point at them.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::{PgExecutor, PgPool};

/// A plugin name: 1-63 of a-z, 0-9, `_`, `-`, starting with a letter (the
/// schema checks the same).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

/// `sha256:<hex>` of a component's bytes.
pub fn digest_of(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct PluginRow {
    pub name: String,
    pub digest: String,
    pub manifest: Value,
    pub size_bytes: i32,
    pub updated_at: DateTime<Utc>,
}

/// Stores the component (once per digest) and points `name` at it with
/// `manifest`, in one transaction.
pub async fn put(pool: &PgPool, name: &str, bytes: &[u8], manifest: &Value) -> Result<PluginRow, sqlx::Error> {
    let digest = digest_of(bytes);
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO plugin_component (digest, component, size_bytes) VALUES ($1, $2, $3)
         ON CONFLICT (digest) DO NOTHING",
    )
    .bind(&digest)
    .bind(bytes)
    .bind(bytes.len() as i32)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO plugin (name, digest, manifest) VALUES ($1, $2, $3)
         ON CONFLICT (name) DO UPDATE SET digest = excluded.digest, manifest = excluded.manifest, updated_at = now()",
    )
    .bind(name)
    .bind(&digest)
    .bind(manifest)
    .execute(&mut *tx)
    .await?;
    let row = get(&mut *tx, name).await?.expect("just written");
    tx.commit().await?;
    Ok(row)
}

pub async fn get(db: impl PgExecutor<'_>, name: &str) -> Result<Option<PluginRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT p.name, p.digest, p.manifest, c.size_bytes, p.updated_at
         FROM plugin p JOIN plugin_component c ON c.digest = p.digest WHERE p.name = $1",
    )
    .bind(name)
    .fetch_optional(db)
    .await
}

/// Registered plugins in byte order of their names (`COLLATE "C"`, so
/// callers can merge them with other names), at most `limit`, after the
/// name `after` when given.
pub async fn list(db: impl PgExecutor<'_>, after: Option<&str>, limit: i64) -> Result<Vec<PluginRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT p.name, p.digest, p.manifest, c.size_bytes, p.updated_at
           FROM plugin p JOIN plugin_component c ON c.digest = p.digest
           WHERE $1::text IS NULL OR p.name COLLATE "C" > $1
           ORDER BY p.name COLLATE "C" LIMIT $2"#,
    )
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// A component's bytes by digest.
pub async fn component(db: impl PgExecutor<'_>, digest: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
    sqlx::query_scalar("SELECT component FROM plugin_component WHERE digest = $1").bind(digest).fetch_optional(db).await
}
