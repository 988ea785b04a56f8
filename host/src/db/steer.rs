//! Steering (`run_steer`, `migrations/0020_steer.sql`): instructions queued
//! for a turn, taken by its guest at a host-call boundary. The API queues
//! ([`queue`], and the busy strategy `steer` in its enqueue's transaction);
//! the run's claim holder announces and takes them ([`announce`], [`take`]),
//! each statement fenced by its claim token, since only it writes the run's
//! journal.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgExecutor, PgPool, Postgres, Transaction};

use super::notify::{notify, RUN_STEER};
use super::{ClaimToken, RunId, RunStatus};

/// Instructions one run takes at most (queued over its life, by any means).
pub const STEERS_MAX: i64 = 32;

/// One queued instruction, as `GET /v1/runs/{id}/steers` shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, schemars::JsonSchema)]
pub struct SteerView {
    pub id: i64,
    pub run_id: RunId,
    pub content: String,
    /// `api` (`POST /v1/runs/{id}/steer`) or `busy` (a message sent to the
    /// busy conversation with the multitask strategy `steer`).
    pub source: String,
    pub created_at: DateTime<Utc>,
    /// When the run's worker journaled it (`steer_received`); null before.
    pub announced_at: Option<DateTime<Utc>>,
    /// When the guest took it (`steer_taken`); null while queued.
    pub taken_at: Option<DateTime<Utc>>,
}

/// Why an instruction was not queued.
#[derive(Debug, thiserror::Error)]
pub enum SteerError {
    #[error("run not found")]
    NotFound,
    /// The run has ended: there is no turn to steer.
    #[error("run {0} has ended ({1}); there is no turn to steer")]
    Ended(RunId, RunStatus),
    #[error("run {0} has {STEERS_MAX} instructions, the most a run takes")]
    Full(RunId),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Queues `content` for run `run` of `owner_id` (`POST /v1/runs/{id}/steer`).
pub async fn queue(pool: &PgPool, run: RunId, owner_id: &str, content: &str) -> Result<SteerView, SteerError> {
    let mut tx = pool.begin().await?;
    let status: Option<RunStatus> =
        sqlx::query_scalar("SELECT status FROM agent_run WHERE id = $1 AND owner_id = $2 FOR NO KEY UPDATE")
            .bind(run)
            .bind(owner_id)
            .fetch_optional(&mut *tx)
            .await?;
    let status = status.ok_or(SteerError::NotFound)?;
    if status.is_terminal() {
        return Err(SteerError::Ended(run, status));
    }
    let steer = queue_in(&mut tx, run, content, "api").await?;
    tx.commit().await?;
    Ok(steer)
}

/// The multitask strategy `steer`: `content`, sent to conversation
/// `conversation` of `owner_id`, becomes an instruction for its active turn
/// (running, queued or waiting; the head of its queue). `None`: the
/// conversation has no active turn (the caller enqueues a run instead), or
/// is not theirs (the enqueue refuses it).
pub async fn queue_busy(
    pool: &PgPool,
    conversation: super::ConversationId,
    owner_id: &str,
    content: &str,
) -> Result<Option<SteerView>, SteerError> {
    let mut tx = pool.begin().await?;
    // The conversation's row first, as the other strategies lock it: an
    // enqueue racing this one queues behind or is steered, never both lost.
    let owned: Option<bool> = sqlx::query_scalar("SELECT owner_id = $2 FROM conversation WHERE id = $1 FOR UPDATE")
        .bind(conversation)
        .bind(owner_id)
        .fetch_optional(&mut *tx)
        .await?;
    if owned != Some(true) {
        return Ok(None);
    }
    let active: Option<RunId> = sqlx::query_scalar(
        "SELECT id FROM agent_run WHERE conversation_id = $1 AND status IN ('queued', 'running', 'waiting')
         ORDER BY queue_pos LIMIT 1 FOR NO KEY UPDATE",
    )
    .bind(conversation)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(run) = active else { return Ok(None) };
    let steer = queue_in(&mut tx, run, content, "busy").await?;
    tx.commit().await?;
    Ok(Some(steer))
}

/// Queues `content` for `run`, locked by the caller, and tells its holder
/// (NOTIFY on commit): at most [`STEERS_MAX`] per run.
pub async fn queue_in(
    tx: &mut Transaction<'_, Postgres>,
    run: RunId,
    content: &str,
    source: &str,
) -> Result<SteerView, SteerError> {
    let queued: i64 =
        sqlx::query_scalar("SELECT count(*) FROM run_steer WHERE run_id = $1").bind(run).fetch_one(&mut **tx).await?;
    if queued >= STEERS_MAX {
        return Err(SteerError::Full(run));
    }
    let steer: SteerView = sqlx::query_as(
        "INSERT INTO run_steer (run_id, content, source) VALUES ($1, $2, $3)
         RETURNING id, run_id, content, source, created_at, announced_at, taken_at",
    )
    .bind(run)
    .bind(content)
    .bind(source)
    .fetch_one(&mut **tx)
    .await?;
    notify(&mut **tx, RUN_STEER, &run.to_string()).await?;
    Ok(steer)
}

/// The instructions of run `run` of `owner_id`, oldest first (`None`: no
/// such run of theirs).
pub async fn list(db: &PgPool, run: RunId, owner_id: &str) -> Result<Option<Vec<SteerView>>, sqlx::Error> {
    let owned: Option<bool> = sqlx::query_scalar("SELECT true FROM agent_run WHERE id = $1 AND owner_id = $2")
        .bind(run)
        .bind(owner_id)
        .fetch_optional(db)
        .await?;
    if owned.is_none() {
        return Ok(None);
    }
    let rows = sqlx::query_as(
        "SELECT id, run_id, content, source, created_at, announced_at, taken_at
         FROM run_steer WHERE run_id = $1 ORDER BY id",
    )
    .bind(run)
    .fetch_all(db)
    .await?;
    Ok(Some(rows))
}

/// An instruction as its run's holder marks it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Marked {
    pub id: i64,
    pub content: String,
    pub created_at: DateTime<Utc>,
    /// Not announced before this statement: the holder journals `steer_received`.
    pub unannounced: bool,
}

