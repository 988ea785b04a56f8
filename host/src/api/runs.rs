//! Runs: enqueue (through `service::submit`), read, cancel, retry.

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::db::enqueue::Owner;
use crate::db::lifecycle::{self, Cancelled, ForkError, RetryError};
use crate::db::runs;
use crate::db::steer::{self, SteerError};
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
    /// `reject` (409), `interrupt` (stop it; this one runs next) or `steer`
    /// (the content becomes an instruction for it; no run is enqueued).
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
) -> Result<axum::response::Response, ApiError> {
    if let (Busy::Steer, Some(conversation)) = (body.multitask_strategy, body.conversation_id) {
        submit::check_content(&body.content)?;
        match steer::queue_busy(&state.pool, conversation, &p.user_id, &body.content).await {
            Ok(Some(steer)) => {
                audit::record(state, p, action::RUN_STEERED, steer.run_id, json!({ "steer_id": steer.id })).await;
                let steered = json!({ "steered": true, "run_id": steer.run_id, "conversation_id": conversation,
                                      "steer": steer });
                return Ok((StatusCode::ACCEPTED, Json(steered)).into_response());
            }
            // No active turn: a run, as `enqueue` makes one.
            Ok(None) => {}
            Err(SteerError::Full(run)) => return Err(ApiError::conflict(SteerError::Full(run).to_string())),
            Err(SteerError::Db(e)) => return Err(e.into()),
            Err(e @ (SteerError::NotFound | SteerError::Ended(..))) => return Err(ApiError::internal(&e)),
        }
    }
    let submission = Submission {
        owner: owner(p),
        conversation_id: body.conversation_id,
        content: body.content,
        plugin: body.plugin,
        config: body.config,
        idempotency_key: idempotency_key(&headers),
        webhook: body.webhook,
        strategy: body.multitask_strategy,
        parent: None,
    };
    let submitted =
        submit::submit(&state.pool, &state.agents, &state.policy, &submission, state.local_worker()).await?;
    let mut headers = HeaderMap::new();
    if submitted.replayed() {
        headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Ok((StatusCode::ACCEPTED, headers, Json(submitted.enqueued().clone())).into_response())
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
    if let Some(Cancelled::Queued | Cancelled::Waiting | Cancelled::Flagged { .. }) = done {
        stop_children(state, &[run]).await;
    }
    // A cancel that changed something is audited; a repeat (of a flagged or
    // ended run) is not.
    if matches!(done, Some(Cancelled::Queued | Cancelled::Waiting | Cancelled::Flagged { first: true })) {
        audit::record(state, p, action::RUN_CANCELLED, run, json!({})).await;
    }
    Ok(done)
}

/// A stop reaches the stopped runs' child runs (sub-agents) and theirs,
/// once the stop committed; what a failure here leaves, the waiting runs'
/// scheduler stops on its next pass.
pub(super) async fn stop_children(state: &AppState, parents: &[RunId]) {
    match crate::db::children::stop(&state.pool, parents).await {
        Ok(stopped) if !stopped.is_empty() => tracing::info!(children = stopped.len(), "a stop reached child runs"),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "stopping child runs failed; the scheduler will"),
    }
}

/// `POST /v1/runs/{id}/fork`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRun {
    #[serde(default)]
    pub after_call: Option<i64>,
    #[serde(default)]
    pub after_tool_call: Option<i64>,
    #[serde(default)]
    pub tool_answer: Option<Value>,
    #[serde(default)]
    pub content: Option<String>,
}

