//! Enqueue: a new turn (user message, queued run, journal seq 1-2, the wake)
//! in one transaction, and the idempotency replay's lookup. Called by the HTTP
//! API, the demo and the benchmark. Retry ([`super::lifecycle::retry`]) writes
//! its new run's seq 1-2 with `journal_queued`, the one writer of them.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{json, Value};
use sqlx::{PgExecutor, PgPool, Postgres, Transaction};

use super::claimed::{is_running_conflict, ClaimedRun};
use super::events::{RUN_QUEUED, RUN_STARTED, USER_MESSAGE_CREATED};
use super::notify::RUN_ENQUEUED;
use super::{ClaimToken, ConversationId, MessageId, MessageStatus, RunId, RunStatus};

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
    Ok(enqueue_on(pool, new, None).await?.0)
}

/// [`enqueue`] inside a caller's transaction.
pub async fn enqueue_in(tx: &mut Transaction<'_, Postgres>, new: &NewRun<'_>) -> Result<Enqueued, EnqueueError> {
    Ok(enqueue_on(&mut **tx, new, None).await?.0)
}

/// A start made in the enqueue's own statement (eager start): the process
/// enqueuing has a free slot of its own, so instead of queueing the run,
/// waking every dispatcher with `run_enqueued` and waiting for one of them
/// to claim it, the enqueue writes it claimed by this process (`running`,
/// its fence token, lease and `started_at`, seq 3 `run_started`, the user
/// message `complete`), and the caller hands it to its worker's run task.
/// As Temporal's eager workflow start does, it saves the round trip to the
/// queue and back; here also one claim statement and one wake of every
/// idle dispatcher per run.
///
/// Only when it takes no other run's place: it is made only if nothing is
/// queued (a backlog keeps its claim order and its tenant fairness), the
/// conversation has no running or waiting turn (one running turn per
/// conversation, FIFO), and the tenant is under its running cap. Otherwise
/// the run is queued and woken for as always. The one-running index still
/// has the last word: an enqueue that meets a concurrent start in its
/// conversation is made again without the start ([`enqueue_eager`]).
#[derive(Debug, Clone)]
pub struct Eager<'a> {
    /// The claim as the worker would make it.
    pub worker_id: &'a str,
    pub lease: std::time::Duration,
    /// Running runs one tenant may have at most (`None`: no cap).
    pub tenant_max_running: Option<i64>,
}

/// The enqueue's statement. A new conversation is made in it when none is
/// named; a named one must be the owner's (another user's is
/// indistinguishable from a missing one: nothing is written and no row
/// comes back). The run's foreign key takes the conversation row FOR KEY
/// SHARE at the statement's end, so a retry locking it serialises with this
/// enqueue. Rows made in the statement satisfy the foreign keys: those are
/// checked after its last insert. (The message and the journal events carry
/// no foreign key of their own, migrations/0014: their parents' ids come
/// from the rows made here.) With `$21` the run may start in it ([`Eager`]).
const ENQUEUE_SQL: &str = "
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
),
-- Whether the run starts here (see `Eager`): asked for, nothing queued, no
-- running or waiting turn in a named conversation, the tenant under its cap.
-- AND stops at the first false, so a plain enqueue reads nothing more.
eager AS (
    SELECT $21::bool
       AND NOT EXISTS (SELECT 1 FROM agent_run WHERE status = 'queued')
       AND NOT EXISTS (SELECT 1 FROM agent_run
                       WHERE conversation_id = $1 AND status IN ('running', 'waiting'))
       AND ($24::bigint IS NULL
            OR (SELECT count(*) FROM agent_run WHERE tenant_id = $4 AND status = 'running') < $24)
       AS go
),
msg AS (
    INSERT INTO message (id, conversation_id, run_id, role, content, status)
    SELECT $5, t.id, $6, 'user', $7, CASE WHEN e.go THEN 'complete' ELSE $8::text END
    FROM target t, eager e
    RETURNING conversation_id
),
run AS (
    INSERT INTO agent_run (id, conversation_id, owner_id, tenant_id, user_message_id,
                           plugin, plugin_digest, request, config, idempotency_key, plugin_manifest, webhook,
                           status, claim_token, claim_expires_at, worker_id, started_at, last_heartbeat_at, seed)
    SELECT $6, m.conversation_id, $3, $4, $5, $9, $10, $11, $12, $13, $14, $15,
           CASE WHEN e.go THEN 'running' ELSE 'queued' END,
           CASE WHEN e.go THEN gen_random_uuid() END,
           -- The statement's start, not the transaction's: in a caller's
           -- transaction the enqueue is not its first statement.
           CASE WHEN e.go THEN statement_timestamp() + make_interval(secs => $23) END,
           CASE WHEN e.go THEN $22 END,
           CASE WHEN e.go THEN clock_timestamp() END,
           CASE WHEN e.go THEN statement_timestamp() END,
           CASE WHEN e.go THEN gen_random_uuid() END
    FROM msg m, eager e
    RETURNING id, conversation_id, status, claim_token, seed
),
journal AS (
    INSERT INTO run_event (run_id, seq, type, payload)
    SELECT r.id, s.seq, s.type, s.payload
    FROM run r, (VALUES (1, $16::text, $17::jsonb), (2, $18::text, $19::jsonb),
                        (3, $25::text, jsonb_build_object('worker_id', $22::text))) AS s(seq, type, payload)
    WHERE s.seq < 3 OR r.status = 'running'
),
-- A run that started here wakes nobody: no dispatcher could claim it.
wake AS (
    SELECT pg_notify($20, conversation_id::text) FROM run WHERE status = 'queued'
)
-- Referencing `wake` is what makes it run. `has_history`: the conversation
-- had a message before this turn's (this statement's snapshot holds none of
-- its own rows).
SELECT r.conversation_id, r.claim_token, r.seed,
       $21 AND $1::uuid IS NOT NULL AND EXISTS (SELECT 1 FROM message h WHERE h.conversation_id = $1)
           AS has_history
