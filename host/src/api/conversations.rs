//! Conversations: create, list (paged), read, the transcript (paged), stop.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::json;

use crate::db::conversations::{self, CONVERSATIONS_PAGE_MAX, MESSAGES_PAGE_MAX};
use crate::db::lifecycle;
use crate::db::{ConversationId, MessageId};

use super::paging::PageQuery;
use super::runs::owner;
use super::{ApiError, ApiQuery, AppState, Auth, OrNotFound, PathId};

pub async fn create_conversation(State(state): State<AppState>, Auth(p): Auth) -> Result<impl IntoResponse, ApiError> {
    let (id, created_at) = crate::db::enqueue::create_conversation(&state.pool, &owner(&p)).await?;
    Ok((StatusCode::CREATED, Json(json!({ "id": id, "created_at": created_at }))))
}

/// `GET /v1/conversations?limit&after`: newest first; the cursor is the
/// last conversation's id.
pub async fn list_conversations(
    State(state): State<AppState>,
    Auth(p): Auth,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let page = q.page(CONVERSATIONS_PAGE_MAX as usize)?;
    let after = page.after_as::<ConversationId>()?;
    let mut rows = conversations::list(&state.pool, &p.user_id, after, page.fetch()).await?;
    let next_cursor = page.finish(&mut rows, |c| c.id.to_string());
    Ok(Json(json!({ "conversations": rows, "next_cursor": next_cursor })))
}

pub async fn get_conversation(
    State(state): State<AppState>,
    Auth(p): Auth,
    id: PathId<ConversationId>,
) -> Result<impl IntoResponse, ApiError> {
    Ok(Json(conversations::get(&state.pool, id.0, &p.user_id).await?.or_not_found(id)?))
}

/// `GET /v1/conversations/{id}/messages?limit&after`: the transcript in turn
/// order; the cursor is the last message's id.
pub async fn conversation_messages(
    State(state): State<AppState>,
    Auth(p): Auth,
    id: PathId<ConversationId>,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let page = q.page(MESSAGES_PAGE_MAX as usize)?;
    let after = page.after_as::<MessageId>()?;
    let mut rows =
        conversations::messages(&state.pool, id.0, &p.user_id, after, page.fetch()).await?.or_not_found(id)?;
    let next_cursor = page.finish(&mut rows, |m| m.id.to_string());
    Ok(Json(json!({ "messages": rows, "next_cursor": next_cursor })))
}

/// `POST /v1/conversations/{id}/stop`: one transaction over every queued and
/// running turn (see `db::lifecycle::stop_conversation`).
pub async fn stop_conversation(
    State(state): State<AppState>,
    Auth(p): Auth,
    id: PathId<ConversationId>,
) -> Result<impl IntoResponse, ApiError> {
    let stopped = lifecycle::stop_conversation(&state.pool, id.0, &p.user_id).await?.or_not_found(id)?;
    state.record_ended(stopped.cancelled.len());
    let parents: Vec<_> = stopped.cancelled.iter().chain(&stopped.cancelling).copied().collect();
    super::runs::stop_children(&state, &parents).await;
    let detail = json!({ "cancelled": stopped.cancelled, "cancelling": stopped.cancelling });
    super::audit::record(&state, &p, crate::db::audit::action::CONVERSATION_STOPPED, id.0, detail).await;
    Ok(Json(stopped))
}
