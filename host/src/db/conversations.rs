//! Conversations: who owns one (the one ownership check), the transcript's
//! order (one CTE for every reader), the history an agent is shown, and the
//! reads behind `GET /v1/conversations...`. Called by the HTTP API, by
//! enqueue and the stop sweep (ownership) and by the run task (history).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgExecutor, PgPool};

use super::{ConversationId, MessageId, MessageStatus, RunId, RunStatus};

/// Whether conversation `id` exists and belongs to `owner_id`. Another
/// user's conversation is indistinguishable from a missing one.
pub async fn owned(db: impl PgExecutor<'_>, id: ConversationId, owner_id: &str) -> Result<bool, sqlx::Error> {
    let found: Option<i32> = sqlx::query_scalar("SELECT 1 FROM conversation WHERE id = $1 AND owner_id = $2")
        .bind(id)
        .bind(owner_id)
        .fetch_optional(db)
        .await?;
    Ok(found.is_some())
}

/// A conversation's messages in transcript order, as a CTE named `t` over
/// `$1` (the conversation): by turn (the user message's creation), the user
/// message first, then its answers. Creation order alone would put a turn
/// posted while the previous one ran before that one's answer.
pub(crate) const TRANSCRIPT_CTE: &str = "WITH t AS (
    SELECT m.id, m.role, m.content, m.status, m.run_id, m.created_at,
           u.created_at AS turn_at, u.id AS turn_id, m.role = 'assistant' AS answer
    FROM message m
    LEFT JOIN agent_run r ON m.role = 'assistant' AND r.id = m.run_id
    JOIN message u ON u.id = coalesce(r.user_message_id, m.id)
    WHERE m.conversation_id = $1)";

/// The turns of the conversation before `before` (the run's user message),
/// oldest first: the most recent `limit` complete or partial messages (the
/// only ones an agent is shown, see [`MessageStatus`]).
pub async fn history(
    db: impl PgExecutor<'_>,
    conversation: ConversationId,
    before: MessageId,
    limit: i64,
) -> Result<Vec<(String, String)>, sqlx::Error> {
    sqlx::query_as(&format!(
        "{TRANSCRIPT_CTE}
         SELECT role, content FROM (
             SELECT * FROM t
             WHERE status IN ('complete', 'partial')
               AND (turn_at, turn_id) < (SELECT created_at, id FROM message WHERE id = $2)
             ORDER BY turn_at DESC, turn_id DESC, answer DESC, created_at DESC LIMIT $3) h
         ORDER BY turn_at, turn_id, answer, created_at"
    ))
    .bind(conversation)
    .bind(before)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Messages one transcript read returns at most.
pub const MESSAGES_PAGE_MAX: i64 = 1000;

#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct ConversationView {
    pub id: ConversationId,
    pub created_at: DateTime<Utc>,
    pub active_run_id: Option<RunId>,
    pub queued_run_ids: Vec<RunId>,
    /// The model usage of its ended turns, summed.
    pub usage: ConversationUsage,
}

/// A conversation's model usage: its ended turns' usage (`usage` on each
/// run), summed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct ConversationUsage {
    pub model_calls: i64,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    /// Of the prompt tokens, those the providers read from their caches.
    pub cached_tokens: i64,
    /// USD by the tools file's price table.
    pub cost_usd: f64,
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow, schemars::JsonSchema)]
pub struct MessageView {
    pub id: MessageId,
    pub role: String,
    pub content: String,
    pub status: MessageStatus,
    pub run_id: Option<RunId>,
    pub created_at: DateTime<Utc>,
}

