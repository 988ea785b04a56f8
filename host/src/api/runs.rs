//! Enqueue and read runs.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::db::conversations;
use crate::db::enqueue::{self, EnqueueError, NewRun, Owner};
use crate::db::lifecycle::{self, Cancelled, RetryError};
use crate::db::runs;
use crate::db::{ConversationId, RunId, RunStatus};

use super::{ApiError, ApiJson, AppState, Auth};

/// Characters of a user message.
pub const CONTENT_CHARS_MAX: usize = 64 * 1024;
/// Bytes of a run's config JSON.
pub const CONFIG_BYTES_MAX: usize = 16 * 1024;
/// Bytes of an idempotency key.
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 200;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateRun {
    pub content: String,
    pub plugin: String,
    #[serde(default)]
    pub conversation_id: Option<ConversationId>,
    #[serde(default)]
    pub config: Option<Value>,
}

fn owner(p: &crate::db::tokens::Principal) -> Owner {
    Owner { user_id: p.user_id.clone(), tenant_id: p.tenant_id.clone() }
}

fn parse_id<T: std::str::FromStr>(raw: &str, what: &str) -> Result<T, ApiError> {
    raw.parse().map_err(|_| ApiError::bad_request(format!("{what} id {raw:?} is not a UUID")))
}

pub async fn create_conversation(State(state): State<AppState>, Auth(p): Auth) -> Result<impl IntoResponse, ApiError> {
    let (id, created_at) = enqueue::create_conversation(&state.pool, &owner(&p)).await?;
    Ok((StatusCode::CREATED, Json(json!({ "id": id, "created_at": created_at }))))
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
    Path(id): Path<String>,
    headers: HeaderMap,
    ApiJson(mut body): ApiJson<CreateRun>,
) -> Result<impl IntoResponse, ApiError> {
    let id: ConversationId = parse_id(&id, "conversation")?;
    if body.conversation_id.is_some_and(|c| c != id) {
        return Err(ApiError::invalid("conversation_id in the body differs from the one in the path"));
    }
    body.conversation_id = Some(id);
    enqueue(&state, &p, &headers, body).await
}

async fn enqueue(
    state: &AppState,
    p: &crate::db::tokens::Principal,
    headers: &HeaderMap,
    body: CreateRun,
) -> Result<impl IntoResponse, ApiError> {
    if body.content.trim().is_empty() {
        return Err(ApiError::invalid("content must not be empty"));
    }
    let chars = body.content.chars().count();
    if chars > CONTENT_CHARS_MAX {
        return Err(ApiError::invalid(format!("content has {chars} characters; the limit is {CONTENT_CHARS_MAX}")));
    }
    // A registered plugin, pinned now to the digest (and manifest) its name
    // points at, so re-pointing the name later changes nothing for this run;
    // else a built-in agent of that name.
    let registered = match state.agents.sandbox() {
        Some(_) => crate::db::plugins::get(&state.pool, &body.plugin).await?,
        None => None,
    };
    if registered.is_none() && !state.agents.contains(&body.plugin) {
        let mut names = state.agents.names();
        names.extend(crate::db::plugins::list(&state.pool).await?.into_iter().map(|p| p.name));
        names.sort();
        names.dedup();
        return Err(ApiError::invalid(format!("unknown plugin {:?}; available: {}", body.plugin, names.join(", "))));
    }
    let config = body.config.unwrap_or_else(|| json!({}));
    if !config.is_object() {
        return Err(ApiError::invalid("config must be a JSON object"));
    }
    let config_bytes = config.to_string().len();
    if config_bytes > CONFIG_BYTES_MAX {
        return Err(ApiError::invalid(format!("config is {config_bytes} bytes; the limit is {CONFIG_BYTES_MAX}")));
    }
    let idempotency_key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(v.to_str().ok().filter(|k| !k.is_empty() && k.len() <= IDEMPOTENCY_KEY_BYTES_MAX).ok_or_else(
            || {
                ApiError::bad_request(format!(
                    "Idempotency-Key must be 1-{IDEMPOTENCY_KEY_BYTES_MAX} visible ASCII bytes"
                ))
            },
        )?),
    };
    let request = json!({ "content": body.content, "plugin": body.plugin, "conversation_id": body.conversation_id, "config": config });
    let owner = owner(p);
    let new = NewRun {
        owner: &owner,
        conversation_id: body.conversation_id,
        content: &body.content,
        plugin: &body.plugin,
        plugin_digest: registered.as_ref().map(|p| p.digest.as_str()),
        plugin_manifest: registered.as_ref().map(|p| &p.manifest),
        config: &config,
        request: &request,
        idempotency_key,
    };
    let enqueued = match enqueue::enqueue(&state.pool, &new).await {
        Ok(e) => e,
        // The key was used before (or by a concurrent retry that won): answer
        // like the first request if this is the same request, else refuse.
        Err(e) if enqueue::is_idempotency_conflict(&e) => {
            let key = idempotency_key.unwrap_or_default();
            let Some((first, first_request)) = enqueue::find_by_idempotency_key(&state.pool, &owner.user_id, key).await?
            else {
                return Err(ApiError::new(StatusCode::CONFLICT, "conflict", "idempotency key in use; retry"));
            };
            if first_request.is_some_and(|r| r != request) {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "idempotency_key_reused",
                    format!("Idempotency-Key {key:?} was used for a different request (run {})", first.run_id),
                ));
            }
            let mut headers = HeaderMap::new();
            headers.insert("idempotent-replayed", axum::http::HeaderValue::from_static("true"));
            return Ok((StatusCode::ACCEPTED, headers, Json(first)));
        }
        Err(EnqueueError::ConversationNotFound(id)) => return Err(ApiError::not_found(format!("conversation {id}"))),
        Err(EnqueueError::Db(e)) => return Err(e.into()),
    };
    Ok((StatusCode::ACCEPTED, HeaderMap::new(), Json(enqueued)))
}