/// `POST /v1/runs/{id}/fork`: a branch of a resumable run's turn in a new
/// conversation (`lifecycle::fork`), held to the tenant's quotas as an
/// enqueue is.
pub async fn fork_run(
    State(state): State<AppState>,
    Auth(p): Auth,
    id: PathId<RunId>,
    ApiJson(body): ApiJson<ForkRun>,
) -> Result<impl IntoResponse, ApiError> {
    let point = match (body.after_call, body.after_tool_call) {
        (Some(n), None) => i32::try_from(n).ok().filter(|n| *n >= 0).map(lifecycle::After::Call),
        (None, Some(k)) => i32::try_from(k).ok().filter(|k| *k >= 1).map(lifecycle::After::ToolCall),
        _ => return Err(ApiError::invalid("a fork names its point: after_call or after_tool_call, one of them")),
    };
    let point = point.ok_or_else(|| {
        ApiError::invalid(
            "after_call is a position of the call log (0 or more), after_tool_call a call_index (1 or more)",
        )
    })?;
    let tool_answer = body.tool_answer.map(|v| v.to_string());
    if let Some(answer) = &tool_answer {
        crate::text::refuse_text("tool_answer", answer).map_err(|e| ApiError::invalid(e.to_string()))?;
        if answer.len() > submit::CONFIG_BYTES_MAX * 4 {
            return Err(ApiError::invalid("tool_answer is at most 64 KiB of JSON"));
        }
    }
    if let Some(content) = &body.content {
        crate::text::refuse_text("content", content).map_err(|e| ApiError::invalid(e.to_string()))?;
        if content.trim().is_empty() || content.chars().count() > submit::CONTENT_CHARS_MAX {
            return Err(ApiError::invalid(format!("content is 1 to {} characters", submit::CONTENT_CHARS_MAX)));
        }
    }
    let at = lifecycle::ForkPoint { after: point, tool_answer, content: body.content };
    state.policy.quotas.enqueue_token(&p.tenant_id).await?;
    let max = state.policy.quotas.config.tenant_max_queued;
    match lifecycle::fork(&state.pool, id.0, &p.user_id, &at, max).await {
        Ok(enqueued) => {
            let detail = json!({ "new_run_id": enqueued.run_id, "after": format!("{point:?}") });
            audit::record(&state, &p, action::RUN_FORKED, id.0, detail).await;
            Ok((StatusCode::ACCEPTED, Json(enqueued)))
        }
        Err(ForkError::NotFound) => Err(ApiError::not_found(id)),
        Err(ForkError::Conflict(m)) => Err(ApiError::conflict(m)),
        Err(ForkError::Invalid(m)) => Err(ApiError::invalid(m)),
        Err(ForkError::QueueFull { max }) => Err(submit::queue_full(&state.policy.quotas, &p.tenant_id, max).into()),
        Err(ForkError::Db(e)) => Err(e.into()),
    }
}

/// `POST /v1/runs/{id}/steer`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SteerRun {
    pub content: String,
}

/// `POST /v1/runs/{id}/steer`: queues an instruction for the run's turn;
/// its guest takes it at its next host-call boundary (`take-instructions`).
/// 202 with the instruction; 409 once the run has ended, or past the most a
/// run takes.
pub async fn steer_run(
    State(state): State<AppState>,
    Auth(p): Auth,
    id: PathId<RunId>,
    ApiJson(body): ApiJson<SteerRun>,
) -> Result<impl IntoResponse, ApiError> {
    let content = body.content;
    submit::check_content(&content)?;
    match steer::queue(&state.pool, id.0, &p.user_id, &content).await {
        Ok(steer) => {
            audit::record(&state, &p, action::RUN_STEERED, id.0, json!({ "steer_id": steer.id })).await;
            Ok((StatusCode::ACCEPTED, Json(steer)))
        }
        Err(SteerError::NotFound) => Err(ApiError::not_found(id)),
        Err(e @ (SteerError::Ended(..) | SteerError::Full(_))) => Err(ApiError::conflict(e.to_string())),
        Err(SteerError::Db(e)) => Err(e.into()),
    }
}

/// `GET /v1/runs/{id}/steers`: the run's instructions, oldest first, with
/// when each was announced and taken (null while queued).
pub async fn list_steers(
    State(state): State<AppState>,
    Auth(p): Auth,
    id: PathId<RunId>,
) -> Result<impl IntoResponse, ApiError> {
    let steers = steer::list(&state.pool, id.0, &p.user_id).await?.or_not_found(id)?;
    Ok(Json(json!({ "steers": steers })))
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
