//! Runs: enqueue (through `service::submit`), read, cancel, retry.

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::db::enqueue::Owner;
use crate::db::lifecycle::{self, Cancelled, RetryError};
use crate::db::runs;
use crate::db::tokens::Principal;
use crate::db::{ConversationId, RunId, RunStatus};
use crate::service::submit::{self, Busy, RetryRefused, Submission};

use super::paging::PageQuery;
use super::{audit, ApiError, ApiJson, ApiQuery, AppState, Auth, OrNotFound, PathId};
use crate::db::audit::action;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateRun {
    pub content: String,
    pub plugin: String,
    #[serde(default)]
    pub conversation_id: Option<ConversationId>,
    #[serde(default)]
    pub config: Option<Value>,
    /// Told when the run ends: a URL under a prefix the operator allows.
    #[serde(default)]
    pub webhook: Option<String>,
    /// When the conversation has an active turn: `enqueue` (default),
    /// `reject` (409) or `interrupt` (stop it; this one runs next).
    #[serde(default)]
    pub multitask_strategy: Busy,
}

pub(super) fn owner(p: &Principal) -> Owner {
    Owner { user_id: p.user_id.clone(), tenant_id: p.tenant_id.clone() }
}

pub async fn create_run(
    State(state): State<AppState>,
    Auth(p): Auth,
    headers: HeaderMap,
    ApiJson(body): ApiJson<CreateRun>,
) -> Result<impl IntoResponse, ApiError> {
    enqueue(&state, &p, &headers, body).await
}

pub async fn create_run_in_conversation(
    State(state): State<AppState>,
    Auth(p): Auth,
    id: PathId<ConversationId>,
    headers: HeaderMap,
    ApiJson(mut body): ApiJson<CreateRun>,
) -> Result<impl IntoResponse, ApiError> {
    if body.conversation_id.is_some_and(|c| c != id.0) {
        return Err(ApiError::invalid("conversation_id in the body differs from the one in the path"));
    }
    body.conversation_id = Some(id.0);
    enqueue(&state, &p, &headers, body).await
}

/// The native answer to a submission: 202 and the run, marked
/// `Idempotent-Replayed: true` when it is the first request's again.
async fn enqueue(
    state: &AppState,
    p: &Principal,
    headers: &HeaderMap,
    body: CreateRun,
) -> Result<impl IntoResponse, ApiError> {
    let submission = Submission {
        owner: owner(p),
        conversation_id: body.conversation_id,
        content: body.content,
        plugin: body.plugin,
        config: body.config,
        idempotency_key: idempotency_key(&headers),
        webhook: body.webhook,
        strategy: body.multitask_strategy,
    };
    let submitted =
        submit::submit(&state.pool, &state.agents, &state.policy, &submission, state.local_worker()).await?;
    let mut headers = HeaderMap::new();
    if submitted.replayed() {
        headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Ok((StatusCode::ACCEPTED, headers, Json(submitted.enqueued().clone())))
}

pub async fn get_run(
    State(state): State<AppState>,
    Auth(p): Auth,
    id: PathId<RunId>,
) -> Result<impl IntoResponse, ApiError> {
    Ok(Json(runs::get_run(&state.pool, id.0, &p.user_id).await?.or_not_found(id)?))
}

/// Runs a page of `GET /v1/runs` holds unless `limit` says otherwise.
const RUNS_PAGE_DEFAULT: usize = 100;

/// The query of `GET /v1/runs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListRuns {
    limit: Option<String>,
    after: Option<String>,
    status: Option<String>,
}

