//! The plugin registry: content-addressed components and the names that
//! point at them. A name belongs to a tenant (visible to and runnable by it
//! alone) or is published to every tenant; a name resolves to the caller's
//! tenant's plugin first, then a published one.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use sqlx::{PgExecutor, PgPool};

use super::audit::{self, action, Actor};

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

/// The language a component was written in, as far as its toolchain's
/// marks tell (shown in the console's plugin picker; nothing depends on it):
/// `python` (componentize-py), `javascript` (componentize-js, whose engine
/// is StarlingMonkey), `rust` (its standard library's paths), else `unknown`.
pub fn language_of(bytes: &[u8]) -> &'static str {
    let has = |mark: &str| memchr::memmem::find(bytes, mark.as_bytes()).is_some();
    if has("componentize-py") {
        "python"
    } else if has("StarlingMonkey") || has("componentize-js") {
        "javascript"
    } else if has("library/std/src") || has("/rustc/") {
        "rust"
    } else {
        "unknown"
    }
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow, schemars::JsonSchema)]
pub struct PluginRow {
    pub name: String,
    pub digest: String,
    /// See [`language_of`].
    pub language: String,
    pub manifest: Value,
    pub size_bytes: i32,
    pub updated_at: DateTime<Utc>,
    /// The tenant that owns it; `None`: published to every tenant.
    pub tenant_id: Option<String>,
}

const COLUMNS: &str = "p.name, p.digest, c.language, p.manifest, c.size_bytes, p.updated_at, p.tenant_id";

/// Stores the component (once per digest) and publishes `name` (every
/// tenant may run it) pointing at it with `manifest`, in one transaction.
/// Unaudited: for setup by the library's users; the APIs call [`put_as`].
pub async fn put(pool: &PgPool, name: &str, bytes: &[u8], manifest: &Value) -> Result<PluginRow, sqlx::Error> {
    put_in(pool, None, name, bytes, manifest, None).await
}

/// [`put`] for `tenant` (`None`: published), with the audit row of `actor`
/// (uploaded, re-pointed or published) in the same transaction.
pub async fn put_as(
    pool: &PgPool,
    actor: &Actor,
    tenant: Option<&str>,
    name: &str,
    bytes: &[u8],
    manifest: &Value,
) -> Result<PluginRow, sqlx::Error> {
    put_in(pool, tenant, name, bytes, manifest, Some(actor)).await
}

async fn put_in(
    pool: &PgPool,
    tenant: Option<&str>,
    name: &str,
    bytes: &[u8],
    manifest: &Value,
    actor: Option<&Actor>,
) -> Result<PluginRow, sqlx::Error> {
    let digest = digest_of(bytes);
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO plugin_component (digest, component, size_bytes, language) VALUES ($1, $2, $3, $4)
         ON CONFLICT (digest) DO NOTHING",
    )
    .bind(&digest)
    .bind(bytes)
    .bind(bytes.len() as i32)
    .bind(language_of(bytes))
    .execute(&mut *tx)
    .await?;
    // The name in this scope, locked (a row lock would lock nothing on a
    // first upload, and two concurrent first uploads would both record
    // one): what it pointed at before. A tenant id is never empty, so ''
    // is the published scope.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('plugin:' || coalesce($2, '') || '/' || $1, 0))")
        .bind(name)
        .bind(tenant)
        .execute(&mut *tx)
        .await?;
    let previous: Option<String> = sqlx::query_scalar(
        "SELECT digest FROM plugin WHERE name = $1 AND tenant_id IS NOT DISTINCT FROM $2 FOR UPDATE",
    )
    .bind(name)
    .bind(tenant)
    .fetch_optional(&mut *tx)
    .await?;
    // Each scope's own unique index (a partial one) is the conflict target.
    let upsert = if tenant.is_some() {
        "INSERT INTO plugin (name, digest, manifest, tenant_id) VALUES ($1, $2, $3, $4)
         ON CONFLICT (tenant_id, name) WHERE tenant_id IS NOT NULL
         DO UPDATE SET digest = excluded.digest, manifest = excluded.manifest, updated_at = now()"
    } else {
        "INSERT INTO plugin (name, digest, manifest, tenant_id) VALUES ($1, $2, $3, $4)
         ON CONFLICT (name) WHERE tenant_id IS NULL
         DO UPDATE SET digest = excluded.digest, manifest = excluded.manifest, updated_at = now()"
    };
    sqlx::query(upsert).bind(name).bind(&digest).bind(manifest).bind(tenant).execute(&mut *tx).await?;
    if let Some(actor) = actor {
        let what = match (&previous, tenant) {
            (Some(_), _) => action::PLUGIN_REPOINTED,
            (None, None) => action::PLUGIN_PUBLISHED,
            (None, Some(_)) => action::PLUGIN_UPLOADED,
        };
        let detail = json!({ "digest": digest, "previous_digest": previous, "published": tenant.is_none() });
        audit::record(&mut *tx, actor, what, tenant, name, detail).await?;
    }
    let row: PluginRow = sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM plugin p JOIN plugin_component c ON c.digest = p.digest
         WHERE p.name = $1 AND p.tenant_id IS NOT DISTINCT FROM $2"
    ))
    .bind(name)
    .bind(tenant)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(row)
}

