//! Conversation reads and the retry a person asks for on purpose (nothing is
//! ever re-run silently: a run whose worker died ends `failed`).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgExecutor, PgPool};

use super::runs::{Enqueued, TRANSCRIPT_CTE};
use super::notify::{notify, RUN_ENQUEUED};
use super::{ConversationId, MessageId, RunId, RunStatus};

/// Messages one transcript read returns at most.
pub const MESSAGES_PAGE_MAX: i64 = 1000;

#[derive(Debug, Clone, Serialize)]
pub struct ConversationView {
    pub id: ConversationId,
    pub created_at: DateTime<Utc>,
    pub active_run_id: Option<RunId>,
    pub queued_run_ids: Vec<RunId>,
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct MessageView {
    pub id: MessageId,
    pub role: String,
    pub content: String,
    pub status: String,
    pub run_id: Option<RunId>,
    pub created_at: DateTime<Utc>,
}

/// One conversation of `owner_id`; `None` when missing or someone else's.
pub async fn get(
    db: impl PgExecutor<'_>,
    id: ConversationId,
    owner_id: &str,
) -> Result<Option<ConversationView>, sqlx::Error> {
    let row: Option<(DateTime<Utc>, Option<RunId>, Vec<uuid::Uuid>)> = sqlx::query_as(
        "SELECT c.created_at,
                (SELECT r.id FROM agent_run r WHERE r.conversation_id = c.id AND r.status = 'running'),
                coalesce((SELECT array_agg(r.id ORDER BY r.queue_pos) FROM agent_run r
                          WHERE r.conversation_id = c.id AND r.status = 'queued'), '{}')
         FROM conversation c WHERE c.id = $1 AND c.owner_id = $2",
    )
    .bind(id)
    .bind(owner_id)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|(created_at, active_run_id, queued)| ConversationView {
        id,
        created_at,
        active_run_id,
        queued_run_ids: queued.into_iter().map(RunId).collect(),
    }))
}

/// A conversation in a list: its latest turn's opening words and state.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ConversationSummary {
    pub id: ConversationId,
    pub created_at: DateTime<Utc>,
    /// The first 80 characters of the latest user message.
    pub title: Option<String>,
    pub latest_run_id: Option<RunId>,
    pub latest_status: Option<String>,
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

#[derive(Debug, thiserror::Error)]
pub enum RetryError {
    #[error("run not found")]
    NotFound,
    #[error("{0}")]
    Conflict(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// A new run for the same user message, with the same plugin (digest and
/// manifest as pinned) and config. Only a failed or cancelled run that is its
/// conversation's latest turn can be retried. The conversation row is locked,
/// so two retries of one run serialise and the second finds a later turn.
pub async fn retry(pool: &PgPool, run: RunId, owner_id: &str) -> Result<Enqueued, RetryError> {
    let mut tx = pool.begin().await?;
    let row: Option<(ConversationId, String, MessageId)> = sqlx::query_as(
        "SELECT conversation_id, status, user_message_id FROM agent_run WHERE id = $1 AND owner_id = $2",
    )
    .bind(run)
    .bind(owner_id)
    .fetch_optional(&mut *tx)
    .await?;
    let (conversation, _, message) = row.ok_or(RetryError::NotFound)?;
    sqlx::query("SELECT 1 FROM conversation WHERE id = $1 FOR UPDATE").bind(conversation).execute(&mut *tx).await?;
    // Re-read under the lock.
    let (status, later): (String, bool) = sqlx::query_as(
        "SELECT r.status, EXISTS (SELECT 1 FROM agent_run l
                                  WHERE l.conversation_id = r.conversation_id AND l.queue_pos > r.queue_pos)
         FROM agent_run r WHERE r.id = $1",
    )
    .bind(run)
    .fetch_one(&mut *tx)
    .await?;
    if status != "failed" && status != "cancelled" {
        return Err(RetryError::Conflict(format!(
            "run {run} is {status}: only a failed or cancelled run can be retried"
        )));
    }
    if later {
        return Err(RetryError::Conflict(format!(
            "run {run} is not its conversation's latest turn: only the latest turn can be retried"
        )));
    }
    let new = RunId::new();
    sqlx::query(
        "INSERT INTO agent_run (id, conversation_id, owner_id, tenant_id, user_message_id,
                                plugin, plugin_digest, request, config, plugin_manifest)
         SELECT $2, conversation_id, owner_id, tenant_id, user_message_id,
                plugin, plugin_digest, request, config, plugin_manifest
         FROM agent_run WHERE id = $1",
    )
    .bind(run)
    .bind(new)
    .execute(&mut *tx)
    .await?;
    sqlx::query("UPDATE message SET status = 'queued', run_id = $2 WHERE id = $1")
        .bind(message)
        .bind(new)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO run_event (run_id, seq, type, payload) VALUES
            ($1, 1, 'user_message_created', jsonb_build_object('message_id', $2::uuid, 'retry_of', $3::uuid)),
            ($1, 2, 'run_queued', jsonb_build_object('run_id', $1::uuid))",
    )
    .bind(new)
    .bind(message)
    .bind(run)
    .execute(&mut *tx)
    .await?;
    notify(&mut *tx, RUN_ENQUEUED, &conversation.to_string()).await?;
    tx.commit().await?;
    Ok(Enqueued { run_id: new, status: RunStatus::Queued, conversation_id: conversation, user_message_id: message })
}