/// One conversation of `owner_id`; `None` when missing or someone else's.
pub async fn get(
    db: impl PgExecutor<'_>,
    id: ConversationId,
    owner_id: &str,
) -> Result<Option<ConversationView>, sqlx::Error> {
    let row: Option<(DateTime<Utc>, Option<RunId>, Vec<uuid::Uuid>, serde_json::Value)> = sqlx::query_as(
        "SELECT c.created_at,
                (SELECT r.id FROM agent_run r WHERE r.conversation_id = c.id AND r.status IN ('running', 'waiting')),
                coalesce((SELECT array_agg(r.id ORDER BY r.queue_pos) FROM agent_run r
                          WHERE r.conversation_id = c.id AND r.status = 'queued'), '{}'),
                (SELECT jsonb_build_object(
                    'model_calls', coalesce(sum((r.usage ->> 'model_calls')::bigint), 0),
                    'prompt_tokens', coalesce(sum((r.usage ->> 'prompt_tokens')::bigint), 0),
                    'completion_tokens', coalesce(sum((r.usage ->> 'completion_tokens')::bigint), 0),
                    'cached_tokens', coalesce(sum((r.usage ->> 'cached_tokens')::bigint), 0),
                    'cost_usd', coalesce(sum((r.usage ->> 'cost_usd')::float8), 0))
                 FROM agent_run r WHERE r.conversation_id = c.id AND r.usage IS NOT NULL)
         FROM conversation c WHERE c.id = $1 AND c.owner_id = $2",
    )
    .bind(id)
    .bind(owner_id)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|(created_at, active_run_id, queued, usage)| ConversationView {
        id,
        created_at,
        active_run_id,
        queued_run_ids: queued.into_iter().map(RunId).collect(),
        usage: serde_json::from_value(usage).unwrap_or_default(),
    }))
}

/// A conversation in a list: its latest turn's opening words and state.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, schemars::JsonSchema)]
pub struct ConversationSummary {
    pub id: ConversationId,
    pub created_at: DateTime<Utc>,
    /// The first 80 characters of the latest user message.
    pub title: Option<String>,
    pub latest_run_id: Option<RunId>,
    pub latest_status: Option<RunStatus>,
}

/// Conversations one list answers at most.
pub const CONVERSATIONS_PAGE_MAX: i64 = 100;

/// The owner's conversations, newest first (ties in time by id), at most
/// `limit`, after the conversation `after` when given: keyset paging, so a
/// conversation created meanwhile neither shifts nor repeats a page. An
/// `after` that is not the owner's answers no rows.
pub async fn list(
    db: impl PgExecutor<'_>,
    owner_id: &str,
    after: Option<ConversationId>,
    limit: i64,
) -> Result<Vec<ConversationSummary>, sqlx::Error> {
    sqlx::query_as(
        "SELECT c.id, c.created_at, left(m.content, 80) AS title, r.id AS latest_run_id, r.status AS latest_status
         FROM conversation c
         LEFT JOIN LATERAL (SELECT id, status, user_message_id FROM agent_run
                            WHERE conversation_id = c.id ORDER BY queue_pos DESC LIMIT 1) r ON true
         LEFT JOIN message m ON m.id = r.user_message_id
         WHERE c.owner_id = $1
           AND ($3::uuid IS NULL
                OR (c.created_at, c.id) < (SELECT a.created_at, a.id FROM conversation a
                                           WHERE a.id = $3 AND a.owner_id = $1))
         ORDER BY c.created_at DESC, c.id DESC LIMIT $2",
    )
    .bind(owner_id)
    .bind(limit)
    .bind(after)
    .fetch_all(db)
    .await
}

/// The transcript in turn order (ties by id), at most `limit` messages,
/// after the message `after` when given (keyset paging); `None` when the
/// conversation is missing or someone else's. An `after` that is not a
/// message of this conversation answers no rows.
pub async fn messages(
    pool: &PgPool,
    id: ConversationId,
    owner_id: &str,
    after: Option<MessageId>,
    limit: i64,
) -> Result<Option<Vec<MessageView>>, sqlx::Error> {
    let owned: Option<i32> = sqlx::query_scalar("SELECT 1 FROM conversation WHERE id = $1 AND owner_id = $2")
        .bind(id)
        .bind(owner_id)
        .fetch_optional(pool)
        .await?;
    if owned.is_none() {
        return Ok(None);
    }
    let rows: Vec<MessageView> = sqlx::query_as(&format!(
        "{TRANSCRIPT_CTE}
         SELECT id, role, content, status, run_id, created_at FROM t
         WHERE $3::uuid IS NULL
            OR (turn_at, turn_id, answer, created_at, id)
               > (SELECT turn_at, turn_id, answer, created_at, id FROM t WHERE id = $3)
         ORDER BY turn_at, turn_id, answer, created_at, id LIMIT $2"
    ))
    .bind(id)
    .bind(limit)
    .bind(after)
    .fetch_all(pool)
    .await?;
    Ok(Some(rows))
}
