//! The Responses API (`/v1/responses`): a second view of the same runs and
//! journal. The handlers extract, call the Responses service
//! (`service::responses`, which calls the one enqueue service) or the view
//! over the journal tail (`stream::responses`), and encode; errors take the
//! specification's shape `{"error": {message, type, param, code}}`.
//!
//! - `POST /v1/responses`: `background: true` answers the `queued` object at
//!   once; `stream: true` streams its events; neither waits for the run's end
//!   and answers the final object (a dropped connection never stops the run).
//!   `Idempotency-Key` works as on the native enqueue.
//! - `GET /v1/responses/{id}` (`?stream=true&starting_after=N`: the events
//!   numbered after N, then live), `POST /v1/responses/{id}/cancel` (200 with
//!   the object, also for an ended response: never 409),
//!   `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`.
//!
//! SSE: one frame per event (`event: <type>`, one `data:` line), comments as
//! keepalives, `data: [DONE]` after the terminal event.

use std::convert::Infallible;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::db::responses::{self as rows, ResponseRow};
use crate::db::tokens::Principal;
use crate::service::responses::{self as service, CreateResponse, RequestError};
use crate::service::submit::SubmitError;
use crate::stream::responses::{self as view, parse_response_id, response_id, StreamItem};

use super::runs::{cancel as cancel_run, idempotency_key, owner};
use super::{ApiError, ApiJson, AppState, Auth, ErrorCode};

/// An error in the specification's shape: the API's error, and the request
/// field it is about.
#[derive(Debug)]
pub struct ResponsesError {
    error: ApiError,
    param: Option<&'static str>,
}

impl From<ApiError> for ResponsesError {
    fn from(error: ApiError) -> Self {
        // A body the JSON extractor could not take (a missing `model`, a
        // wrong type) is a bad request in this API.
        let error = match error.code {
            ErrorCode::Invalid => ApiError { code: ErrorCode::BadRequest, ..error },
            _ => error,
        };
        ResponsesError { error, param: None }
    }
}

impl From<RequestError> for ResponsesError {
    fn from(e: RequestError) -> Self {
        match e {
            RequestError::Invalid { message, param } => ResponsesError { error: ApiError::bad_request(message), param },
            RequestError::NotFound { message, param } => {
                ResponsesError { error: ApiError::new(ErrorCode::NotFound, message), param }
            }
            RequestError::Submit(e) => {
                let param = match &e {
                    SubmitError::EmptyContent | SubmitError::ContentTooLong(_) | SubmitError::Unstorable(_) => {
                        Some("input")
                    }
                    _ => None,
                };
                if let SubmitError::ConfigTooLarge(n) = e {
                    // The run's config is what this request asks the plugin for.
                    let message = format!(
                        "instructions, tools, input messages, metadata and config (the agent-host extension) come to \
                         {n} bytes of run config; the limit is {}",
                        crate::service::submit::CONFIG_BYTES_MAX
                    );
                    return ApiError { message, ..ApiError::from(e) }.into();
                }
                ResponsesError { param, ..ApiError::from(e).into() }
            }
            RequestError::Tail(e) => ApiError::from(e).into(),
        }
    }
}

impl From<sqlx::Error> for ResponsesError {
    fn from(e: sqlx::Error) -> Self {
        ApiError::from(e).into()
    }
}

impl IntoResponse for ResponsesError {
    fn into_response(self) -> Response {
        let status = self.error.status();
        let kind = if status.is_server_error() {
            "server_error"
        } else if status == StatusCode::UNAUTHORIZED {
            "authentication_error"
        } else {
            "invalid_request_error"
        };
        let body = json!({ "error": {
            "message": self.error.message, "type": kind, "param": self.param, "code": self.error.code.as_str(),
        } });
        let mut res = (status, Json(body)).into_response();
        if let Some(s) = self.error.retry_after_s {
            res.headers_mut().insert(axum::http::header::RETRY_AFTER, HeaderValue::from(s));
        }
        res
    }
}

type Result<T> = std::result::Result<T, ResponsesError>;