/// `GET /v1/runs?status&limit&after`: the caller's runs, newest first; the
/// cursor is the last run's id.
pub async fn list_runs(
    State(state): State<AppState>,
    Auth(p): Auth,
    ApiQuery(q): ApiQuery<ListRuns>,
) -> Result<impl IntoResponse, ApiError> {
    let page = PageQuery::new(q.limit, q.after).page(RUNS_PAGE_DEFAULT)?;
    let after = page.after_as::<RunId>()?;
    let status = match q.status.as_deref() {
        None => None,
        Some(s) => Some(s.parse::<RunStatus>().map_err(|_| {
            let all: Vec<&str> = RunStatus::ALL.iter().map(|s| s.as_str()).collect();
            ApiError::bad_request(format!("status must be one of {}, not {s:?}", all.join(", ")))
        })?),
    };
    let mut rows = runs::list(&state.pool, &p.user_id, status, after, page.fetch()).await?;
    let next_cursor = page.finish(&mut rows, |r| r.id.to_string());
    Ok(Json(json!({ "runs": rows, "next_cursor": next_cursor })))
}

/// `POST /v1/runs/{id}/cancel`: a durable stop request. 202 while the run
/// winds down (or once a queued run is cancelled outright); 200 with the
/// status, changing nothing, when the run had already ended.
pub async fn cancel_run(
    State(state): State<AppState>,
    Auth(p): Auth,
    id: PathId<RunId>,
) -> Result<impl IntoResponse, ApiError> {
    let done = cancel(&state, &p, id.0).await?.or_not_found(id)?;
    let (code, status, cancel_requested) = match done {
        Cancelled::Queued | Cancelled::Waiting => (StatusCode::ACCEPTED, RunStatus::Cancelled, true),
        Cancelled::Flagged { .. } => (StatusCode::ACCEPTED, RunStatus::Running, true),
        Cancelled::Terminal(s, flagged) => (StatusCode::OK, s, flagged),
    };
    Ok((code, Json(json!({ "id": id.0, "status": status.as_str(), "cancel_requested": cancel_requested }))))
}

/// The request's `Idempotency-Key` (bytes that are not text fail the key's
/// check in the enqueue service).
pub(super) fn idempotency_key(headers: &HeaderMap) -> Option<String> {
    headers.get("idempotency-key").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

/// Cancels a run its owner names (both APIs): a run that ends at once (queued
/// or waiting) is counted as ended; a running one is flagged for its worker.
pub(super) async fn cancel(state: &AppState, p: &Principal, run: RunId) -> Result<Option<Cancelled>, sqlx::Error> {
    let done = lifecycle::cancel(&state.pool, run, &p.user_id).await?;
    if let Some(Cancelled::Queued | Cancelled::Waiting) = done {
        state.record_ended(1);
    }
    // A cancel that changed something is audited; a repeat (of a flagged or
    // ended run) is not.
    if matches!(done, Some(Cancelled::Queued | Cancelled::Waiting | Cancelled::Flagged { first: true })) {
        audit::record(state, p, action::RUN_CANCELLED, run, json!({})).await;
    }
    Ok(done)
}

/// `POST /v1/runs/{id}/retry`: a new run for the same user message, asked for
/// on purpose; only for a failed or cancelled run that is the latest turn.
pub async fn retry_run(
    State(state): State<AppState>,
    Auth(p): Auth,
    id: PathId<RunId>,
) -> Result<impl IntoResponse, ApiError> {
    let owner = Owner { user_id: p.user_id.clone(), tenant_id: p.tenant_id.clone() };
    match submit::retry(&state.pool, &state.policy.quotas, &owner, id.0).await {
        Ok(enqueued) => {
            audit::record(&state, &p, action::RUN_RETRIED, id.0, json!({ "new_run_id": enqueued.run_id })).await;
            Ok((StatusCode::ACCEPTED, Json(enqueued)))
        }
        Err(RetryRefused::Quota(e)) => Err(e.into()),
        Err(RetryRefused::Retry(RetryError::NotFound)) => Err(ApiError::not_found(id)),
        Err(RetryRefused::Retry(RetryError::Conflict(m))) => Err(ApiError::conflict(m)),
        Err(RetryRefused::Retry(RetryError::QueueFull { max })) => {
            Err(submit::queue_full(&state.policy.quotas, &p.tenant_id, max).into())
        }
        Err(RetryRefused::Retry(RetryError::Db(e))) => Err(e.into()),
    }
}
