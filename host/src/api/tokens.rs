//! Tokens over HTTP: list and create (admins), revoke (admins, or a user
//! their own); and a run's stream ticket (any token that may read the run).
//! An admin manages its tenant's tokens and creates no operator; an
//! operator manages every tenant's.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use crate::db::audit::Actor;
use crate::db::tokens::{self, NewToken, Scope, TokenId};
use crate::db::{runs, RunId};
use crate::text;

use super::{Admin, ApiError, ApiJson, AppState, Auth, OrNotFound, PathId};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateToken {
    pub user_id: String,
    /// Default: the caller's tenant (only an operator may name another).
    #[serde(default)]
    pub tenant_id: Option<String>,
    #[serde(default)]
    pub admin: bool,
    #[serde(default)]
    pub operator: bool,
    /// Seconds until it expires; unset: never. Never later than the
    /// creating token expires.
    #[serde(default)]
    pub expires_in_s: Option<i64>,
}

/// Characters of a user or tenant id (the schema checks the same).
const ID_CHARS_MAX: usize = 200;

/// `GET /v1/tokens`: id, user, tenant, admin, created, last used, expiry,
/// revoked; never a secret.
/// At most [`tokens::LIST_MAX`], oldest first; `truncated` says there are more.
pub async fn list(State(state): State<AppState>, Admin(p): Admin) -> Result<impl IntoResponse, ApiError> {
    let mut rows = tokens::list(&state.pool, Scope::of(&p), tokens::LIST_MAX + 1).await?;
    let truncated = rows.len() as i64 > tokens::LIST_MAX;
    rows.truncate(tokens::LIST_MAX as usize);
    Ok(Json(json!({ "tokens": rows, "truncated": truncated })))
}

/// `POST /v1/tokens`: 201 with the secret, shown this once.
pub async fn create(
    State(state): State<AppState>,
    Admin(p): Admin,
    ApiJson(b): ApiJson<CreateToken>,
) -> Result<impl IntoResponse, ApiError> {
    let tenant = b.tenant_id.clone().unwrap_or_else(|| p.tenant_id.clone());
    if !p.operator && (tenant != p.tenant_id || b.operator) {
        return Err(ApiError::forbidden("an admin creates tokens of its own tenant only, and no operator tokens"));
    }
    for (field, v) in [("user_id", &b.user_id), ("tenant_id", &tenant)] {
        text::refuse_text(field, v).map_err(|e| ApiError::invalid(e.to_string()))?;
        if v.trim().is_empty() || v.chars().count() > ID_CHARS_MAX {
            return Err(ApiError::invalid(format!("{field} must be 1 to {ID_CHARS_MAX} characters")));
        }
    }
    if let Some(s) = b.expires_in_s {
        if !(1..=crate::service::tokens::EXPIRES_IN_MAX_S).contains(&s) {
            return Err(ApiError::invalid("expires_in_s must be between 1 and 315360000 (ten years)"));
        }
    }
    let new = NewToken {
        user_id: &b.user_id,
        tenant_id: &tenant,
        admin: b.admin,
        operator: b.operator,
        expires_in_s: b.expires_in_s,
        expires_by: Some(p.token_id),
    };
    let (info, secret) =
        crate::service::tokens::create(&state.pool, &Actor::from(&p), &new).await.map_err(|e| match e {
            tokens::CreateError::OtherTenant { .. } => ApiError::conflict(e.to_string()),
            tokens::CreateError::Db(e) => e.into(),
        })?;
    let mut body = serde_json::to_value(&info).expect("a token's row is JSON");
    body["token"] = json!(secret);
    Ok((StatusCode::CREATED, Json(body)))
}

/// `POST /v1/tokens/{id}/revoke`: 200 `{id, revoked: true}`, idempotent.
/// An operator revokes any token, an admin its tenant's (but no
/// operator's), anyone else only their own; any other is 404 (unknown, or
/// not yours).
pub async fn revoke(
    State(state): State<AppState>,
    Auth(p): Auth,
    id: PathId<TokenId>,
) -> Result<impl IntoResponse, ApiError> {
    crate::service::tokens::revoke(&state.pool, &Actor::from(&p), id.0 .0, Scope::of(&p)).await?.or_not_found(id)?;
    Ok(Json(json!({ "id": id.0, "revoked": true })))
}

/// `POST /v1/runs/{id}/stream-ticket`: 201 `{ticket, expires_at, url}`, a
/// ticket that opens this run's event stream (and no other) until it
/// expires or the token behind it is revoked.
pub async fn stream_ticket(
    State(state): State<AppState>,
    Auth(p): Auth,
    id: PathId<RunId>,
) -> Result<impl IntoResponse, ApiError> {
    runs::get_run(&state.pool, id.0, &p.user_id).await?.or_not_found(id)?;
    let (ticket, expires_at) = tokens::mint_ticket(&state.pool, p.token_id, id.0).await?;
    let url = format!("/v1/runs/{}/events?ticket={ticket}", id.0);
    Ok((StatusCode::CREATED, Json(json!({ "ticket": ticket, "expires_at": expires_at, "url": url }))))
}
