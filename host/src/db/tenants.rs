//! Operator settings per tenant (`tenant_limit`): its share of each
//! process's run slots, read by every worker on its heartbeat
//! (`worker::shares`) and written by `agent-host tenants share`; and the
//! ceilings on the limits its own plugins may ask for, read at upload and
//! written by `agent-host tenants ceiling`.

use std::collections::BTreeMap;

use sqlx::types::Json;
use sqlx::{PgConnection, PgExecutor};

/// Limit name to the most a tenant's manifest may ask for.
pub type Ceilings = BTreeMap<String, u64>;

/// Tenants whose shares a worker keeps in memory at most; past it the rest
/// take the default (an operator with more overrides sees a warning).
pub const SHARES_MAX: i64 = 10_000;

/// Every tenant's share of a process's slots, in percent, as the operator set it.
pub async fn shares(db: impl PgExecutor<'_>) -> Result<Vec<(String, i32)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT tenant_id, slot_share_pct FROM tenant_limit WHERE slot_share_pct IS NOT NULL
         ORDER BY tenant_id LIMIT $1",
    )
    .bind(SHARES_MAX)
    .fetch_all(db)
    .await
}

/// Sets `tenant`'s share (1-100 percent), or clears it (`None`: the default again).
pub async fn set_share(conn: &mut PgConnection, tenant: &str, pct: Option<i32>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO tenant_limit (tenant_id, slot_share_pct) VALUES ($1, $2)
         ON CONFLICT (tenant_id) DO UPDATE SET slot_share_pct = $2, updated_at = now()",
    )
    .bind(tenant)
    .bind(pct)
    .execute(&mut *conn)
    .await?;
    forget_if_empty(conn, tenant).await
}

/// `tenant`'s ceilings (empty when the operator set none: a manifest may
/// ask for up to the host's own ceilings).
pub async fn ceilings(db: impl PgExecutor<'_>, tenant: &str) -> Result<Ceilings, sqlx::Error> {
    let row: Option<Json<Ceilings>> = sqlx::query_scalar("SELECT ceilings FROM tenant_limit WHERE tenant_id = $1")
        .bind(tenant)
        .fetch_optional(db)
        .await?;
    Ok(row.map(|j| j.0).unwrap_or_default())
}

/// Replaces `tenant`'s ceilings (checked by the caller with
/// `run::manifest::Limits::check_ceilings`); empty clears them.
pub async fn set_ceilings(conn: &mut PgConnection, tenant: &str, ceilings: &Ceilings) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO tenant_limit (tenant_id, ceilings) VALUES ($1, $2)
         ON CONFLICT (tenant_id) DO UPDATE SET ceilings = $2, updated_at = now()",
    )
    .bind(tenant)
    .bind(Json(ceilings))
    .execute(&mut *conn)
    .await?;
    forget_if_empty(conn, tenant).await
}

/// A tenant with neither a share nor ceilings of its own has no row.
async fn forget_if_empty(conn: &mut PgConnection, tenant: &str) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM tenant_limit WHERE tenant_id = $1 AND slot_share_pct IS NULL AND ceilings = '{}'")
        .bind(tenant)
        .execute(conn)
        .await?;
    Ok(())
}

/// Every tenant with settings of its own: (tenant, share, ceilings).
pub async fn list(db: impl PgExecutor<'_>) -> Result<Vec<(String, Option<i32>, Json<Ceilings>)>, sqlx::Error> {
    sqlx::query_as("SELECT tenant_id, slot_share_pct, ceilings FROM tenant_limit ORDER BY tenant_id LIMIT $1")
        .bind(SHARES_MAX)
        .fetch_all(db)
        .await
}
