//! `GET /v1/runs/{id}/events`: the native API's two encoders over the
//! journal tail (`stream::tail`). A stream is a table with a cursor: every
//! frame carries its seq, a client that drops rejoins with `?from=N` or
//! `Last-Event-ID`, and any process serves any run's tail.
//!
//! - SSE (`Accept: text/event-stream`): one frame per event (`id: <seq>`,
//!   `event: <type>`, `data: <frame>`), a comment per keepalive, and the end
//!   of the body at the run's ending; nothing at all for a cursor at or past
//!   it. Live tails are bounded per process: past the bound, 503; and per
//!   user when the operator says so: past it, 429. An open stream re-checks
//!   its token every keepalive interval and ends once it is revoked or expired.
//! - JSON: one page `{events, next_from, terminal}`.

use std::convert::Infallible;

use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::db::events::COMPLETE;
use crate::db::journal::Event;
use crate::db::runs;
use crate::db::RunId;
use crate::stream::tail::{Item, TailStream, PAGE_BYTES_MAX, PAGE_EVENTS_MAX};

use super::live::TokenCheck;
use super::{ApiError, ApiQuery, AppState, Auth, OrNotFound, PathId};

#[derive(Debug, Deserialize)]
pub struct EventsQuery {
    from: Option<String>,
}

/// The wire form of an event: its payload with `seq` and `type` added.
fn frame(e: &Event) -> Value {
    let mut v = match &e.payload {
        Value::Object(m) => Value::Object(m.clone()),
        other => json!({ "payload": other }),
    };
    v["seq"] = json!(e.seq);
    v["type"] = json!(e.kind);
    v
}

fn parse_cursor(raw: &str, what: &str) -> Result<i32, ApiError> {
    raw.trim()
        .parse::<i32>()
        .ok()
        .filter(|n| *n >= 0)
        .ok_or_else(|| ApiError::bad_request(format!("{what} must be a non-negative integer, not {raw:?}")))
}

pub async fn events(
    State(state): State<AppState>,
    Auth(p): Auth,
    id: PathId<RunId>,
    ApiQuery(q): ApiQuery<EventsQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    runs::get_run(&state.pool, id.0, &p.user_id).await?.or_not_found(id)?;
    // A reconnecting EventSource repeats its URL and adds Last-Event-ID: the
    // header is the newer cursor.
    let from = match (headers.get("last-event-id"), &q.from) {
        (Some(h), _) => parse_cursor(h.to_str().unwrap_or("?"), "Last-Event-ID")?,
        (None, Some(f)) => parse_cursor(f, "from")?,
        (None, None) => 0,
    };
    let wants_sse =
        headers.get(header::ACCEPT).and_then(|a| a.to_str().ok()).is_some_and(|a| a.contains("text/event-stream"));
    if wants_sse {
        let check = TokenCheck::open(&state, &p)?;
        let tail = state.tails().follow(id.0, from)?;
        Ok(sse(id.0, tail, check).into_response())
    } else {
        Ok(page(state.tails().catch_up(id.0, from), from).await?.into_response())
    }
}

/// The JSON encoder: up to [`PAGE_EVENTS_MAX`] events after `from`, and
/// about [`PAGE_BYTES_MAX`] bytes of them (at least one event);
/// `next_from` is the last seq returned (or `from`), `terminal` whether the
/// run has ended for this reader (its ending is on this page, or was before it).
async fn page(mut tail: TailStream, from: i32) -> Result<Json<Value>, ApiError> {
    let (mut frames, mut next_from, mut terminal) = (Vec::new(), from, false);
    let mut bytes = 0;
    while frames.len() < PAGE_EVENTS_MAX as usize && bytes < PAGE_BYTES_MAX as usize {
        match tail.next().await.transpose()? {
            Some(Item::Event(e)) => {
                next_from = e.seq;
                terminal = e.kind == COMPLETE;
                bytes += crate::text::json_bytes(&e.payload);
                frames.push(frame(&e));
            }
            Some(Item::End(ending)) => {
                terminal = ending.is_terminal();
                break;
            }
            Some(Item::Keepalive) => {}
            None => break,
        }
    }
    Ok(Json(json!({ "events": frames, "next_from": next_from, "terminal": terminal })))
}

/// The SSE encoder: the body ends with the tail (or at its first error,
/// after which the client rejoins from its last seq, or once its token is
/// no longer valid).
fn sse(run: RunId, tail: TailStream, check: TokenCheck) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let frames = futures::stream::unfold((tail, check), move |(mut tail, mut check)| async move {
        let item = tail.next().await?;
        if !check.still_valid(matches!(item, Ok(Item::Keepalive)), &run.to_string()).await {
            return None;
        }
        let frame = match item {
            Ok(Item::Event(e)) => {
                // A field cannot hold a line break (a guest's kind could):
                // such a frame goes as the default type; its data names it.
                let kind = if e.kind.contains(['\n', '\r']) { "message" } else { e.kind.as_str() };
                SseEvent::default().id(e.seq.to_string()).event(kind).data(frame(&e).to_string())
            }
            Ok(Item::Keepalive) => SseEvent::default().comment("keepalive"),
            Ok(Item::End(_)) => return None,
            Err(e) => {
                tracing::warn!(run_id = %run, error = %e, "tail ended early; the client can rejoin from its last seq");
                return None;
            }
        };
        Some((Ok(frame), (tail, check)))
    });
    Sse::new(frames)
}
