//! The audit trail over HTTP (`GET /v1/audit`, admins), and [`record`]: the
//! one call a handler makes after an audited action succeeded. Token and
//! plugin changes write their row in their own transaction
//! (`service::tokens`, `db::plugins::put_as`); the rest (cancel, stop,
//! retry, approval decisions, schedules) write it right after theirs.

use axum::extract::State;
use axum::response::IntoResponse;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::db::audit::{self, Actor, PAGE_MAX};
use crate::db::tokens::Principal;

use super::{Admin, ApiError, ApiQuery, AppState};

/// Appends `p`'s audit row for `action` on `target` in `p`'s tenant. The
/// action has already committed: a failed write is logged, not answered.
pub(super) async fn record(state: &AppState, p: &Principal, action: &str, target: impl ToString, detail: Value) {
    let target = target.to_string();
    if let Err(e) = audit::record(&state.pool, &Actor::from(p), action, Some(&p.tenant_id), &target, detail).await {
        tracing::error!(error = %e, action, audit_target = %target, "writing an audit row failed");
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    after: Option<i64>,
    limit: Option<i64>,
}

/// `GET /v1/audit?after&limit`: oldest first; an admin reads its tenant's
/// rows and the operator-wide ones, an operator every row.
pub async fn list(
    State(state): State<AppState>,
    Admin(p): Admin,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let limit = q.limit.unwrap_or(PAGE_MAX);
    if !(1..=PAGE_MAX).contains(&limit) {
        return Err(ApiError::bad_request(format!("limit must be 1 to {PAGE_MAX}")));
    }
    let tenant = p.tenant_scope();
    let rows = audit::list(&state.pool, tenant, q.after, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    let rows: Vec<_> = rows.into_iter().take(limit as usize).collect();
    let next_cursor = more.then(|| rows.last().map(|r| r.id.to_string())).flatten();
    Ok(Json(json!({ "events": rows, "next_cursor": next_cursor })))
}
