//! Stops: queued and waiting -> cancelled outright; running flagged for its holder.

use super::*;

/// What `cancel` found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cancelled {
    /// Queued: cancelled outright, its message handed back as a draft.
    Queued,
    /// Running: flagged and woken; the holder finalizes it `cancelled`.
    /// `first`: this cancel set the flag (a repeat re-flags and re-wakes).
    Flagged { first: bool },
    /// Waiting: cancelled outright, its streamed text kept as a partial answer.
    Waiting,
    /// Already terminal: nothing changed (its status and cancel flag).
    Terminal(RunStatus, bool),
}

/// A user message handed back by a stop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct Draft {
    pub message_id: MessageId,
    pub content: String,
}

/// What a conversation stop did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct Stopped {
    /// Queued runs, cancelled outright.
    pub cancelled: Vec<RunId>,
    /// Running runs, flagged: their holders are ending them.
    pub cancelling: Vec<RunId>,
    /// The cancelled runs' user messages, in conversation order.
    pub drafts: Vec<Draft>,
}

/// A run of one owner as a transition reads it, locked `FOR UPDATE` until
/// the caller's transaction ends.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(super) struct LockedRun {
    pub(super) status: RunStatus,
    pub(super) conversation_id: ConversationId,
    pub(super) user_message_id: MessageId,
    pub(super) cancel_requested: bool,
}

/// Locks run `run` of `owner_id`; `None` when missing or someone else's.
pub(super) async fn lock_owned_run(
    tx: &mut Transaction<'_, Postgres>,
    run: RunId,
    owner_id: &str,
) -> Result<Option<LockedRun>, sqlx::Error> {
    sqlx::query_as(
        "SELECT status, conversation_id, user_message_id, cancel_requested FROM agent_run
         WHERE id = $1 AND owner_id = $2 FOR UPDATE",
    )
    .bind(run)
    .bind(owner_id)
    .fetch_optional(&mut **tx)
    .await
}

/// For `POST /v1/runs/{id}/cancel`: cancels one run of `owner_id`; `None`
/// when missing or someone else's. queued -> cancelled outright (with its
/// `complete` and its message handed back as a draft); running: the stop
/// flag and the NOTIFY, and its holder ends it cancelled. Idempotent: a
/// second cancel of a running run re-flags and re-wakes.
pub async fn cancel(pool: &PgPool, run: RunId, owner_id: &str) -> Result<Option<Cancelled>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let Some(locked) = lock_owned_run(&mut tx, run, owner_id).await? else {
        return Ok(None);
    };
    let done = match locked.status {
        RunStatus::Queued => {
            cancel_queued(&mut tx, &[run]).await?;
            // It may have been its conversation's head: the next turn is free now.
            notify(&mut *tx, RUN_ENQUEUED, &locked.conversation_id.to_string()).await?;
            Cancelled::Queued
        }
        RunStatus::Running => {
            flag(&mut tx, &[run]).await?;
            Cancelled::Flagged { first: !locked.cancel_requested }
        }
        RunStatus::Waiting => {
            cancel_waiting(&mut tx, run).await?;
            notify(&mut *tx, RUN_ENQUEUED, &locked.conversation_id.to_string()).await?;
            Cancelled::Waiting
        }
        terminal => Cancelled::Terminal(terminal, locked.cancel_requested),
    };
    tx.commit().await?;
    Ok(Some(done))
}

/// For `POST /v1/conversations/{id}/stop`: stops a conversation of
/// `owner_id` in ONE transaction; `None` when missing or someone else's.
/// Every queued and running run is locked `FOR UPDATE`, queued ones first:
/// once they are locked no claim can take one (the claim skips locked rows,
/// and its head-of-conversation check still sees them queued), so the
/// terminal wake of a running turn that finishes mid-stop finds nothing to
/// start. queued -> cancelled with their `complete` events and drafts;
/// running ones are flagged and woken.
pub async fn stop_conversation(
    pool: &PgPool,
    conversation: ConversationId,
    owner_id: &str,
) -> Result<Option<Stopped>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    if !conversations::owned(&mut *tx, conversation, owner_id).await? {
        return Ok(None);
    }
    let stopped = stop_in(&mut tx, conversation).await?;
    tx.commit().await?;
    Ok(Some(stopped))
}

/// The body of [`stop_conversation`], in the caller's transaction.
pub(super) async fn stop_in(
    tx: &mut Transaction<'_, Postgres>,
    conversation: ConversationId,
) -> Result<Stopped, sqlx::Error> {
    // Rows are locked in the sorted order (LockRows sits above the Sort).
    let active: Vec<(RunId, RunStatus)> = sqlx::query_as(
        "SELECT id, status FROM agent_run
         WHERE conversation_id = $1 AND status IN ('queued', 'running', 'waiting')
         ORDER BY status <> 'queued', queue_pos
         FOR UPDATE",
    )
    .bind(conversation)
    .fetch_all(&mut **tx)
    .await?;
    let of = |status: RunStatus| active.iter().filter(move |(_, s)| *s == status).map(|(id, _)| *id);
    let (queued, running, waiting): (Vec<RunId>, Vec<RunId>, Vec<RunId>) =
        (of(RunStatus::Queued).collect(), of(RunStatus::Running).collect(), of(RunStatus::Waiting).collect());
    let drafts = cancel_queued(tx, &queued).await?;
    flag(tx, &running).await?;
    for run in &waiting {
        cancel_waiting(tx, *run).await?;
    }
    let cancelled = queued.into_iter().chain(waiting).collect();
    Ok(Stopped { cancelled, cancelling: running, drafts })
}
