//! Runs: enqueue, claim, heartbeat, fenced journal appends, finalize, reap.
//!
//! Every statement a worker makes against its run carries the fence
//! (`id`, `claim_token`, `status = 'running'`); zero rows means someone else
//! ended the run, and the worker stands down.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{json, Value};
use sqlx::{PgExecutor, PgPool, Postgres, Transaction};

use super::notify::{events_channel, notify, RUN_ENQUEUED};
use super::{ClaimToken, ConversationId, MessageId, RunId, RunStatus};

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

/// A run as a worker holds it after a claim.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ClaimedRun {
    pub id: RunId,
    pub conversation_id: ConversationId,
    pub claim_token: ClaimToken,
    pub user_message_id: MessageId,
    pub owner_id: String,
    pub tenant_id: String,
    pub plugin: String,
    pub plugin_digest: Option<String>,
    pub plugin_manifest: Option<Value>,
    pub config: Value,
    pub content: String,
    /// Seconds from enqueue to this claim (the database's clock).
    pub waited_s: f64,
}

/// A run as clients see it (`GET /v1/runs/{id}`).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct RunView {
    pub id: RunId,
    pub conversation_id: ConversationId,
    #[sqlx(try_from = "String")]
    pub status: StatusText,
    pub plugin: String,
    pub plugin_digest: Option<String>,
    pub cancel_requested: bool,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub last_seq: i32,
    /// Model calls and tokens, once the run has ended (null without a model call).
    pub usage: Option<Value>,
}

/// A status read back from a text column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct StatusText(pub RunStatus);

impl TryFrom<String> for StatusText {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse().map(StatusText)
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
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
            // Another user's conversation is indistinguishable from a missing one.
            let found: Option<i32> =
                sqlx::query_scalar("SELECT 1 FROM conversation WHERE id = $1 AND owner_id = $2 FOR KEY SHARE")
                    .bind(id)
                    .bind(&new.owner.user_id)
                    .fetch_optional(&mut **tx)
                    .await?;
            if found.is_none() {
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
         VALUES ($1, $2, $3, 'user', $4, 'queued')",
    )
    .bind(message_id)
    .bind(conversation_id)
    .bind(run_id)
    .bind(new.content)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "INSERT INTO agent_run (id, conversation_id, owner_id, tenant_id, user_message_id,
                                plugin, plugin_digest, request, config, idempotency_key, plugin_manifest)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
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
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "INSERT INTO run_event (run_id, seq, type, payload) VALUES
            ($1, 1, 'user_message_created', jsonb_build_object('message_id', $2::uuid)),
            ($1, 2, 'run_queued', jsonb_build_object('run_id', $1::uuid))",
    )
    .bind(run_id)
    .bind(message_id)
    .execute(&mut **tx)
    .await?;
    notify(&mut **tx, RUN_ENQUEUED, &conversation_id.to_string()).await?;
    Ok(Enqueued { run_id, status: RunStatus::Queued, conversation_id, user_message_id: message_id })
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


/// Parameters of one claim.
#[derive(Debug, Clone)]
pub struct Claim<'a> {
    /// At most this many rows: the dispatcher's free slots (acquire-before-pull).
    pub limit: i64,
    pub lease: Duration,
    pub worker_id: &'a str,
    /// The NOT EXISTS filter that skips conversations with a running run. An
    /// optimisation only (the partial unique index is the guarantee); tests
    /// turn it off to show the index holds alone.
    pub prefilter: bool,
    /// Running runs one tenant may have at most (`None`: no cap).
    pub tenant_max_running: Option<i64>,
}

