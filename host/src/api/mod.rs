//! The native HTTP API (DESIGN.md section 5): the state handlers share, the
//! router built from the one route table (`routes`, and the MCP server's
//! one JSON-RPC path beside it: `mcp`), and the handlers. The
//! handlers hold no run logic: they extract (`extract`), call a service
//! (`service::submit`, `service::plugins`, `stream::tail`) or a `db` read,
//! and encode; errors are one type with one enum of codes (`error`).

mod a2a;
mod approvals;
mod audit;
mod conversations;
mod error;
mod events;
mod extract;
mod jsonrpc;
mod live;
mod mcp;
mod metrics;
mod paging;
mod plugins;
mod responses;
mod routes;
mod runs;
mod schedules;
mod tokens;
mod tools;
mod usage;
mod webhooks;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::{Json, Router};
use serde_json::json;
use sqlx::PgPool;

pub use error::{ApiError, ErrorCode};
pub use extract::{Admin, ApiJson, ApiQuery, Auth, OrNotFound, PathId, Resource};
pub use paging::LIMIT_MAX;
pub use routes::{openapi, Route, ROUTES};

use crate::agent::AgentRegistry;
use crate::hub::Hub;
use crate::stream::tail::{LiveTails, TailConfig, Tails, KEEPALIVE_DEFAULT, LIVE_TAILS_MAX_DEFAULT};

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
    /// How long a live tail whose client stops reading (while events wait
    /// for it) is kept before it is cut; the client rejoins from its last
    /// SSE id (`stream::feed`).
    pub sse_stall: Duration,
    /// The process's live SSE tails and their bound (`--sse-tails-max`).
    pub live_tails: Arc<LiveTails>,
    /// The process's worker, for `/metrics` (`None`: queue gauges only).
    pub stats: Option<crate::worker::WorkerObserver>,
    /// The operator's rules for submissions (allowed webhook URLs).
    pub policy: Arc<crate::service::submit::Policy>,
}

impl AppState {
    pub fn new(pool: PgPool, agents: AgentRegistry, hub: Option<Hub>) -> Self {
        AppState {
            pool,
            agents,
            hub,
            keepalive: KEEPALIVE_DEFAULT,
            sse_stall: crate::stream::feed::STALL_DEFAULT,
            live_tails: LiveTails::new(LIVE_TAILS_MAX_DEFAULT),
            stats: None,
            policy: Arc::default(),
        }
    }

    /// This process's worker, for runs that start in their enqueue.
    pub fn local_worker(&self) -> Option<&dyn crate::service::submit::LocalWorker> {
        self.stats.as_ref().map(|w| w as &dyn crate::service::submit::LocalWorker)
    }

    /// Bounds this process's live SSE tails at `max`.
    pub fn with_sse_tails_max(mut self, max: usize) -> Self {
        self.live_tails = LiveTails::new(max);
        self
    }

    /// The journal tail service, as this state configures it.
    fn tails(&self) -> Tails {
        let config = TailConfig { keepalive: self.keepalive, stall: self.sse_stall, ..TailConfig::default() };
        Tails::new(self.pool.clone(), self.hub.clone(), config, self.live_tails.clone())
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

/// Where the MCP server answers.
pub const MCP_PATH: &str = "/mcp";

pub fn router(state: AppState) -> Router {
    routes::ROUTES
        .iter()
        .fold(Router::new(), |router, r| router.route(r.path, (r.handler)()))
        // The MCP server: JSON-RPC over one path, kept out of the OpenAPI
        // document (its methods are MCP's, not HTTP operations).
        .route(MCP_PATH, axum::routing::post(mcp::post).get(mcp::not_served).delete(mcp::not_served))
        .fallback(|| async { ApiError::not_found("route") })
        // A known path with another method: the JSON error shape too.
        .method_not_allowed_fallback(|method: axum::http::Method, uri: axum::http::Uri| async move {
            ApiError::new(ErrorCode::MethodNotAllowed, format!("{method} is not served on {}", uri.path()))
        })
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
