//! (none) -> queued, with a strategy for a busy conversation, under the tenant's queue quota.

use super::*;

/// What an enqueue does when its conversation already has an active turn
/// (queued, running or waiting).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Busy {
    /// Queue behind it (the default).
    #[default]
    Enqueue,
    /// Refuse: nothing is enqueued.
    Reject,
    /// Stop it as a conversation stop does (running turns flagged, their
    /// partial text kept; queued and waiting ones cancelled) and run this
    /// one next: in one transaction, so nothing else starts in between.
    Interrupt,
    /// Steer it: the message becomes an instruction its turn takes at its
    /// next host-call boundary ([`crate::db::steer::queue_busy`]), and no run
    /// is enqueued; with no active turn, enqueue as `enqueue` does.
    Steer,
}

#[derive(Debug, thiserror::Error)]
pub enum StrategyError {
    /// `reject`, and the conversation's active turn is this run.
    #[error("the conversation has an active turn, run {0}")]
    Busy(RunId),
    #[error(transparent)]
    Enqueue(#[from] crate::db::enqueue::EnqueueError),
    /// The tenant has `max` queued runs, its quota; nothing was written.
    #[error("the tenant has {max} queued runs, its quota")]
    QueueFull { max: u32 },
}

impl From<sqlx::Error> for StrategyError {
    fn from(e: sqlx::Error) -> Self {
        StrategyError::Enqueue(e.into())
    }
}

/// Enqueue (see [`crate::db::enqueue::enqueue`]) with a strategy for a busy
/// conversation. `reject` and `interrupt` lock the conversation row first, so
/// two of them serialise and an enqueue racing them queues behind. With
/// `eager`, the run may start in the enqueue's statement
/// ([`Eager`]): then it comes back as claimed.
pub async fn enqueue_with(
    pool: &PgPool,
    new: &crate::db::enqueue::NewRun<'_>,
    strategy: Busy,
    tenant_max_queued: Option<u32>,
    eager: Option<&Eager<'_>>,
) -> Result<(Enqueued, Option<ClaimedRun>), StrategyError> {
    // Queueing behind a busy turn with no quota to count needs no lock and no
    // read first: the enqueue's one statement is the whole transaction (a
    // used idempotency key fails it on its index, as below).
    if matches!(strategy, Busy::Enqueue | Busy::Steer) && tenant_max_queued.is_none() {
        return Ok(match eager {
            Some(eager) => enqueue_eager(pool, new, eager).await?,
            None => (crate::db::enqueue::enqueue(pool, new).await?, None),
        });
    }
    let mut tx = pool.begin().await?;
    // A retry of a request already enqueued is answered as its first was
    // (the enqueue below hits the key): the strategy must not refuse or
    // stop its own run.
    // A steer reaches here only when there was no turn to steer.
    let mut strategy = if strategy == Busy::Steer { Busy::Enqueue } else { strategy };
    let mut replay = false;
    if let Some(key) = new.idempotency_key {
        let used: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM agent_run WHERE owner_id = $1 AND idempotency_key = $2)")
                .bind(&new.owner.user_id)
                .bind(key)
                .fetch_one(&mut *tx)
                .await?;
        if used {
            strategy = Busy::Enqueue;
        }
        replay = used;
    }
    // The tenant's queue lock first, before any row lock (the Reject and
    // Interrupt paths lock the conversation; a retry takes it first too), so
    // every path takes the two in one order.
    let quota = tenant_max_queued.filter(|_| !replay);
    if quota.is_some() {
        lock_tenant_queue(&mut tx, &new.owner.tenant_id).await?;
    }
    if let (Some(conversation), Busy::Reject | Busy::Interrupt) = (new.conversation_id, strategy) {
        let owned: Option<bool> = sqlx::query_scalar("SELECT owner_id = $2 FROM conversation WHERE id = $1 FOR UPDATE")
            .bind(conversation)
            .bind(&new.owner.user_id)
            .fetch_optional(&mut *tx)
            .await?;
        if owned != Some(true) {
            return Err(crate::db::enqueue::EnqueueError::ConversationNotFound(conversation).into());
        }
        if strategy == Busy::Reject {
            let active: Option<RunId> = sqlx::query_scalar(
                "SELECT id FROM agent_run WHERE conversation_id = $1 AND status IN ('queued', 'running', 'waiting')
                 ORDER BY queue_pos LIMIT 1",
            )
            .bind(conversation)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(run) = active {
                return Err(StrategyError::Busy(run));
            }
        } else {
            stop_in(&mut tx, conversation).await?;
        }
    }
    // The tenant's queue quota: counted under the per-tenant lock taken
    // above and held to the commit, so concurrent enqueues (in any process)
    // cannot both take the last place; a refusal rolls back, writing
    // nothing. A replay is answered as its first request was.
    if let Some(max) = quota {
        if !queue_has_room(&mut tx, &new.owner.tenant_id, max).await? {
            return Err(StrategyError::QueueFull { max });
        }
    }
    let enqueued = match eager {
        Some(eager) => enqueue_eager_in(&mut tx, new, eager).await?,
        None => (crate::db::enqueue::enqueue_in(&mut tx, new).await?, None),
    };
    tx.commit().await?;
    Ok(enqueued)
}