const CLAIM_SQL: &str = "
WITH RECURSIVE
-- Tenants with queued work: a loose index scan (one probe per tenant) over
-- agent_run_queued_by_tenant, not a scan of the queue.
tenants AS (
    (SELECT tenant_id FROM agent_run WHERE status = 'queued' ORDER BY tenant_id LIMIT 1)
    UNION ALL
    SELECT (SELECT a.tenant_id FROM agent_run a
            WHERE a.status = 'queued' AND a.tenant_id > t.tenant_id
            ORDER BY a.tenant_id LIMIT 1)
    FROM tenants t WHERE t.tenant_id IS NOT NULL
),
-- Running runs per tenant. Only needed to weigh tenants against each other
-- or against a cap: a lone tenant without a cap skips the count (CASE runs
-- its subquery only when taken), which would otherwise step over every dead
-- index entry its finished runs left behind.
load AS (
    SELECT t.tenant_id,
           CASE WHEN $5::bigint IS NOT NULL OR (SELECT count(*) FROM tenants WHERE tenant_id IS NOT NULL) > 1
                THEN (SELECT count(*) FROM agent_run b WHERE b.tenant_id = t.tenant_id AND b.status = 'running')
                ELSE 0 END AS running
    FROM tenants t WHERE t.tenant_id IS NOT NULL
),
-- Each tenant's oldest claimable turns, locked as they are found (SKIP
-- LOCKED inside the per-tenant scan, so concurrent claimers move past each
-- other's rows exactly as a plain FIFO claim would), then ranked by the load
-- the tenant would carry if each were claimed (running + place in its line):
-- the least-loaded tenant goes first, and one claim's rows interleave
-- tenants. Rows locked but not chosen are released at commit, moments later.
-- The optional cap ($5) keeps a tenant from ever passing that many running.
heads AS (
    SELECT l.tenant_id, l.running, c.id, c.queue_pos
    FROM load l CROSS JOIN LATERAL (
        SELECT q.id, q.queue_pos
        FROM agent_run q
        WHERE q.tenant_id = l.tenant_id AND q.status = 'queued'
          -- FIFO within a conversation: only its oldest queued turn is a
          -- candidate, so SKIP LOCKED can never slide onto a later turn.
          AND NOT EXISTS (
              SELECT 1 FROM agent_run e
              WHERE e.conversation_id = q.conversation_id
                AND e.status = 'queued' AND e.queue_pos < q.queue_pos)
          AND ($4 = false OR NOT EXISTS (      -- the pre-filter (an optimisation)
              SELECT 1 FROM agent_run b
              WHERE b.conversation_id = q.conversation_id AND b.status = 'running'))
        ORDER BY q.queue_pos
        LIMIT $1
        FOR UPDATE SKIP LOCKED                 -- contended rows turn invisible
    ) c
),
candidates AS (
    SELECT id, queue_pos,
           running + row_number() OVER (PARTITION BY tenant_id ORDER BY queue_pos) AS load_after
    FROM heads
),
claimed AS (
    UPDATE agent_run r SET
        status            = 'running',
        claim_token       = gen_random_uuid(),
        claim_expires_at  = now() + make_interval(secs => $2),
        worker_id         = $3,
        started_at        = coalesce(r.started_at, now()),
        last_heartbeat_at = now()
    WHERE r.id IN (
        SELECT id FROM candidates
        WHERE $5::bigint IS NULL OR load_after <= $5
        ORDER BY load_after, queue_pos
        LIMIT $1
    )
    RETURNING r.id, r.conversation_id, r.claim_token, r.user_message_id, r.owner_id,
              r.tenant_id, r.plugin, r.plugin_digest, r.plugin_manifest, r.config,
              extract(epoch FROM now() - r.created_at)::float8 AS waited_s
),
started AS (
    -- seq 3 belongs to the claim: the run_started event commits with it.
    INSERT INTO run_event (run_id, seq, type, payload)
    SELECT id, 3, 'run_started', jsonb_build_object('worker_id', $3::text) FROM claimed
),
msg AS (
    UPDATE message m SET status = 'complete'
    FROM claimed c WHERE m.id = c.user_message_id
    RETURNING m.id, m.content
)
SELECT c.*, msg.content FROM claimed c JOIN msg ON msg.id = c.user_message_id";

/// Claims up to `limit` queued runs in one statement. An error for which
/// [`is_running_conflict`] holds is the one-running-per-conversation index
/// turning away a turn the pre-filter could not see: it means "claimed nothing
/// this round", and the caller simply claims again.
pub async fn claim(db: impl PgExecutor<'_>, claim: &Claim<'_>) -> Result<Vec<ClaimedRun>, sqlx::Error> {
    sqlx::query_as::<_, ClaimedRun>(CLAIM_SQL)
        .bind(claim.limit)
        .bind(secs(claim.lease))
        .bind(claim.worker_id)
        .bind(claim.prefilter)
        .bind(claim.tenant_max_running)
        .fetch_all(db)
        .await
}

/// Whether a claim error was the index turning away a second running turn.
pub fn is_running_conflict(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.constraint() == Some("one_running_per_conversation"))
}

