//! Enqueue: a new turn (user message, queued run, journal seq 1-2, the wake)
//! in one transaction, and the idempotency replay's lookup. Called by the HTTP
//! API, the demo and the benchmark. Retry ([`super::lifecycle::retry`]) writes
//! its new run's seq 1-2 with `journal_queued`, the one writer of them.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{json, Value};
use sqlx::{PgExecutor, PgPool, Postgres, Transaction};

use super::events::{RUN_QUEUED, USER_MESSAGE_CREATED};
use super::notify::{notify, RUN_ENQUEUED};
use super::{conversations, ConversationId, MessageId, MessageStatus, RunId, RunStatus};

/// Who a run or conversation belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub user_id: String,
    pub tenant_id: String,
}

/// What enqueue needs. The request snapshot is stored as posted.
#[derive(Debug, Clone)]
pub struct NewRun<'a> {
    pub owner: &'a Owner,
    /// `None`: create a conversation for this run.
    pub conversation_id: Option<ConversationId>,
    pub content: &'a str,
    pub plugin: &'a str,
    pub plugin_digest: Option<&'a str>,
    /// The manifest the run executes with, pinned beside the digest.
    pub plugin_manifest: Option<&'a Value>,
    pub config: &'a Value,
    pub request: &'a Value,
    pub idempotency_key: Option<&'a str>,
    /// Told when the run ends (an allowed URL; see `service::submit`).
    pub webhook: Option<&'a str>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Enqueued {
    pub run_id: RunId,
    pub status: RunStatus,
    pub conversation_id: ConversationId,
    pub user_message_id: MessageId,
}

#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    #[error("conversation {0} not found")]
    ConversationNotFound(ConversationId),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Creates an empty conversation owned by `owner`.
pub async fn create_conversation(
    db: impl PgExecutor<'_>,
    owner: &Owner,
) -> Result<(ConversationId, DateTime<Utc>), sqlx::Error> {
    let id = ConversationId::new();
    let created_at = sqlx::query_scalar(
        "INSERT INTO conversation (id, owner_id, tenant_id) VALUES ($1, $2, $3) RETURNING created_at",
    )
    .bind(id)
    .bind(&owner.user_id)
    .bind(&owner.tenant_id)
    .fetch_one(db)
    .await?;
    Ok((id, created_at))
}

/// Enqueue in one transaction: the user message, the run (queued, with the
/// request snapshot), journal seq 1 `user_message_created` and seq 2
/// `run_queued`, and the wake. Together or not at all; a rolled-back enqueue
/// wakes nobody because NOTIFY fires on commit.
pub async fn enqueue(pool: &PgPool, new: &NewRun<'_>) -> Result<Enqueued, EnqueueError> {
    let mut tx = pool.begin().await?;
    let enqueued = enqueue_in(&mut tx, new).await?;
    tx.commit().await?;
    Ok(enqueued)
}

/// The body of [`enqueue`], inside a caller's transaction.
pub async fn enqueue_in(tx: &mut Transaction<'_, Postgres>, new: &NewRun<'_>) -> Result<Enqueued, EnqueueError> {
    let conversation_id = match new.conversation_id {
        Some(id) => {
            // Another user's conversation is indistinguishable from a missing
            // one. The inserts below hold the row (their foreign keys take it
            // FOR KEY SHARE), so a retry locking it serialises with this enqueue.
            if !conversations::owned(&mut **tx, id, &new.owner.user_id).await? {
                return Err(EnqueueError::ConversationNotFound(id));
            }
            id
        }
        None => create_conversation(&mut **tx, new.owner).await?.0,
    };
    let run_id = RunId::new();
    let message_id = MessageId::new();
    sqlx::query(
        "INSERT INTO message (id, conversation_id, run_id, role, content, status)
         VALUES ($1, $2, $3, 'user', $4, $5)",
    )
    .bind(message_id)
    .bind(conversation_id)
    .bind(run_id)
    .bind(new.content)
    .bind(MessageStatus::Queued)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "INSERT INTO agent_run (id, conversation_id, owner_id, tenant_id, user_message_id,
                                plugin, plugin_digest, request, config, idempotency_key, plugin_manifest, webhook)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
    )
    .bind(run_id)
    .bind(conversation_id)
    .bind(&new.owner.user_id)
    .bind(&new.owner.tenant_id)
    .bind(message_id)
    .bind(new.plugin)
    .bind(new.plugin_digest)
    .bind(new.request)
    .bind(new.config)
    .bind(new.idempotency_key)
    .bind(new.plugin_manifest)
    .bind(new.webhook)
    .execute(&mut **tx)
    .await?;
    journal_queued(&mut **tx, run_id, message_id, None).await?;
    notify(&mut **tx, RUN_ENQUEUED, &conversation_id.to_string()).await?;
    Ok(Enqueued { run_id, status: RunStatus::Queued, conversation_id, user_message_id: message_id })
}

/// Journal seq 1 `user_message_created` (`{message_id}`, with `retry_of` when
/// the run retries an earlier one) and seq 2 `run_queued` (`{run_id}`) of a
/// run being enqueued, in the enqueuing transaction: the only writer of them.
pub(crate) async fn journal_queued(
    db: impl PgExecutor<'_>,
    run: RunId,
    message: MessageId,
    retry_of: Option<RunId>,
) -> Result<(), sqlx::Error> {
    let mut created = json!({ "message_id": message });
    if let Some(earlier) = retry_of {
        created["retry_of"] = json!(earlier);
    }
    let queued = json!({ "run_id": run });
    sqlx::query("INSERT INTO run_event (run_id, seq, type, payload) VALUES ($1, 1, $2, $3), ($1, 2, $4, $5)")
        .bind(run)
        .bind(USER_MESSAGE_CREATED)
        .bind(created)
        .bind(RUN_QUEUED)
        .bind(queued)
        .execute(db)
        .await?;
    Ok(())
}

/// Whether an enqueue failed because the owner already used its idempotency key.
pub fn is_idempotency_conflict(e: &EnqueueError) -> bool {
    matches!(e, EnqueueError::Db(sqlx::Error::Database(d)) if d.constraint() == Some("agent_run_idempotency"))
}

/// The run an owner's idempotency key already created, with its request
/// snapshot (`None` once retention has trimmed it).
pub async fn find_by_idempotency_key(
    db: impl PgExecutor<'_>,
    owner_id: &str,
    key: &str,
) -> Result<Option<(Enqueued, Option<Value>)>, sqlx::Error> {
    let row: Option<(RunId, ConversationId, MessageId, Option<Value>)> = sqlx::query_as(
        "SELECT id, conversation_id, user_message_id, request FROM agent_run
         WHERE owner_id = $1 AND idempotency_key = $2",
    )
    .bind(owner_id)
    .bind(key)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|(run_id, conversation_id, user_message_id, request)| {
        // The answer the first request got.
        (Enqueued { run_id, status: RunStatus::Queued, conversation_id, user_message_id }, request)
    }))
}