/// The published plugin `name`.
pub async fn get(db: impl PgExecutor<'_>, name: &str) -> Result<Option<PluginRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM plugin p JOIN plugin_component c ON c.digest = p.digest
         WHERE p.name = $1 AND p.tenant_id IS NULL"
    ))
    .bind(name)
    .fetch_optional(db)
    .await
}

/// What `name` resolves to for `tenant`: the tenant's own plugin first,
/// then a published one. Another tenant's private plugin is not there.
pub async fn resolve(db: impl PgExecutor<'_>, tenant: &str, name: &str) -> Result<Option<PluginRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM plugin p JOIN plugin_component c ON c.digest = p.digest
         WHERE p.name = $1 AND (p.tenant_id = $2 OR p.tenant_id IS NULL)
         ORDER BY p.tenant_id IS NULL LIMIT 1"
    ))
    .bind(name)
    .bind(tenant)
    .fetch_optional(db)
    .await
}

/// Whether `name`, as `tenant` resolves it (its own plugin first, then a
/// published one), is a published plugin (the operator's, `tenant_id`
/// null) pointing at `digest` now. Anything else (the tenant's own, or a
/// name re-pointed since) counts as the tenant's: held to its grants, never
/// to fewer.
pub async fn is_published_as(
    db: impl PgExecutor<'_>,
    name: &str,
    digest: &str,
    tenant: &str,
) -> Result<bool, sqlx::Error> {
    let first: Option<(Option<String>, String)> = sqlx::query_as(
        "SELECT tenant_id, digest FROM plugin WHERE name = $1 AND (tenant_id = $2 OR tenant_id IS NULL)
         ORDER BY tenant_id IS NULL LIMIT 1",
    )
    .bind(name)
    .bind(tenant)
    .fetch_optional(db)
    .await?;
    Ok(matches!(first, Some((None, d)) if d == digest))
}

/// Plugins in byte order of their names (`COLLATE "C"`, so callers can
/// merge them with other names), at most `limit`, after the name `after`
/// when given: what `tenant` may run (one per name, its own before a
/// published one), or with `None` the published ones only.
pub async fn list(
    db: impl PgExecutor<'_>,
    tenant: Option<&str>,
    after: Option<&str>,
    limit: i64,
) -> Result<Vec<PluginRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        r#"SELECT * FROM (
             SELECT DISTINCT ON (p.name COLLATE "C") {COLUMNS}
             FROM plugin p JOIN plugin_component c ON c.digest = p.digest
             WHERE ($1::text IS NULL OR p.name COLLATE "C" > $1)
               AND (p.tenant_id IS NULL OR p.tenant_id = $3)
             ORDER BY p.name COLLATE "C", p.tenant_id IS NULL
           ) v ORDER BY v.name COLLATE "C" LIMIT $2"#
    ))
    .bind(after)
    .bind(limit)
    .bind(tenant)
    .fetch_all(db)
    .await
}

/// A component's bytes by digest.
pub async fn component(db: impl PgExecutor<'_>, digest: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
    sqlx::query_scalar("SELECT component FROM plugin_component WHERE digest = $1").bind(digest).fetch_optional(db).await
}
