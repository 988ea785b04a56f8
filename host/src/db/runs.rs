//! Run reads as clients see them (`GET /v1/runs/{id}`). Every status change
//! is in [`super::lifecycle`]; the journal's reads are in [`super::journal`].

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgExecutor;

use super::{ConversationId, RunId, RunStatus};

/// A run as clients see it (`GET /v1/runs/{id}`).
#[derive(Debug, Clone, Serialize, sqlx::FromRow, schemars::JsonSchema)]
pub struct RunView {
    pub id: RunId,
    pub conversation_id: ConversationId,
    pub status: RunStatus,
    pub plugin: String,
    pub plugin_digest: Option<String>,
    pub cancel_requested: bool,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub last_seq: i32,
    /// Which attempt of the run this is: 1, or more once a resumable run was
    /// resumed after losing its worker.
    pub attempt: i32,
    /// The tool call a waiting run asks a person to decide:
    /// `{call_id, tool, args, requested_at, expires_at}`, or null.
    pub pending_approval: Option<Value>,
    /// Its completion webhook: `{url, status: pending|delivered|failed,
    /// attempts, last_error, delivered_at}` once the run ended, `{url,
    /// status: "waiting"}` before; null without one.
    pub webhook: Option<Value>,
    /// Model calls and tokens, once the run has ended (null without a model call).
    pub usage: Option<Value>,
    /// The run this one is a fork of (`POST /v1/runs/{id}/fork`), and the
    /// call-log position up to which it replayed that run's calls; null
    /// for a run that is no fork.
    pub forked_from: Option<RunId>,
    pub fork_after: Option<i32>,
    /// The run whose agent started this one (a sub-agent), or null.
    pub parent_run_id: Option<RunId>,
    /// The child runs this run's agent started, in order:
    /// `[{run_id, plugin, status, conversation_id, call_index}]`.
    pub children: Value,
}

/// A run in a list (`GET /v1/runs`).
#[derive(Debug, Clone, Serialize, sqlx::FromRow, schemars::JsonSchema)]
pub struct RunSummary {
    pub id: RunId,
    pub conversation_id: ConversationId,
    pub status: RunStatus,
    pub plugin: String,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
}

/// The owner's runs, newest first (run ids are time-ordered), at most
/// `limit`, before the run `after` when given, in `status` when given. Read
/// backwards along the primary key: a page costs the runs created since its
/// last one, not every run.
pub async fn list(
    db: impl PgExecutor<'_>,
    owner_id: &str,
    status: Option<RunStatus>,
    after: Option<RunId>,
    limit: i64,
) -> Result<Vec<RunSummary>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, conversation_id, status, plugin, error, created_at, started_at, finished_at
         FROM agent_run
         WHERE owner_id = $1 AND ($2::text IS NULL OR status = $2) AND ($3::uuid IS NULL OR id < $3)
         ORDER BY id DESC LIMIT $4",
    )
    .bind(owner_id)
    .bind(status.map(|s| s.as_str()))
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// One run as its owner sees it; `None` when missing or someone else's.
pub async fn get_run(db: impl PgExecutor<'_>, id: RunId, owner_id: &str) -> Result<Option<RunView>, sqlx::Error> {
    sqlx::query_as(
        "SELECT r.id, r.conversation_id, r.status, r.plugin, r.plugin_digest, r.cancel_requested,
                r.error, r.created_at, r.started_at, r.finished_at, r.forked_from, r.fork_after,
                r.parent_run_id,
                coalesce((SELECT jsonb_agg(jsonb_build_object('run_id', c.id, 'plugin', c.plugin, 'status', c.status,
                                                              'conversation_id', c.conversation_id,
                                                              'call_index', c.parent_call) ORDER BY c.parent_call)
                          FROM agent_run c WHERE c.parent_run_id = r.id), '[]'::jsonb) AS children,
                coalesce((SELECT max(seq) FROM run_event e WHERE e.run_id = r.id), 0) AS last_seq,
                r.attempt,
                (SELECT jsonb_build_object('call_id', s.call_index, 'tool', s.tool, 'args', s.args,
                                           'requested_at', s.requested_at, 'expires_at', s.expires_at)
                 FROM run_suspension s
                 WHERE s.run_id = r.id AND s.kind = 'approval' AND s.decision IS NULL AND r.status = 'waiting'
                 LIMIT 1) AS pending_approval,
                CASE WHEN r.webhook IS NOT NULL THEN coalesce(
                    (SELECT jsonb_build_object('url', d.url, 'status', d.status, 'attempts', d.attempts,
                                               'last_error', d.last_error, 'delivered_at', d.delivered_at)
                     FROM webhook_delivery d WHERE d.run_id = r.id AND d.push_config IS NULL),
                    jsonb_build_object('url', r.webhook, 'status', 'waiting')) END AS webhook,
                r.usage
         FROM agent_run r WHERE r.id = $1 AND r.owner_id = $2",
    )
    .bind(id)
    .bind(owner_id)
    .fetch_optional(db)
    .await
}
