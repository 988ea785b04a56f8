//! Enqueue: a new turn (user message, queued run, journal seq 1-2, the wake)
//! in one transaction, and the idempotency replay's lookup. Called by the HTTP
//! API, the demo and the benchmark. A run started in its enqueue (eager
//! start, `running`) is a status write, so its statement is
//! [`super::lifecycle::Eager`]'s, built on this one's conversation and binds. Retry ([`super::lifecycle::retry`]) writes
//! its new run's seq 1-2 with `journal_queued`, the one writer of them.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{json, Value};
use sqlx::postgres::PgArguments;
use sqlx::query::QueryAs;
use sqlx::{PgExecutor, PgPool, Postgres, Transaction};

use super::events::{RUN_QUEUED, USER_MESSAGE_CREATED};
use super::notify::RUN_ENQUEUED;
use super::{ConversationId, MessageId, MessageStatus, RunId, RunStatus};

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
    /// The run whose agent starts this one (a sub-agent), and that agent's
    /// tool call which does: the child's depth is its parent's plus one.
    /// Only the queued enqueue writes it (a child never starts eagerly).
    pub parent: Option<(RunId, i32)>,
}

#[derive(Debug, Clone, Serialize, PartialEq, schemars::JsonSchema)]
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

/// Enqueue in one statement, and so one transaction: the user message, the
/// run (queued, with the request snapshot), journal seq 1
/// `user_message_created` and seq 2 `run_queued`, and the wake. Together or
/// not at all; a rolled-back enqueue wakes nobody because NOTIFY fires on
/// commit. One round trip (it was seven: BEGIN, five statements, COMMIT).
pub async fn enqueue(pool: &PgPool, new: &NewRun<'_>) -> Result<Enqueued, EnqueueError> {
    enqueue_on(pool, new).await
}

/// [`enqueue`] inside a caller's transaction.
pub async fn enqueue_in(tx: &mut Transaction<'_, Postgres>, new: &NewRun<'_>) -> Result<Enqueued, EnqueueError> {
    enqueue_on(&mut **tx, new).await
}

/// The conversation the enqueue's statement writes to, its opening CTEs
/// (`made`, `named`, `target`), shared with the eager start's statement
/// ([`crate::db::lifecycle::Eager`]). A new conversation is made in it when
/// none is named; a named one must be the owner's (another user's is
/// indistinguishable from a missing one: nothing is written and no row
/// comes back). The run's foreign key takes the conversation row FOR KEY
/// SHARE at the statement's end, so a retry locking it serialises with this
/// enqueue. Rows made in the statement satisfy the foreign keys: those are
/// checked after its last insert. (The message and the journal events carry
/// no foreign key of their own, migrations/0014: their parents' ids come
/// from the rows made here.) Its parameters are [`bind_new_run`]'s.
macro_rules! enqueue_target_sql {
    () => {
        "
WITH made AS (
    INSERT INTO conversation (id, owner_id, tenant_id)
    SELECT $2, $3, $4 WHERE $1::uuid IS NULL
    RETURNING id
),
-- A named conversation's row locked before any insert (the foreign key
-- would take the same lock at the statement's end): an enqueue waits here
-- for a `reject` or `interrupt` holding the row, never after its own
-- running row is in the one-running index, where the two could deadlock.
named AS (
    SELECT id FROM conversation WHERE id = $1 AND owner_id = $3 FOR KEY SHARE
),
target AS (
    SELECT id FROM made
    UNION ALL
    SELECT id FROM named
)"
    };
}
pub(crate) use enqueue_target_sql;

