//! `GET /v1/usage` (issue 46): model tokens by tenant, UTC day, provider and
//! model, as the providers reported them (`db::model_limits`).

use axum::extract::State;
use axum::response::IntoResponse;
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use crate::db::model_limits;

use super::{Admin, ApiError, ApiQuery, AppState};

/// Days the usage API reaches back, at most.
const DAYS_MAX: i32 = 366;
const DAYS_DEFAULT: i32 = 31;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    days: Option<i32>,
    /// `user`: a row per user too.
    by: Option<String>,
}

/// `GET /v1/usage?days&by`: an admin reads its tenant's rows, an operator
/// every tenant's; `by=user` splits them by the user whose runs made the calls.
pub async fn list(
    State(state): State<AppState>,
    Admin(p): Admin,
    ApiQuery(q): ApiQuery<UsageQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let days = q.days.unwrap_or(DAYS_DEFAULT);
    if !(1..=DAYS_MAX).contains(&days) {
        return Err(ApiError::bad_request(format!("days must be 1 to {DAYS_MAX}")));
    }
    let by_user = match q.by.as_deref() {
        None => false,
        Some("user") => true,
        Some(other) => return Err(ApiError::bad_request(format!("by must be \"user\" (or left out), not {other:?}"))),
    };
    let rows = model_limits::usage(&state.pool, p.tenant_scope(), days, by_user).await?;
    Ok(Json(json!({ "usage": rows })))
}