fn caller(auth: std::result::Result<Auth, ApiError>) -> Result<Principal> {
    Ok(auth?.0)
}

/// The response `{id}` names, as its owner sees it.
async fn find(state: &AppState, p: &Principal, id: &str) -> Result<ResponseRow> {
    let not_found = || ResponsesError { error: ApiError::not_found(format!("response {id:?}")), param: None };
    let run = parse_response_id(id).ok_or_else(not_found)?;
    rows::get(&state.pool, run, &p.user_id).await?.ok_or_else(not_found)
}

pub async fn create(
    State(state): State<AppState>,
    auth: std::result::Result<Auth, ApiError>,
    headers: HeaderMap,
    body: std::result::Result<ApiJson<Value>, ApiError>,
) -> Result<Response> {
    let p = caller(auth)?;
    let ApiJson(body) = body?;
    let req: CreateResponse = serde_json::from_value(body).map_err(|e| {
        let param = e.to_string().contains("`model`").then_some("model");
        ResponsesError { error: ApiError::bad_request(e.to_string()), param }
    })?;
    let key = idempotency_key(&headers);
    let tails = state.tails();
    let (stream, background) = (req.stream.unwrap_or(false), req.background.unwrap_or(false));
    // A stream or a wait takes its place under the bound of live tails
    // first: once the run is enqueued, nothing answers 5xx (the SDKs retry
    // a 5xx, and without an Idempotency-Key a retry is another run).
    // A stream also takes its user's place and re-checks its token (as
    // the native stream does).
    let place = if stream || !background { Some(tails.reserve().map_err(ApiError::from)?) } else { None };
    let check = if stream { Some(super::live::TokenCheck::open(&state, &p)?) } else { None };
    // A blocking request holds its user's and tenant's place while it waits,
    // as a stream does: a user cannot hold every wait of the process.
    let _waiting = match !stream && !background {
        true => Some(state.policy.quotas.stream(&p.tenant_id, &p.user_id).map_err(ApiError::from)?),
        false => None,
    };
    let local = state.local_worker();
    let created =
        service::create(&state.pool, &state.agents, &state.policy, local, &tails, &owner(&p), key, &req).await?;
    let mut res = match place {
        Some(place) if stream => {
            let check = check.expect("a stream's check is open");
            sse(view::follow_reserved(&tails, &state.pool, &created.row, None, place), check).into_response()
        }
        Some(place) => match view::settle(&tails, &state.pool, &created.row, place).await {
            Ok(done) => Json(done).into_response(),
            Err(e) => {
                // The run goes on: the client reads it by id.
                tracing::warn!(error = %e, run = %created.row.id, "waiting for a response failed; answering it as created");
                Json(view::as_created(&created.row)).into_response()
            }
        },
        None => Json(view::as_created(&created.row)).into_response(),
    };
    if created.replayed {
        res.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Ok(res)
}

#[derive(Debug, Deserialize)]
pub struct GetQuery {
    #[serde(default)]
    stream: Option<String>,
    #[serde(default)]
    starting_after: Option<String>,
}

pub async fn get(
    State(state): State<AppState>,
    auth: std::result::Result<Auth, ApiError>,
    Path(id): Path<String>,
    query: std::result::Result<super::ApiQuery<GetQuery>, ApiError>,
) -> Result<Response> {
    let p = caller(auth)?;
    let super::ApiQuery(q) = query?;
    let bad = |param: &'static str, message: String| ResponsesError {
        error: ApiError::bad_request(message),
        param: Some(param),
    };
    let stream = match q.stream.as_deref() {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => return Err(bad("stream", format!("stream must be true or false, not {other:?}"))),
    };
    let after = match q.starting_after.as_deref() {
        None => None,
        Some(raw) => Some(raw.trim().parse::<u64>().map_err(|_| {
            bad("starting_after", format!("starting_after must be a non-negative integer, not {raw:?}"))
        })?),
    };
    let row = find(&state, &p, &id).await?;
    let tails = state.tails();
    if stream {
        let check = super::live::TokenCheck::open(&state, &p)?;
        let events = view::follow(&tails, &state.pool, &row, after).map_err(ApiError::from)?;
        return Ok(sse(events, check).into_response());
    }
    Ok(Json(view::current(&tails, &state.pool, &row).await.map_err(ApiError::from)?).into_response())
}

