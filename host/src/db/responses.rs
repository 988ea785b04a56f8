//! The Responses API's reads of a run (a response is a run) and its one
//! write, the deletion mark (`response_deleted`). Status changes stay in
//! [`super::lifecycle`]; events are read through the journal tail.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgExecutor;

use super::{ConversationId, RunId, RunStatus};

/// What a response object is built from, besides the journal.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ResponseRow {
    pub id: RunId,
    pub conversation_id: ConversationId,
    pub status: RunStatus,
    pub plugin: String,
    pub cancel_requested: bool,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// The run's config, which holds the Responses request (`responses`).
    pub config: Value,
    /// `{model_calls, prompt_tokens, completion_tokens}` once ended, or null.
    pub usage: Option<Value>,
    /// The user message this turn answers (the transcript's text of the input).
    pub content: String,
}

/// One response as its owner sees it; `None` when missing, someone else's,
/// or deleted.
pub async fn get(db: impl PgExecutor<'_>, id: RunId, owner_id: &str) -> Result<Option<ResponseRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT r.id, r.conversation_id, r.status, r.plugin, r.cancel_requested, r.error, r.created_at,
                r.finished_at, r.config, r.usage, m.content
         FROM agent_run r JOIN message m ON m.id = r.user_message_id
         WHERE r.id = $1 AND r.owner_id = $2
           AND NOT EXISTS (SELECT 1 FROM response_deleted d WHERE d.run_id = r.id)",
    )
    .bind(id)
    .bind(owner_id)
    .fetch_optional(db)
    .await
}

/// Whether no turn of its conversation was enqueued after this run (a
/// conversation continues at its end: it does not branch).
pub async fn is_latest_turn(db: impl PgExecutor<'_>, id: RunId) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT NOT EXISTS (SELECT 1 FROM agent_run l, agent_run r
                            WHERE r.id = $1 AND l.conversation_id = r.conversation_id
                              AND l.created_at > r.created_at)",
    )
    .bind(id)
    .fetch_one(db)
    .await
}

/// Marks a response deleted (idempotent); later reads do not find it.
pub async fn mark_deleted(db: impl PgExecutor<'_>, id: RunId) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO response_deleted (run_id) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(id)
        .execute(db)
        .await?;
    Ok(())
}

/// What a response's final snapshot shows besides its journal: the run's
/// usage, when it finished and the assistant's answer as the transcript
/// keeps it; `None` while the run has not ended. Read without an owner: the
/// stream that asks has already been authorised.
pub async fn ending(db: impl PgExecutor<'_>, id: RunId) -> Result<Option<RunEnding>, sqlx::Error> {
    sqlx::query_as(
        "SELECT r.usage, r.finished_at,
                (SELECT m.content FROM message m WHERE m.run_id = r.id AND m.role = 'assistant' LIMIT 1) AS answer
         FROM agent_run r WHERE r.id = $1 AND r.finished_at IS NOT NULL",
    )
    .bind(id)
    .fetch_optional(db)
    .await
}

/// See [`ending`].
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct RunEnding {
    pub usage: Option<Value>,
    pub finished_at: DateTime<Utc>,
    pub answer: Option<String>,
}