/// Takes the tenant's queue lock (to the commit): the queue quota is
/// counted under it.
pub(super) async fn lock_tenant_queue(tx: &mut Transaction<'_, Postgres>, tenant: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('agent_run.queued:' || $1, 0))")
        .bind(tenant)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Whether the tenant has fewer than `max` queued runs (ask under its queue lock).
pub(super) async fn queue_has_room(
    tx: &mut Transaction<'_, Postgres>,
    tenant: &str,
    max: u32,
) -> Result<bool, sqlx::Error> {
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE tenant_id = $1 AND status = 'queued'")
        .bind(tenant)
        .fetch_one(&mut **tx)
        .await?;
    Ok(queued < i64::from(max))
}

/// queued -> cancelled, for [`cancel`] and [`stop_conversation`]: status,
/// `finished_at`, the `complete` event, the draft message, tails told; in the
/// caller's transaction, which holds the rows' locks.
pub(super) async fn cancel_queued(
    tx: &mut Transaction<'_, Postgres>,
    runs: &[RunId],
) -> Result<Vec<Draft>, sqlx::Error> {
    if runs.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<uuid::Uuid> = runs.iter().map(|r| r.0).collect();
    // A queued run that had started (handed back, or decided after a wait)
    // keeps the text it streamed as a partial answer, as a running one does.
    let started: Vec<(RunId, ConversationId)> = sqlx::query_as(
        "SELECT id, conversation_id FROM agent_run WHERE id = ANY($1) AND status = 'queued' AND attempt > 1",
    )
    .bind(&ids)
    .fetch_all(&mut **tx)
    .await?;
    for (run, conversation) in started {
        keep_partial(tx, run, conversation).await?;
    }
    // No one else writes a queued run's journal, so max(seq)+1 is safe.
    let drafts: Vec<(MessageId, String)> = sqlx::query_as(
        "WITH r AS (
             UPDATE agent_run SET status = 'cancelled', cancel_requested = true, finished_at = clock_timestamp()
             WHERE id = ANY($1) AND status = 'queued'
             RETURNING id, user_message_id, queue_pos, attempt
         ),
         ev AS (
             INSERT INTO run_event (run_id, seq, type, payload)
             SELECT r.id, (SELECT coalesce(max(seq), 0) + 1 FROM run_event e WHERE e.run_id = r.id), $2, $3
             FROM r
         ),
         -- A handed-back run (attempt > 1) had started: its message stays
         -- complete and is no draft.
         m AS (
             UPDATE message SET status = $4 FROM r
             WHERE message.id = r.user_message_id AND r.attempt = 1
             RETURNING message.id, message.content, r.queue_pos
         )
         SELECT id, content FROM m ORDER BY queue_pos",
    )
    .bind(&ids)
    .bind(COMPLETE)
    .bind(complete_payload(RunStatus::Cancelled, None))
    .bind(MessageStatus::Draft)
    .fetch_all(&mut **tx)
    .await?;
    for run in runs {
        notify(&mut **tx, &events_channel(*run), COMPLETE_PAYLOAD).await?;
    }
    Ok(drafts.into_iter().map(|(message_id, content)| Draft { message_id, content }).collect())
}

/// A run nobody holds, ended by a stop: the text it streamed (as a client
/// holds it, rollbacks applied) kept as its partial answer, if any.
pub(super) async fn keep_partial(
    tx: &mut Transaction<'_, Postgres>,
    run: RunId,
    conversation: ConversationId,
) -> Result<(), sqlx::Error> {
    let text: String = crate::db::calls::journaled(&mut **tx, run).await?.deltas.into_iter().map(|(_, t)| t).collect();
    if !text.is_empty() {
        sqlx::query(
            "INSERT INTO message (id, conversation_id, run_id, role, content, status)
             VALUES ($1, $2, $3, 'assistant', $4, $5)",
        )
        .bind(MessageId::new())
        .bind(conversation)
        .bind(run)
        .bind(&text)
        .bind(MessageStatus::Partial)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

/// waiting -> cancelled, for [`cancel`] and [`stop_conversation`], in the
/// caller's transaction (which holds the row's lock; no one holds the run):
/// status, `finished_at`, the `complete` event, the text it had streamed kept
/// as a partial answer (as a client holds it, rollbacks applied), tails told.
pub(super) async fn cancel_waiting(tx: &mut Transaction<'_, Postgres>, run: RunId) -> Result<(), sqlx::Error> {
    let conversation: ConversationId = sqlx::query_scalar(
        "UPDATE agent_run SET status = 'cancelled', cancel_requested = true, finished_at = clock_timestamp()
         WHERE id = $1 AND status = 'waiting' RETURNING conversation_id",
    )
    .bind(run)
    .fetch_one(&mut **tx)
    .await?;
    keep_partial(tx, run, conversation).await?;
    write_complete(&mut **tx, run, RunStatus::Cancelled, None).await?;
    notify(&mut **tx, &events_channel(run), COMPLETE_PAYLOAD).await
}

/// The stop flag (no status change): flags running runs and wakes their
/// holders over [`RUN_CANCEL`], in the caller's transaction. The holder's
/// heartbeat and canceller re-read the flag in case the NOTIFY is lost.
pub(super) async fn flag(tx: &mut Transaction<'_, Postgres>, runs: &[RunId]) -> Result<(), sqlx::Error> {
    if runs.is_empty() {
        return Ok(());
    }
    let ids: Vec<uuid::Uuid> = runs.iter().map(|r| r.0).collect();
    sqlx::query(
        "WITH f AS (UPDATE agent_run SET cancel_requested = true WHERE id = ANY($1) AND status = 'running' RETURNING id)
         SELECT pg_notify($2, id::text) FROM f",
    )
    .bind(&ids)
    .bind(RUN_CANCEL)
    .execute(&mut **tx)
    .await?;
    Ok(())
}