/// The enqueue's statement: the conversation ([`enqueue_target_sql`]), the
/// message, the run `queued` (with its parent, `$21`-`$22`), journal seq
/// 1-2 and the wake.
const ENQUEUE_SQL: &str = concat!(
    enqueue_target_sql!(),
    ",
msg AS (
    INSERT INTO message (id, conversation_id, run_id, role, content, status)
    SELECT $5, t.id, $6, 'user', $7, $8::text
    FROM target t
    RETURNING conversation_id
),
run AS (
    INSERT INTO agent_run (id, conversation_id, owner_id, tenant_id, user_message_id,
                           plugin, plugin_digest, request, config, idempotency_key, plugin_manifest, webhook,
                           status, parent_run_id, parent_call, depth)
    SELECT $6, m.conversation_id, $3, $4, $5, $9, $10, $11, $12, $13, $14, $15, 'queued', $21::uuid, $22::int,
           coalesce((SELECT p.depth + 1 FROM agent_run p WHERE p.id = $21::uuid), 0)
    FROM msg m
    RETURNING id, conversation_id
),
journal AS (
    INSERT INTO run_event (run_id, seq, type, payload)
    SELECT r.id, s.seq, s.type, s.payload
    FROM run r, (VALUES (1, $16::text, $17::jsonb), (2, $18::text, $19::jsonb)) AS s(seq, type, payload)
),
wake AS (
    SELECT pg_notify($20, conversation_id::text) FROM run
)
-- Referencing `wake` is what makes it run.
SELECT r.conversation_id FROM run r WHERE (SELECT count(*) FROM wake) >= 0"
);

/// Binds the parameters `$1`-`$20` of the enqueue's statement (and of the
/// eager start's, which adds its own after them) for a new run and message.
pub(crate) fn bind_new_run<'q, O>(
    query: QueryAs<'q, Postgres, O, PgArguments>,
    new: &NewRun<'q>,
    run_id: RunId,
    message_id: MessageId,
) -> QueryAs<'q, Postgres, O, PgArguments> {
    let (created, queued) = queued_payloads(run_id, message_id, None);
    query
        .bind(new.conversation_id)
        .bind(ConversationId::new())
        .bind(&new.owner.user_id)
        .bind(&new.owner.tenant_id)
        .bind(message_id)
        .bind(run_id)
        .bind(new.content)
        .bind(MessageStatus::Queued)
        .bind(new.plugin)
        .bind(new.plugin_digest)
        .bind(new.request)
        .bind(new.config)
        .bind(new.idempotency_key)
        .bind(new.plugin_manifest)
        .bind(new.webhook)
        .bind(USER_MESSAGE_CREATED)
        .bind(created)
        .bind(RUN_QUEUED)
        .bind(queued)
        .bind(RUN_ENQUEUED)
}

/// A statement's missing row: the named conversation is not the owner's.
pub(crate) fn not_found(new: &NewRun<'_>) -> EnqueueError {
    match new.conversation_id {
        Some(named) => EnqueueError::ConversationNotFound(named),
        None => EnqueueError::Db(sqlx::Error::RowNotFound),
    }
}

async fn enqueue_on(db: impl PgExecutor<'_>, new: &NewRun<'_>) -> Result<Enqueued, EnqueueError> {
    let run_id = RunId::new();
    let message_id = MessageId::new();
    let row: Option<(ConversationId,)> = bind_new_run(sqlx::query_as(ENQUEUE_SQL), new, run_id, message_id)
        .bind(new.parent.map(|p| p.0))
        .bind(new.parent.map(|p| p.1))
        .fetch_optional(db)
        .await?;
    let Some((conversation_id,)) = row else {
        return Err(not_found(new));
    };
    // The answer the API gives: the state the run was accepted in (seq 2, `run_queued`).
    Ok(Enqueued { run_id, status: RunStatus::Queued, conversation_id, user_message_id: message_id })
}

/// The payloads of journal seq 1 `user_message_created` (`{message_id}`,
/// with `retry_of` when the run retries an earlier one) and seq 2
/// `run_queued` (`{run_id}`).
fn queued_payloads(run: RunId, message: MessageId, retry_of: Option<RunId>) -> (Value, Value) {
    let mut created = json!({ "message_id": message });
    if let Some(earlier) = retry_of {
        created["retry_of"] = json!(earlier);
    }
    (created, json!({ "run_id": run }))
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
    let (created, queued) = queued_payloads(run, message, retry_of);
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