/// One heartbeat for every run this process holds: renews each lease, fenced
/// by its token. Returns the runs still held, with their cancel flag; a run
/// missing from the answer was lost (reaped or otherwise ended).
pub async fn heartbeat(
    db: impl PgExecutor<'_>,
    held: &[(RunId, ClaimToken)],
    lease: Duration,
) -> Result<Vec<(RunId, bool)>, sqlx::Error> {
    if held.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<uuid::Uuid> = held.iter().map(|h| h.0 .0).collect();
    let tokens: Vec<uuid::Uuid> = held.iter().map(|h| h.1 .0).collect();
    sqlx::query_as(
        "UPDATE agent_run r SET
             last_heartbeat_at = now(),
             claim_expires_at  = now() + make_interval(secs => $3)
         FROM unnest($1::uuid[], $2::uuid[]) AS h(id, token)
         WHERE r.id = h.id
           AND r.claim_token = h.token    -- a stale worker's heartbeat updates 0 rows
           AND r.status = 'running'
         RETURNING r.id, r.cancel_requested",
    )
    .bind(ids)
    .bind(tokens)
    .bind(secs(lease))
    .fetch_all(db)
    .await
}


/// Appends events `first_seq..` to a run's journal, fenced: written only while
/// the run still names this claim token and is running. The run row is taken
/// `FOR SHARE`, so the append serialises with any terminal write and a
/// finalizer's max(seq)+1 never collides with it. All or nothing: a tripped
/// fence inserts no row and, with `notify`, announces nothing (the NOTIFY
/// rides the same statement). Returns false when fenced.
pub async fn append_events(
    db: impl PgExecutor<'_>,
    run: RunId,
    token: ClaimToken,
    first_seq: i32,
    events: &[(&str, Value)],
    notify: Option<&str>,
) -> Result<bool, sqlx::Error> {
    let types: Vec<&str> = events.iter().map(|e| e.0).collect();
    let payloads: Vec<&Value> = events.iter().map(|e| &e.1).collect();
    let (inserted, _notified): (i64, Option<i32>) = sqlx::query_as(
        "WITH ins AS (
             INSERT INTO run_event (run_id, seq, type, payload)
             SELECT $1, $3 + e.ord::int - 1, e.type, e.payload
             FROM (SELECT 1 FROM agent_run
                   WHERE id = $1 AND claim_token = $2 AND status = 'running'   -- the fence
                   FOR SHARE) AS fence,
                  unnest($4::text[], $5::jsonb[]) WITH ORDINALITY AS e(type, payload, ord)
             RETURNING seq),
         n AS (SELECT count(*) AS n, max(seq) AS last FROM ins)
         SELECT n.n, CASE WHEN n.n > 0 AND $6::text IS NOT NULL
                          THEN (SELECT 1 FROM pg_notify($6, n.last::text)) END
         FROM n",
    )
    .bind(run)
    .bind(token)
    .bind(first_seq)
    .bind(types)
    .bind(payloads)
    .bind(notify)
    .fetch_one(db)
    .await?;
    Ok(inserted as usize == events.len())
}

/// How a worker ends its run.
#[derive(Debug, Clone)]
pub struct Finish<'a> {
    pub status: RunStatus,
    pub error: Option<&'a str>,
    /// The assistant's text, if any, with its message status.
    pub assistant: Option<(&'a str, &'a str)>,
    /// Model usage (`agent::Usage`), if the run called a model.
    pub usage: Option<Value>,
}

/// The worker's terminal write, fenced: status flip, the one `complete` event,
/// the assistant message and the wake, in one statement (one transaction).
/// The `complete` seq is max(seq)+1: the holder's own appends are done (or,
/// for the backstop, its task is gone), so nothing can append concurrently.
/// Returns false when fenced: someone else already ended this run.
pub async fn finish(
    db: impl PgExecutor<'_>,
    run: RunId,
    token: ClaimToken,
    finish: &Finish<'_>,
) -> Result<bool, sqlx::Error> {
    debug_assert!(finish.status.is_terminal());
    let (text, message_status) = match finish.assistant {
        Some((t, s)) => (Some(t), Some(s)),
        None => (None, None),
    };
    let applied: Option<bool> = sqlx::query_scalar(
        "WITH fin AS (
             UPDATE agent_run SET status = $3, error = $4, finished_at = now(), usage = $9
             WHERE id = $1 AND claim_token = $2 AND status = 'running'   -- the fence
             RETURNING id, conversation_id
         ),
         ev AS (
             INSERT INTO run_event (run_id, seq, type, payload)
             SELECT id, (SELECT coalesce(max(seq), 0) + 1 FROM run_event WHERE run_id = $1),
                    'complete', jsonb_strip_nulls(jsonb_build_object('status', $3::text, 'error', $4::text))
             FROM fin
         ),
         msg AS (
             INSERT INTO message (id, conversation_id, run_id, role, content, status)
             SELECT $5, conversation_id, id, 'assistant', $6, $7 FROM fin WHERE $6::text IS NOT NULL
         ),
         -- The wake chain: knock when the conversation has a turn waiting on
         -- this one. (Runs of other conversations were announced at enqueue;
         -- an unconditional NOTIFY serialises every commit on the notify
         -- queue.) A turn whose enqueue commits after this statement's
         -- snapshot is covered by `announce_ended`, after commit.
         wake AS (
             SELECT pg_notify($8, f.conversation_id::text) FROM fin f
             WHERE EXISTS (SELECT 1 FROM agent_run q
                           WHERE q.conversation_id = f.conversation_id AND q.status = 'queued')
         )
         -- Referencing `wake` is what makes it run.
         SELECT (SELECT count(*) FROM wake) >= 0 FROM fin",
    )
    .bind(run)
    .bind(token)
    .bind(finish.status.as_str())
    .bind(finish.error)
    .bind(MessageId::new())
    .bind(text)
    .bind(message_status)
    .bind(RUN_ENQUEUED)
    .bind(&finish.usage)
    .fetch_optional(db)
    .await?;
    Ok(applied.is_some())
}

