//! Runs as the protocols' tasks see them (`api::a2a`, `api::mcp`): one run
//! of one agent with its user message, its answer as the transcript keeps it
//! and the approval it waits for. Read by owner, as every run read is.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgExecutor;

use super::{ConversationId, RunId, RunStatus};

/// One run as a task.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct TaskRow {
    pub id: RunId,
    pub conversation_id: ConversationId,
    pub plugin: String,
    pub status: RunStatus,
    pub error: Option<String>,
    pub cancel_requested: bool,
    pub created_at: DateTime<Utc>,
    /// The last change: ended, started or created.
    pub updated_at: DateTime<Utc>,
    pub user_message_id: uuid::Uuid,
    pub input: String,
    /// The assistant's message, once the run has ended with one.
    pub answer_id: Option<uuid::Uuid>,
    pub answer: Option<String>,
    /// `{call_id, tool, args}` of the approval a waiting run asks for.
    pub pending_approval: Option<Value>,
}

const SELECT: &str = "
    SELECT r.id, r.conversation_id, r.plugin, r.status, r.error, r.cancel_requested, r.created_at,
           coalesce(r.finished_at, r.started_at, r.created_at) AS updated_at,
           r.user_message_id, u.content AS input, a.id AS answer_id, a.content AS answer,
           (SELECT jsonb_build_object('call_id', s.call_index, 'tool', s.tool, 'args', s.args)
            FROM run_suspension s
            WHERE s.run_id = r.id AND s.kind = 'approval' AND s.decision IS NULL AND r.status = 'waiting'
            LIMIT 1) AS pending_approval
    FROM agent_run r
    JOIN message u ON u.id = r.user_message_id
    LEFT JOIN LATERAL (
        SELECT m.id, m.content FROM message m
        WHERE m.conversation_id = r.conversation_id AND m.run_id = r.id AND m.role = 'assistant'
        ORDER BY m.created_at DESC LIMIT 1) a ON true";

/// The run `id` (of agent `plugin`, when given) as its owner sees it.
pub async fn get(
    db: impl PgExecutor<'_>,
    id: RunId,
    owner_id: &str,
    plugin: Option<&str>,
) -> Result<Option<TaskRow>, sqlx::Error> {
    sqlx::query_as(&format!("{SELECT} WHERE r.id = $1 AND r.owner_id = $2 AND ($3::text IS NULL OR r.plugin = $3)"))
        .bind(id)
        .bind(owner_id)
        .bind(plugin)
        .fetch_optional(db)
        .await
}

/// The owner's runs (of `plugin`, when given), newest first, before
/// `after`, in one conversation and one status when given, at most `limit`.
pub async fn list(
    db: impl PgExecutor<'_>,
    owner_id: &str,
    plugin: Option<&str>,
    conversation: Option<ConversationId>,
    statuses: Option<&[&str]>,
    after: Option<RunId>,
    limit: i64,
) -> Result<Vec<TaskRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "{SELECT} WHERE r.owner_id = $1 AND ($2::text IS NULL OR r.plugin = $2)
                    AND ($3::uuid IS NULL OR r.conversation_id = $3)
                    AND ($4::text[] IS NULL OR r.status = ANY($4)) AND ($5::uuid IS NULL OR r.id < $5)
         ORDER BY r.id DESC LIMIT $6"
    ))
    .bind(owner_id)
    .bind(plugin)
    .bind(conversation)
    .bind(statuses)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// How many runs [`list`] would page through.
pub async fn count(
    db: impl PgExecutor<'_>,
    owner_id: &str,
    plugin: &str,
    conversation: Option<ConversationId>,
    statuses: Option<&[&str]>,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM agent_run r WHERE r.owner_id = $1 AND r.plugin = $2
           AND ($3::uuid IS NULL OR r.conversation_id = $3) AND ($4::text[] IS NULL OR r.status = ANY($4))",
    )
    .bind(owner_id)
    .bind(plugin)
    .bind(conversation)
    .bind(statuses)
    .fetch_one(db)
    .await
}