pub async fn get_run(
    State(state): State<AppState>,
    Auth(p): Auth,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let id: RunId = parse_id(&id, "run")?;
    let run =
        runs::get_run(&state.pool, id, &p.user_id).await?.ok_or_else(|| ApiError::not_found(format!("run {id}")))?;
    Ok(Json(run))
}

/// `POST /v1/runs/{id}/cancel`: a durable stop request. 202 while the run
/// winds down (or once a queued run is cancelled outright); 200 with the
/// status, changing nothing, when the run had already ended.
pub async fn cancel_run(
    State(state): State<AppState>,
    Auth(p): Auth,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let id: RunId = parse_id(&id, "run")?;
    let done =
        lifecycle::cancel(&state.pool, id, &p.user_id).await?.ok_or_else(|| ApiError::not_found(format!("run {id}")))?;
    let (code, status, cancel_requested) = match done {
        Cancelled::Queued => {
            state.record_ended(1);
            (StatusCode::ACCEPTED, RunStatus::Cancelled, true)
        }
        Cancelled::Flagged => (StatusCode::ACCEPTED, RunStatus::Running, true),
        Cancelled::Terminal(s, flagged) => (StatusCode::OK, s, flagged),
    };
    Ok((code, Json(json!({ "id": id, "status": status.as_str(), "cancel_requested": cancel_requested }))))
}

/// `POST /v1/conversations/{id}/stop`: one transaction over every queued and
/// running turn (see `db::lifecycle::stop_conversation`).
pub async fn stop_conversation(
    State(state): State<AppState>,
    Auth(p): Auth,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let id: ConversationId = parse_id(&id, "conversation")?;
    let stopped = lifecycle::stop_conversation(&state.pool, id, &p.user_id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("conversation {id}")))?;
    state.record_ended(stopped.cancelled.len());
    Ok(Json(stopped))
}

/// `POST /v1/runs/{id}/retry`: a new run for the same user message, asked for
/// on purpose; only for a failed or cancelled run that is the latest turn.
pub async fn retry_run(
    State(state): State<AppState>,
    Auth(p): Auth,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let id: RunId = parse_id(&id, "run")?;
    match lifecycle::retry(&state.pool, id, &p.user_id).await {
        Ok(enqueued) => Ok((StatusCode::ACCEPTED, Json(enqueued))),
        Err(RetryError::NotFound) => Err(ApiError::not_found(format!("run {id}"))),
        Err(RetryError::Conflict(m)) => Err(ApiError::new(StatusCode::CONFLICT, "conflict", m)),
        Err(RetryError::Db(e)) => Err(e.into()),
    }
}

pub async fn list_conversations(State(state): State<AppState>, Auth(p): Auth) -> Result<impl IntoResponse, ApiError> {
    Ok(Json(json!({ "conversations": conversations::list(&state.pool, &p.user_id).await? })))
}

pub async fn get_conversation(
    State(state): State<AppState>,
    Auth(p): Auth,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let id: ConversationId = parse_id(&id, "conversation")?;
    let view = conversations::get(&state.pool, id, &p.user_id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("conversation {id}")))?;
    Ok(Json(view))
}

pub async fn conversation_messages(
    State(state): State<AppState>,
    Auth(p): Auth,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let id: ConversationId = parse_id(&id, "conversation")?;
    let messages = conversations::messages(&state.pool, id, &p.user_id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("conversation {id}")))?;
    Ok(Json(json!({ "messages": messages })))
}
