//! HTTP API (DESIGN.md section 5): axum routes, auth, the error type.

mod error;
mod events;
mod metrics;
mod plugins;
mod routes;
mod runs;

use axum::extract::{FromRef, FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::{Json, Router};
use serde_json::json;
use sqlx::PgPool;

pub use error::ApiError;
pub use routes::{openapi, Route, ROUTES};

use std::time::Duration;

use crate::agent::AgentRegistry;
use crate::db::tokens::{self, Principal};
use crate::hub::Hub;

/// Bytes of one request body.
pub const BODY_BYTES_MAX: usize = 1 << 20;

#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub agents: AgentRegistry,
    /// Wakes tails; `None`: tails poll at the keepalive interval.
    pub hub: Option<Hub>,
    /// SSE keepalive, which is also the tail's fallback poll.
    pub keepalive: Duration,
    /// The process's worker, for `/metrics` (`None`: queue gauges only).
    pub stats: Option<crate::worker::WorkerObserver>,
}

impl AppState {
    pub fn new(pool: PgPool, agents: AgentRegistry, hub: Option<Hub>) -> Self {
        AppState { pool, agents, hub, keepalive: events::KEEPALIVE_DEFAULT, stats: None }
    }

    /// Counts queued runs a cancel or stop ended here, for `/metrics`.
    fn record_ended(&self, n: usize) {
        if let Some(stats) = &self.stats {
            for _ in 0..n {
                stats.worker.record_end(crate::db::RunStatus::Cancelled, None);
            }
        }
    }
}

pub fn router(state: AppState) -> Router {
    routes::ROUTES
        .iter()
        .fold(Router::new(), |router, r| router.route(r.path, (r.handler)()))
        .fallback(|| async { ApiError::not_found("route") })
        .layer(axum::extract::DefaultBodyLimit::max(BODY_BYTES_MAX))
        .with_state(state)
}

async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    match crate::db::ready(&state.pool).await {
        Ok(true) => (StatusCode::OK, Json(json!({ "status": "ready" }))).into_response(),
        Ok(false) => ApiError::unavailable("migrations are not applied").into_response(),
        Err(_) => ApiError::unavailable("the database is unavailable").into_response(),
    }
}

/// The caller, from `Authorization: Bearer <token>`.
pub struct Auth(pub Principal);

impl<S> FromRequestParts<S> for Auth
where
    AppState: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let state = AppState::from_ref(state);
        let token = match parts.headers.get(axum::http::header::AUTHORIZATION) {
            Some(header) => header.to_str().ok().and_then(|h| h.strip_prefix("Bearer ")).map(str::trim),
            // A browser's EventSource cannot set headers: a run's stream
            // (only that route) also takes the token as `access_token`.
            None if parts.uri.path().ends_with("/events") => stream_token(parts.uri.query()),
            None => return Err(ApiError::unauthenticated("missing Authorization: Bearer <token>")),
        };
        let token = token
            .filter(|t| !t.is_empty() && t.len() <= 200)
            .ok_or_else(|| ApiError::unauthenticated("Authorization must be `Bearer <token>`"))?;
        match tokens::authenticate(&state.pool, token).await? {
            Some(p) => Ok(Auth(p)),
            None => Err(ApiError::unauthenticated("unknown token")),
        }
    }
}

/// The `access_token` query parameter (tokens are URL-safe: `ah_` and hex).
fn stream_token(query: Option<&str>) -> Option<&str> {
    query?.split('&').find_map(|pair| pair.strip_prefix("access_token="))
}

/// `Json` whose rejections use the API's error shape and statuses.
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    Json<T>: FromRequest<S, Rejection = axum::extract::rejection::JsonRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        Ok(ApiJson(Json::<T>::from_request(req, state).await?.0))
    }
}