FROM run r WHERE (SELECT count(*) FROM wake) >= 0";

/// [`enqueue`], starting the run in the same statement when `eager` allows
/// (see [`Eager`]): the run as claimed, for the caller's worker to run at
/// once (the caller took its slot before), or `None` when it was queued.
/// An enqueue that met a start in its conversation committing at the same
/// instant (the one-running index refused it, rolling back everything) is
/// made again without the start.
pub async fn enqueue_eager(
    pool: &PgPool,
    new: &NewRun<'_>,
    eager: &Eager<'_>,
) -> Result<(Enqueued, Option<ClaimedRun>), EnqueueError> {
    match enqueue_on(pool, new, Some(eager)).await {
        Err(EnqueueError::Db(e)) if is_running_conflict(&e) => Ok((enqueue_on(pool, new, None).await?.0, None)),
        done => done,
    }
}

/// [`enqueue_eager`] inside a caller's transaction; a start refused by the
/// index rolls back to a savepoint, not the caller's transaction. (Only a
/// named conversation can meet one: a new one is made in the statement.)
pub async fn enqueue_eager_in(
    tx: &mut Transaction<'_, Postgres>,
    new: &NewRun<'_>,
    eager: &Eager<'_>,
) -> Result<(Enqueued, Option<ClaimedRun>), EnqueueError> {
    if new.conversation_id.is_none() {
        return enqueue_on(&mut **tx, new, Some(eager)).await;
    }
    let mut savepoint = sqlx::Connection::begin(&mut **tx).await?;
    match enqueue_on(&mut *savepoint, new, Some(eager)).await {
        Ok(done) => {
            savepoint.commit().await?;
            Ok(done)
        }
        Err(EnqueueError::Db(e)) if is_running_conflict(&e) => {
            savepoint.rollback().await?;
            Ok((enqueue_on(&mut **tx, new, None).await?.0, None))
        }
        // The error itself (a used idempotency key, a missing conversation),
        // not the release's failure in an aborted transaction.
        Err(e) => {
            let _ = savepoint.rollback().await;
            Err(e)
        }
    }
}

async fn enqueue_on(
    db: impl PgExecutor<'_>,
    new: &NewRun<'_>,
    eager: Option<&Eager<'_>>,
) -> Result<(Enqueued, Option<ClaimedRun>), EnqueueError> {
    let run_id = RunId::new();
    let message_id = MessageId::new();
    let (created, queued) = queued_payloads(run_id, message_id, None);
    let row: Option<(ConversationId, Option<ClaimToken>, Option<uuid::Uuid>, bool)> = sqlx::query_as(ENQUEUE_SQL)
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
        .bind(eager.is_some())
        .bind(eager.map(|e| e.worker_id))
        .bind(eager.map_or(0.0, |e| e.lease.as_secs_f64()))
        .bind(eager.and_then(|e| e.tenant_max_running))
        .bind(RUN_STARTED)
        .fetch_optional(db)
        .await?;
    let Some((conversation_id, token, seed, has_history)) = row else {
        return Err(match new.conversation_id {
            Some(named) => EnqueueError::ConversationNotFound(named),
            None => EnqueueError::Db(sqlx::Error::RowNotFound),
        });
    };
    // The answer the API gives: the state the run was accepted in (seq 2,
    // `run_queued`), whether or not it started in the same commit.
    let enqueued = Enqueued { run_id, status: RunStatus::Queued, conversation_id, user_message_id: message_id };
    // A token and a seed: the statement started the run.
    let started = token.zip(seed).map(|(claim_token, seed)| ClaimedRun {
        id: run_id,
        conversation_id,
        claim_token,
        user_message_id: message_id,
        owner_id: new.owner.user_id.clone(),
        tenant_id: new.owner.tenant_id.clone(),
        plugin: new.plugin.to_string(),
        plugin_digest: new.plugin_digest.map(str::to_string),
        plugin_manifest: new.plugin_manifest.cloned(),
        config: new.config.clone(),
        content: new.content.to_string(),
        waited_s: 0.0,
        attempt: 1,
        waits: 0,
        seed,
        has_history,
    });
    Ok((enqueued, started))
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