/// Cancels a response and answers its object: for a running one its status
/// moves to `cancelled` once the worker has stopped; an ended one is
/// answered as it is (never 409, which the SDKs retry).
pub async fn cancel(
    State(state): State<AppState>,
    auth: std::result::Result<Auth, ApiError>,
    Path(id): Path<String>,
) -> Result<Response> {
    let p = caller(auth)?;
    let row = find(&state, &p, &id).await?;
    cancel_run(&state, &p, row.id).await?;
    let row = find(&state, &p, &id).await?;
    Ok(Json(view::current(&state.tails(), &state.pool, &row).await.map_err(ApiError::from)?).into_response())
}

/// Deletes a response: a running one is cancelled first; later reads do not
/// find it. The run's transcript stays, so its conversation goes on.
pub async fn delete(
    State(state): State<AppState>,
    auth: std::result::Result<Auth, ApiError>,
    Path(id): Path<String>,
) -> Result<Response> {
    let p = caller(auth)?;
    let row = find(&state, &p, &id).await?;
    if !row.status.is_terminal() {
        cancel_run(&state, &p, row.id).await?;
    }
    rows::mark_deleted(&state.pool, row.id).await?;
    Ok(Json(json!({ "id": response_id(row.id), "object": "response", "deleted": true })).into_response())
}

pub async fn input_items(
    State(state): State<AppState>,
    auth: std::result::Result<Auth, ApiError>,
    Path(id): Path<String>,
) -> Result<Response> {
    let p = caller(auth)?;
    let row = find(&state, &p, &id).await?;
    let items = service::input_items(&row);
    let first = items.first().map(|i| i["id"].clone()).unwrap_or(Value::Null);
    let last = items.last().map(|i| i["id"].clone()).unwrap_or(Value::Null);
    Ok(Json(json!({ "object": "list", "data": items, "first_id": first, "last_id": last, "has_more": false }))
        .into_response())
}

/// `POST /v1/responses/compact`: not served (the body is read, so the
/// connection stays usable): 404 in this API's error shape.
pub async fn compact(auth: std::result::Result<Auth, ApiError>, _body: axum::body::Bytes) -> Result<Response> {
    caller(auth)?;
    Err(ResponsesError {
        error: ApiError::new(ErrorCode::NotFound, "compaction (POST /v1/responses/compact) is not supported"),
        param: None,
    })
}

/// The SSE encoder: each event in one frame, keepalives as comments, then
/// `data: [DONE]`. A tail error ends the body without `[DONE]`: the client
/// resumes with `starting_after` its last `sequence_number`. Ends (without
/// `[DONE]`) once the caller's token is revoked or expired.
fn sse(
    events: impl Stream<Item = std::result::Result<StreamItem, crate::stream::tail::TailError>> + Send + 'static,
    check: super::live::TokenCheck,
) -> Sse<impl Stream<Item = std::result::Result<SseEvent, Infallible>>> {
    let state = (Box::pin(events), check, false);
    let frames = futures::stream::unfold(state, |(mut events, mut check, ended)| async move {
        if ended {
            return None;
        }
        let item = events.next().await;
        if !check.still_valid(matches!(item, Some(Ok(StreamItem::Keepalive))), "response").await {
            return None;
        }
        let frame = match item {
            Some(Ok(StreamItem::Event(e))) => {
                let kind = e["type"].as_str().unwrap_or("message").to_string();
                SseEvent::default().event(kind).data(e.to_string())
            }
            Some(Ok(StreamItem::Keepalive)) => SseEvent::default().comment("keepalive"),
            None => return Some((Ok(SseEvent::default().data("[DONE]")), (events, check, true))),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "response stream ended early; the client resumes with starting_after");
                return None;
            }
        };
        Some((Ok(frame), (events, check, false)))
    });
    Sse::new(frames)
}
