//! Token lifecycle with its audit rows, written once for the command line
//! and the admin API: a create or a revoke and its audit row commit together.

use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::db::audit::{self, action, Actor};
use crate::db::tokens::{self, CreateError, NewToken, Scope, TokenInfo};

/// Longest `--expires-in`: ten years.
pub const EXPIRES_IN_MAX_S: i64 = 10 * 365 * 86_400;

/// Creates a token; its row and its secret (shown this once).
/// Refused ([`CreateError::OtherTenant`]) for a user id of another tenant.
pub async fn create(pool: &PgPool, actor: &Actor, new: &NewToken<'_>) -> Result<(TokenInfo, String), CreateError> {
    let mut tx = pool.begin().await?;
    let (info, secret) = tokens::create_with(&mut *tx, new).await?;
    let detail = json!({ "user_id": info.user_id, "admin": info.admin, "operator": info.operator,
                         "expires_at": info.expires_at });
    audit::record(&mut *tx, actor, action::TOKEN_CREATED, Some(&info.tenant_id), &info.id.to_string(), detail).await?;
    tx.commit().await?;
    Ok((info, secret))
}

/// Revokes the token `id` within `scope`: `Some(true)` when this call
/// revoked it (and wrote its audit row), `Some(false)` when it already was,
/// `None` when there is no such token in the scope.
pub async fn revoke(pool: &PgPool, actor: &Actor, id: Uuid, scope: Scope<'_>) -> Result<Option<bool>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let Some(info) = tokens::get(&mut *tx, id, scope).await? else { return Ok(None) };
    let revoked = tokens::revoke(&mut *tx, id, scope).await?;
    if revoked == Some(true) {
        let detail = json!({ "user_id": info.user_id });
        audit::record(&mut *tx, actor, action::TOKEN_REVOKED, Some(&info.tenant_id), &id.to_string(), detail).await?;
    }
    tx.commit().await?;
    Ok(revoked)
}