/// Announcements after terminal writes have committed, batched across runs
/// that ended in the same instant (one notify-only transaction for all).
///
/// - Each run's tails are told its `complete` is there. (In the terminal
///   write's own transaction this NOTIFY would serialise every terminal commit
///   on PostgreSQL's notify queue lock; tails poll as a fallback regardless.)
/// - The wake chain's second half: NOTIFY `run_enqueued` if the conversation
///   has a queued turn. A turn enqueued after the terminal write's snapshot
///   but before its commit announced itself while this run still looked
///   running, so its wake found nothing to claim; this read (a fresh snapshot,
///   after our commit) sees it. A turn enqueued after this read announces
///   itself after our commit. Either way it is claimed now, not on the tick.
pub async fn announce_ended(db: impl PgExecutor<'_>, ended: &[(RunId, ConversationId)]) -> Result<(), sqlx::Error> {
    let channels: Vec<String> = ended.iter().map(|(r, _)| events_channel(*r)).collect();
    let conversations: Vec<uuid::Uuid> = ended.iter().map(|(_, c)| c.0).collect();
    sqlx::query(
        "SELECT pg_notify(ch, 'complete') FROM unnest($3::text[]) AS ch
         UNION ALL
         SELECT pg_notify($1, c::text) FROM (SELECT DISTINCT c FROM unnest($2::uuid[]) AS c) AS d
         WHERE EXISTS (SELECT 1 FROM agent_run WHERE conversation_id = d.c AND status = 'queued')",
    )
    .bind(RUN_ENQUEUED)
    .bind(conversations)
    .bind(channels)
    .execute(db)
    .await?;
    Ok(())
}

/// A run whose lease lapsed past the grace, as the reaper read it.
#[derive(Debug, Clone, Copy, sqlx::FromRow)]
pub struct Expired {
    pub id: RunId,
    pub claim_token: ClaimToken,
}

/// The reaper's read: running runs whose lease lapsed more than `grace` ago
/// (by the database's clock). A snapshot, stale the instant it is returned;
/// [`reap`] re-checks in its write.
pub async fn find_expired(db: impl PgExecutor<'_>, grace: Duration, limit: i64) -> Result<Vec<Expired>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, claim_token FROM agent_run
         WHERE status = 'running' AND claim_expires_at < now() - make_interval(secs => $1)
         ORDER BY claim_expires_at LIMIT $2",
    )
    .bind(secs(grace))
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Ends a lost worker's run `failed`, if the lease is still lapsed *now*: the
/// liveness check lives in the write, so a heartbeat that landed after
/// [`find_expired`] makes this a no-op. Status, `complete` event (seq
/// max+1, safe because the fence now shuts the worker out) and wake commit
/// together. Returns whether this call reaped the run.
pub async fn reap(pool: &PgPool, expired: Expired, grace: Duration) -> Result<bool, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let reaped: Option<(ConversationId, Option<String>)> = sqlx::query_as(
        "UPDATE agent_run SET status = 'failed', finished_at = now(),
                error = 'worker lost: lease expired without a heartbeat (worker ' || coalesce(worker_id, '?') || ')'
         WHERE id = $1 AND claim_token = $2 AND status = 'running'
           AND claim_expires_at < now() - make_interval(secs => $3)   -- still dead now?
         RETURNING conversation_id, error",
    )
    .bind(expired.id)
    .bind(expired.claim_token)
    .bind(secs(grace))
    .fetch_optional(&mut *tx)
    .await?;
    let Some((conversation_id, error)) = reaped else {
        return Ok(false);
    };
    write_complete(&mut tx, expired.id, RunStatus::Failed, error.as_deref()).await?;
    notify(&mut *tx, RUN_ENQUEUED, &conversation_id.to_string()).await?;
    notify(&mut *tx, &events_channel(expired.id), "complete").await?;
    tx.commit().await?;
    Ok(true)
}

