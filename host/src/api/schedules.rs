//! Schedules: create, list (paged), pause, resume, delete. A user reaches
//! its own schedules; a tenant admin every schedule of its tenant (pause,
//! resume and delete by id, and `GET /v1/schedules?all=true`); an operator
//! every schedule.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::db::schedules::{self, SCHEDULES_PAGE_MAX};
use crate::db::ConversationId;
use crate::service::schedules::{self as service, ScheduleError, ScheduleRequest};

use super::paging::PageQuery;
use super::runs::owner;
use super::{ApiError, ApiJson, ApiQuery, AppState, Auth, OrNotFound};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSchedule {
    plugin: String,
    content: String,
    #[serde(default)]
    config: Option<Value>,
    #[serde(default)]
    conversation_id: Option<ConversationId>,
    cron: String,
    #[serde(default)]
    timezone: Option<String>,
    #[serde(default)]
    webhook: Option<String>,
}

impl From<ScheduleError> for ApiError {
    fn from(e: ScheduleError) -> Self {
        match e {
            ScheduleError::Invalid(m) => ApiError::invalid(m),
            ScheduleError::Db(e) => e.into(),
        }
    }
}

/// The schedules `p` may change by id: its own, or as an admin its tenant's.
fn scope(p: &crate::db::tokens::Principal) -> schedules::Scope<'_> {
    match (p.admin, p.tenant_scope()) {
        (false, _) => schedules::Scope::Owner(&p.user_id),
        (true, Some(tenant)) => schedules::Scope::Tenant(tenant),
        (true, None) => schedules::Scope::All,
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    limit: Option<String>,
    after: Option<String>,
    /// `true`: an admin's view, every schedule of its tenant (an operator's: all).
    all: Option<String>,
}

fn schedule_id(raw: &str) -> Result<Uuid, ApiError> {
    raw.parse().map_err(|_| ApiError::bad_request(format!("schedule id {raw:?} is not a UUID")))
}

/// `POST /v1/schedules`.
pub async fn create(
    State(state): State<AppState>,
    Auth(p): Auth,
    ApiJson(b): ApiJson<CreateSchedule>,
) -> Result<impl IntoResponse, ApiError> {
    let r = ScheduleRequest {
        owner: owner(&p),
        plugin: b.plugin,
        content: b.content,
        config: b.config,
        conversation_id: b.conversation_id,
        cron: b.cron,
        timezone: b.timezone,
        webhook: b.webhook,
    };
    let created = service::create(&state.pool, &state.agents, &state.policy, &r).await?;
    let detail = json!({ "plugin": r.plugin, "cron": r.cron, "timezone": r.timezone });
    super::audit::record(&state, &p, crate::db::audit::action::SCHEDULE_CREATED, created.id, detail).await;
    Ok((StatusCode::CREATED, Json(created)))
}

/// `GET /v1/schedules?limit&after&all`: oldest first; the caller's own, or
/// with `all=true` (admins) every schedule it may change.
pub async fn list(
    State(state): State<AppState>,
    Auth(p): Auth,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let page = PageQuery::new(q.limit, q.after).page(SCHEDULES_PAGE_MAX as usize)?;
    let after = page.after_as::<Uuid>()?;
    let scope = match q.all.as_deref() {
        None | Some("false") => schedules::Scope::Owner(&p.user_id),
        Some("true") if p.admin => scope(&p),
        Some("true") => {
            return Err(ApiError::new(
                super::ErrorCode::Forbidden,
                "all=true lists a tenant's schedules: admin tokens only",
            ))
        }
        Some(other) => return Err(ApiError::bad_request(format!("all must be true or false, not {other:?}"))),
    };
    let mut rows = schedules::list(&state.pool, scope, after, page.fetch()).await?;
    let next_cursor = page.finish(&mut rows, |s| s.id.to_string());
    Ok(Json(json!({ "schedules": rows, "next_cursor": next_cursor })))
}

/// `GET /v1/schedules/{id}`.
pub async fn get_one(
    State(state): State<AppState>,
    Auth(p): Auth,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let id = schedule_id(&id)?;
    let s = schedules::get(&state.pool, id, scope(&p)).await?.or_not_found(format!("schedule {id}"))?;
    Ok(Json(s))
}

/// `POST /v1/schedules/{id}/pause`.
pub async fn pause(
    State(state): State<AppState>,
    Auth(p): Auth,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let id = schedule_id(&id)?;
    let s = schedules::set_paused(&state.pool, id, scope(&p), true, None).await?;
    let s = s.or_not_found(format!("schedule {id}"))?;
    super::audit::record(&state, &p, crate::db::audit::action::SCHEDULE_PAUSED, id, json!({})).await;
    Ok(Json(s))
}

/// `POST /v1/schedules/{id}/resume`: fires next at its next time after now
/// (what it missed while paused is not caught up).
pub async fn resume(
    State(state): State<AppState>,
    Auth(p): Auth,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let id = schedule_id(&id)?;
    let s = schedules::get(&state.pool, id, scope(&p)).await?.or_not_found(format!("schedule {id}"))?;
    let next = service::next_after(&s.cron, &s.timezone, chrono::Utc::now()).map_err(ApiError::invalid)?;
    let s = schedules::set_paused(&state.pool, id, scope(&p), false, next).await?;
    let s = s.or_not_found(format!("schedule {id}"))?;
    super::audit::record(&state, &p, crate::db::audit::action::SCHEDULE_RESUMED, id, json!({})).await;
    Ok(Json(s))
}

/// `DELETE /v1/schedules/{id}`: runs it already started are not touched.
pub async fn delete(
    State(state): State<AppState>,
    Auth(p): Auth,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let id = schedule_id(&id)?;
    if !schedules::delete(&state.pool, id, scope(&p)).await? {
        return Err(ApiError::not_found(format!("schedule {id}")));
    }
    super::audit::record(&state, &p, crate::db::audit::action::SCHEDULE_DELETED, id, json!({})).await;
    Ok(StatusCode::NO_CONTENT)
}