/// Marks the run's instructions not yet announced as announced (fenced:
/// nothing unless `token` still holds the run); the holder journals them.
pub async fn announce(db: impl PgExecutor<'_>, run: RunId, token: ClaimToken) -> Result<Vec<Marked>, sqlx::Error> {
    let mut rows: Vec<Marked> = sqlx::query_as(
        "UPDATE run_steer s SET announced_at = now()
         FROM agent_run r
         WHERE r.id = $1 AND r.claim_token = $2 AND s.run_id = r.id AND s.announced_at IS NULL
         RETURNING s.id, s.content, s.created_at, true AS unannounced",
    )
    .bind(run)
    .bind(token)
    .fetch_all(db)
    .await?;
    rows.sort_by_key(|m| m.id);
    Ok(rows)
}

/// Takes the run's queued instructions (fenced), oldest first, at call-log
/// `position` (`None`: a run that records nothing). A take at a position
/// also takes again what an earlier attempt took there (its reading never
/// reached the log), so a resumed run takes the same instructions at the
/// same point.
pub async fn take(
    db: impl PgExecutor<'_>,
    run: RunId,
    token: ClaimToken,
    position: Option<i32>,
) -> Result<Vec<Marked>, sqlx::Error> {
    let mut rows: Vec<Marked> = sqlx::query_as(
        "WITH picked AS (
             SELECT s.id, s.announced_at IS NULL AS unannounced
             FROM run_steer s JOIN agent_run r ON r.id = s.run_id AND r.claim_token = $2
             WHERE s.run_id = $1
               AND (s.taken_at IS NULL OR ($3::integer IS NOT NULL AND s.taken_position = $3))
             ORDER BY s.id
             FOR UPDATE OF s)
         UPDATE run_steer s SET announced_at = coalesce(s.announced_at, now()), taken_at = now(),
                                taken_position = $3
         FROM picked p WHERE s.id = p.id
         RETURNING s.id, s.content, s.created_at, p.unannounced",
    )
    .bind(run)
    .bind(token)
    .bind(position)
    .fetch_all(db)
    .await?;
    rows.sort_by_key(|m| m.id);
    Ok(rows)
}