/// The `complete` event written by a finalizer other than the claim holder:
/// seq is max(seq)+1, read in its own statement after the status flip locked
/// the row, so it sees every append that committed before the fence shut.
async fn write_complete(
    tx: &mut Transaction<'_, Postgres>,
    run: RunId,
    status: RunStatus,
    error: Option<&str>,
) -> Result<(), sqlx::Error> {
    let payload = match error {
        Some(e) => json!({ "status": status.as_str(), "error": e }),
        None => json!({ "status": status.as_str() }),
    };
    sqlx::query(
        "INSERT INTO run_event (run_id, seq, type, payload)
         SELECT $1, coalesce(max(seq), 0) + 1, 'complete', $2 FROM run_event WHERE run_id = $1",
    )
    .bind(run)
    .bind(payload)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// One run as its owner sees it; `None` when missing or someone else's.
pub async fn get_run(db: impl PgExecutor<'_>, id: RunId, owner_id: &str) -> Result<Option<RunView>, sqlx::Error> {
    sqlx::query_as(
        "SELECT r.id, r.conversation_id, r.status, r.plugin, r.plugin_digest, r.cancel_requested,
                r.error, r.created_at, r.started_at, r.finished_at,
                coalesce((SELECT max(seq) FROM run_event e WHERE e.run_id = r.id), 0) AS last_seq,
                r.usage
         FROM agent_run r WHERE r.id = $1 AND r.owner_id = $2",
    )
    .bind(id)
    .bind(owner_id)
    .fetch_optional(db)
    .await
}

/// A terminal run's (status, error, last seq in its journal); `None` while
/// the run is not terminal.
pub async fn terminal_state(
    db: impl PgExecutor<'_>,
    id: RunId,
) -> Result<Option<(RunStatus, Option<String>, i32)>, sqlx::Error> {
    let row: Option<(String, Option<String>, i32)> = sqlx::query_as(
        "SELECT r.status, r.error, coalesce((SELECT max(seq) FROM run_event e WHERE e.run_id = r.id), 0)
         FROM agent_run r WHERE r.id = $1 AND r.status IN ('completed', 'failed', 'cancelled')",
    )
    .bind(id)
    .fetch_optional(db)
    .await?;
    Ok(row.and_then(|(s, e, seq)| s.parse().ok().map(|s| (s, e, seq))))
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
/// oldest first: the most recent `limit` complete or partial messages.
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

/// One journal row, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct Event {
    pub seq: i32,
    #[sqlx(rename = "type")]
    #[serde(rename = "type")]
    pub kind: String,
    pub payload: Value,
}

/// Journal rows of a run after `after_seq`, in order, at most `limit`.
pub async fn events_after(
    db: impl PgExecutor<'_>,
    run: RunId,
    after_seq: i32,
    limit: i64,
) -> Result<Vec<Event>, sqlx::Error> {
    sqlx::query_as("SELECT seq, type, payload FROM run_event WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3")
        .bind(run)
        .bind(after_seq)
        .bind(limit)
        .fetch_all(db)
        .await
}

/// Retention: the journal is a delivery buffer. Deletes the events of up to
/// `batch_runs` runs terminal for longer than `older_than` and nulls their
/// request snapshots (the transcript in `message` stays). Returns how many
/// runs it trimmed; call again until it returns less than `batch_runs`.
pub async fn trim_terminal(db: impl PgExecutor<'_>, older_than: Duration, batch_runs: i64) -> Result<u64, sqlx::Error> {
    let trimmed: i64 = sqlx::query_scalar(
        "WITH victims AS (
             SELECT id FROM agent_run
             WHERE finished_at < now() - make_interval(secs => $1) AND request IS NOT NULL
             ORDER BY finished_at LIMIT $2
             FOR UPDATE SKIP LOCKED),
         del AS (DELETE FROM run_event e USING victims v WHERE e.run_id = v.id),
         upd AS (UPDATE agent_run r SET request = NULL FROM victims v WHERE r.id = v.id RETURNING r.id)
         SELECT count(*) FROM upd",
    )
    .bind(secs(older_than))
    .bind(batch_runs)
    .fetch_one(db)
    .await?;
    Ok(trimmed as u64)
}
