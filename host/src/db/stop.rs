//! Stop means stop (the article's rung 8). The truth is `cancel_requested` on
//! the run row; a NOTIFY on [`RUN_CANCEL`] is the fast path that wakes
//! the holder at once, and its heartbeat re-reads the flag in case the hint is
//! lost. A queued run never started: it is cancelled outright and its user
//! message handed back as a draft.

use serde::Serialize;
use sqlx::{PgExecutor, PgPool, Postgres, Transaction};

use super::notify::{events_channel, notify, RUN_CANCEL, RUN_ENQUEUED};
use super::{ClaimToken, ConversationId, MessageId, RunId, RunStatus};


/// What `cancel` found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cancelled {
    /// Queued: cancelled outright, its message handed back as a draft.
    Queued,
    /// Running: flagged and woken; the holder finalizes it `cancelled`.
    Flagged,
    /// Already terminal: nothing changed (its status and cancel flag).
    Terminal(RunStatus, bool),
}

/// A user message handed back by a stop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Draft {
    pub message_id: MessageId,
    pub content: String,
}

/// What a conversation stop did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Stopped {
    /// Queued runs, cancelled outright.
    pub cancelled: Vec<RunId>,
    /// Running runs, flagged: their holders are ending them.
    pub cancelling: Vec<RunId>,
    /// The cancelled runs' user messages, in conversation order.
    pub drafts: Vec<Draft>,
}

/// Cancels one run of `owner_id`; `None` when missing or someone else's.
/// Idempotent: a second cancel of a running run re-flags and re-wakes.
pub async fn cancel(pool: &PgPool, run: RunId, owner_id: &str) -> Result<Option<Cancelled>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let row: Option<(String, ConversationId, bool)> = sqlx::query_as(
        "SELECT status, conversation_id, cancel_requested FROM agent_run WHERE id = $1 AND owner_id = $2 FOR UPDATE",
    )
    .bind(run)
    .bind(owner_id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((status, conversation, flagged)) = row else {
        return Ok(None);
    };
    let status: RunStatus = status.parse().map_err(|e: String| sqlx::Error::Decode(e.into()))?;
    let done = match status {
        RunStatus::Queued => {
            cancel_queued(&mut tx, &[run]).await?;
            // It may have been its conversation's head: the next turn is free now.
            notify(&mut *tx, RUN_ENQUEUED, &conversation.to_string()).await?;
            Cancelled::Queued
        }
        RunStatus::Running => {
            flag(&mut tx, &[run]).await?;
            Cancelled::Flagged
        }
        terminal => Cancelled::Terminal(terminal, flagged),
    };
    tx.commit().await?;
    Ok(Some(done))
}

/// Stops a conversation of `owner_id` in ONE transaction; `None` when missing
/// or someone else's. Every queued and running run is locked `FOR UPDATE`,
/// queued ones first: once they are locked no claim can take one (the claim
/// skips locked rows, and its head-of-conversation check still sees them
/// queued), so the terminal wake of a running turn that finishes mid-stop
/// finds nothing to start. Queued runs are cancelled with their `complete`
/// event and drafts; running ones are flagged and woken.
pub async fn stop_conversation(
    pool: &PgPool,
    conversation: ConversationId,
    owner_id: &str,
) -> Result<Option<Stopped>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let owned: Option<i32> = sqlx::query_scalar("SELECT 1 FROM conversation WHERE id = $1 AND owner_id = $2")
        .bind(conversation)
        .bind(owner_id)
        .fetch_optional(&mut *tx)
        .await?;
    if owned.is_none() {
        return Ok(None);
    }
    // Rows are locked in the sorted order (LockRows sits above the Sort).
    let active: Vec<(RunId, String)> = sqlx::query_as(
        "SELECT id, status FROM agent_run
         WHERE conversation_id = $1 AND status IN ('queued', 'running')
         ORDER BY status = 'running', queue_pos
         FOR UPDATE",
    )
    .bind(conversation)
    .fetch_all(&mut *tx)
    .await?;
    let (queued, running): (Vec<_>, Vec<_>) = active.into_iter().partition(|(_, s)| s == "queued");
    let queued: Vec<RunId> = queued.into_iter().map(|(id, _)| id).collect();
    let running: Vec<RunId> = running.into_iter().map(|(id, _)| id).collect();
    let drafts = cancel_queued(&mut tx, &queued).await?;
    flag(&mut tx, &running).await?;
    tx.commit().await?;
    Ok(Some(Stopped { cancelled: queued, cancelling: running, drafts }))
}

/// Cancels queued runs outright (status, `complete` event, draft message,
/// tails told), in the caller's transaction, which holds their row locks.
async fn cancel_queued(tx: &mut Transaction<'_, Postgres>, runs: &[RunId]) -> Result<Vec<Draft>, sqlx::Error> {
    if runs.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<uuid::Uuid> = runs.iter().map(|r| r.0).collect();
    // No one else writes a queued run's journal, so max(seq)+1 is safe.
    let drafts: Vec<(MessageId, String)> = sqlx::query_as(
        "WITH r AS (
             UPDATE agent_run SET status = 'cancelled', cancel_requested = true, finished_at = now()
             WHERE id = ANY($1) AND status = 'queued'
             RETURNING id, user_message_id, queue_pos
         ),
         ev AS (
             INSERT INTO run_event (run_id, seq, type, payload)
             SELECT r.id, (SELECT coalesce(max(seq), 0) + 1 FROM run_event e WHERE e.run_id = r.id),
                    'complete', '{\"status\": \"cancelled\"}'::jsonb
             FROM r
         ),
         m AS (
             UPDATE message SET status = 'draft' FROM r
             WHERE message.id = r.user_message_id
             RETURNING message.id, message.content, r.queue_pos
         )
         SELECT id, content FROM m ORDER BY queue_pos",
    )
    .bind(&ids)
    .fetch_all(&mut **tx)
    .await?;
    for run in runs {
        notify(&mut **tx, &events_channel(*run), "complete").await?;
    }
    Ok(drafts.into_iter().map(|(message_id, content)| Draft { message_id, content }).collect())
}

/// Flags running runs and wakes their holders, in the caller's transaction.
async fn flag(tx: &mut Transaction<'_, Postgres>, runs: &[RunId]) -> Result<(), sqlx::Error> {
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

/// Of the runs a process holds, those with a stop requested (the row is the
/// truth a cancel NOTIFY only hints at).
pub async fn cancel_requested(
    db: impl PgExecutor<'_>,
    held: &[(RunId, ClaimToken)],
) -> Result<Vec<RunId>, sqlx::Error> {
    let ids: Vec<uuid::Uuid> = held.iter().map(|(r, _)| r.0).collect();
    let tokens: Vec<uuid::Uuid> = held.iter().map(|(_, t)| t.0).collect();
    sqlx::query_scalar(
        "SELECT r.id FROM agent_run r JOIN unnest($1::uuid[], $2::uuid[]) AS h(id, token)
             ON r.id = h.id AND r.claim_token = h.token
         WHERE r.status = 'running' AND r.cancel_requested",
    )
    .bind(ids)
    .bind(tokens)
    .fetch_all(db)
    .await
}
