//! The tail: `GET /v1/runs/{id}/events`. A stream is a table with a cursor:
//! every frame carries its seq, a client that drops rejoins with `?from=N` or
//! `Last-Event-ID`, and any process serves any run's tail.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::db::journal::{self, Event};
use crate::db::runs;
use crate::db::RunId;

use super::{ApiError, AppState, Auth};

/// Events one read (and one JSON page) returns at most.
pub const PAGE_EVENTS_MAX: i64 = 500;
/// Frames buffered for a slow SSE client before the tail waits for it.
const FRAMES_QUEUE_MAX: usize = 64;
/// The default keepalive, which is also the tail's fallback poll.
pub const KEEPALIVE_DEFAULT: Duration = Duration::from_secs(15);

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
    Path(id): Path<String>,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let id: RunId = id.parse().map_err(|_| ApiError::bad_request(format!("run id {id:?} is not a UUID")))?;
    runs::get_run(&state.pool, id, &p.user_id).await?.ok_or_else(|| ApiError::not_found(format!("run {id}")))?;
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
        Ok(sse(state, id, from).await.into_response())
    } else {
        Ok(page(&state, id, from).await?.into_response())
    }
}

/// The run's `complete` frame made from its row, for a run that ended
/// without one in the journal (a finalizer died mid-way, or retention trimmed it).
async fn synthesized_complete(state: &AppState, id: RunId, after: i32) -> Result<Option<Value>, sqlx::Error> {
    let Some((status, error, last_seq)) = journal::terminal_state(&state.pool, id).await? else {
        return Ok(None);
    };
    let mut v =
        json!({ "type": "complete", "seq": last_seq.max(after) + 1, "status": status.as_str(), "synthesized": true });
    if let Some(e) = error {
        v["error"] = json!(e);
    }
    Ok(Some(v))
}

async fn page(state: &AppState, id: RunId, from: i32) -> Result<Json<Value>, ApiError> {
    let events = journal::events_after(&state.pool, id, from, PAGE_EVENTS_MAX).await?;
    let mut frames: Vec<Value> = events.iter().map(frame).collect();
    let mut terminal = events.iter().any(|e| e.kind == "complete");
    let mut next_from = events.last().map(|e| e.seq).unwrap_or(from);
    if !terminal && (events.len() as i64) < PAGE_EVENTS_MAX {
        if let Some(c) = synthesized_complete(state, id, next_from).await? {
            // Re-read: a complete may have landed between the two reads.
            let late = journal::events_after(&state.pool, id, next_from, PAGE_EVENTS_MAX).await?;
            if late.is_empty() {
                next_from = c["seq"].as_i64().unwrap_or_default() as i32;
                frames.push(c);
                terminal = true;
            } else {
                terminal = late.iter().any(|e| e.kind == "complete");
                next_from = late.last().map(|e| e.seq).unwrap_or(next_from);
                frames.extend(late.iter().map(frame));
            }
        }
    }
    Ok(Json(json!({ "events": frames, "next_from": next_from, "terminal": terminal })))
}

async fn sse(state: AppState, id: RunId, from: i32) -> Sse<impl futures::Stream<Item = Result<SseEvent, Infallible>>> {
    let (tx, rx) = mpsc::channel::<SseEvent>(FRAMES_QUEUE_MAX);
    let keepalive = state.keepalive;
    tokio::spawn(async move {
        if let Err(e) = tail(&state, id, from, &tx).await {
            tracing::warn!(run_id = %id, error = %e, "tail ended early; the client can rejoin from its last seq");
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (Ok(e), rx)) });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(keepalive))
}

fn sse_frame(v: &Value) -> SseEvent {
    SseEvent::default().id(v["seq"].to_string()).event(v["type"].as_str().unwrap_or("event")).data(v.to_string())
}

/// Replays everything after `from`, then follows the run live until its
/// `complete`. Subscribes before the first read, so no wake falls in the gap;
/// waits on the hub with the keepalive as the fallback poll.
async fn tail(state: &AppState, id: RunId, from: i32, tx: &mpsc::Sender<SseEvent>) -> Result<(), sqlx::Error> {
    let mut wakes = match &state.hub {
        Some(hub) => Some(hub.subscribe(&crate::db::notify::events_channel(id)).await),
        None => None,
    };
    let mut cursor = from;
    loop {
        if let Some(w) = wakes.as_mut() {
            w.drain();
        }
        let events = journal::events_after(&state.pool, id, cursor, PAGE_EVENTS_MAX).await?;
        for e in &events {
            cursor = e.seq;
            if tx.send(sse_frame(&frame(e))).await.is_err() {
                return Ok(()); // the client left; the run goes on
            }
            if e.kind == "complete" {
                return Ok(()); // the first ending wins
            }
        }
        if events.len() as i64 == PAGE_EVENTS_MAX {
            continue;
        }
        if events.is_empty() {
            if let Some(c) = synthesized_complete(state, id, cursor).await? {
                // Terminal: read once more, since the row and its complete
                // commit together; only a journal without it gets a synthetic one.
                if journal::events_after(&state.pool, id, cursor, 1).await?.is_empty() {
                    let _ = tx.send(sse_frame(&c)).await;
                    return Ok(());
                }
                continue;
            }
        }
        let wait = async {
            match wakes.as_mut() {
                Some(w) => {
                    let _ = tokio::time::timeout(state.keepalive, w.recv()).await;
                }
                None => tokio::time::sleep(state.keepalive).await,
            }
        };
        tokio::select! {
            _ = wait => {}
            _ = tx.closed() => return Ok(()),
        }
    }
}
