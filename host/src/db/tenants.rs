//! Operator settings per tenant (`tenant_limit`): its share of each
//! process's run slots. Read by every worker on its heartbeat
//! (`worker::shares`), written by `agent-host tenants share`.

use sqlx::PgExecutor;

/// Tenants whose shares a worker keeps in memory at most; past it the rest
/// take the default (an operator with more overrides sees a warning).
pub const SHARES_MAX: i64 = 10_000;

/// Every tenant's share of a process's slots, in percent, as the operator set it.
pub async fn shares(db: impl PgExecutor<'_>) -> Result<Vec<(String, i32)>, sqlx::Error> {
    sqlx::query_as("SELECT tenant_id, slot_share_pct FROM tenant_limit ORDER BY tenant_id LIMIT $1")
        .bind(SHARES_MAX)
        .fetch_all(db)
        .await
}

/// Sets `tenant`'s share (1-100 percent), or clears it (`None`: the default again).
pub async fn set_share(db: impl PgExecutor<'_>, tenant: &str, pct: Option<i32>) -> Result<(), sqlx::Error> {
    match pct {
        Some(pct) => {
            sqlx::query(
                "INSERT INTO tenant_limit (tenant_id, slot_share_pct) VALUES ($1, $2)
                 ON CONFLICT (tenant_id) DO UPDATE SET slot_share_pct = $2, updated_at = now()",
            )
            .bind(tenant)
            .bind(pct)
            .execute(db)
            .await?;
        }
        None => {
            sqlx::query("DELETE FROM tenant_limit WHERE tenant_id = $1").bind(tenant).execute(db).await?;
        }
    }
    Ok(())
}
