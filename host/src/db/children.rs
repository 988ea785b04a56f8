//! Sub-agents' rows: a run's child runs (`agent_run.parent_run_id`), as
//! its agent starts, counts and awaits them, as `GET /v1/runs/{id}` lists
//! them, and as a stop reaches them. A child's status changes are the
//! lifecycle's like any run's; a waiting parent is woken by the ending of
//! the child that joins its await, in that ending's transaction (the
//! schema's trigger `agent_run_child_ended`, `migrations/0021_subagents.sql`).

use serde::Serialize;
use sqlx::{PgExecutor, PgPool};

use super::{ConversationId, RunId, RunStatus};

/// A child as its parent's agent sees it when it awaits it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct Child {
    pub run_id: RunId,
    pub plugin: String,
    pub conversation_id: ConversationId,
    pub status: RunStatus,
    /// Its answer once completed (its partial text once failed or
    /// cancelled, when it streamed any).
    pub output: Option<String>,
    pub error: Option<String>,
}

impl Child {
    pub fn ended(&self) -> bool {
        self.status.is_terminal()
    }
}

/// The child runs one parent started so far, and how many are active, and
/// the parent's depth (0 for a run nobody's agent started).
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct Census {
    pub started: i64,
    pub active: i64,
    pub depth: i16,
}

/// The child `parent` started with its tool call `call`, if it did: a
/// re-issued start finds it instead of starting another.
pub async fn started_by(
    db: impl PgExecutor<'_>,
    parent: RunId,
    call: i32,
) -> Result<Option<(RunId, ConversationId)>, sqlx::Error> {
    sqlx::query_as("SELECT id, conversation_id FROM agent_run WHERE parent_run_id = $1 AND parent_call = $2")
        .bind(parent)
        .bind(call)
        .fetch_optional(db)
        .await
}

/// `parent`'s [`Census`].
pub async fn census(db: impl PgExecutor<'_>, parent: RunId) -> Result<Census, sqlx::Error> {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM agent_run WHERE parent_run_id = $1) AS started,
                (SELECT count(*) FROM agent_run WHERE parent_run_id = $1
                   AND status IN ('queued', 'running', 'waiting')) AS active,
                (SELECT depth FROM agent_run WHERE id = $1) AS depth",
    )
    .bind(parent)
    .fetch_one(db)
    .await
}

/// The children of `parent` among `runs` (every child when `runs` is
/// empty), in the order they were started, with their answers.
pub async fn of(db: impl PgExecutor<'_>, parent: RunId, runs: &[RunId]) -> Result<Vec<Child>, sqlx::Error> {
    sqlx::query_as(
        "SELECT r.id AS run_id, r.plugin, r.conversation_id, r.status, r.error,
                (SELECT m.content FROM message m WHERE m.run_id = r.id AND m.role = 'assistant'
                 ORDER BY m.created_at DESC LIMIT 1) AS output
         FROM agent_run r
         WHERE r.parent_run_id = $1 AND (cardinality($2::uuid[]) = 0 OR r.id = ANY($2))
         ORDER BY r.parent_call",
    )
    .bind(parent)
    .bind(runs.iter().map(|r| r.0).collect::<Vec<_>>())
    .fetch_all(db)
    .await
}

/// Active children whose parent was stopped (cancelled, or flagged), at
/// most `limit`, with their owners: the stop reaches them (see [`stop`]).
pub async fn of_stopped(db: impl PgExecutor<'_>, limit: i64) -> Result<Vec<(RunId, String)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT c.id, c.owner_id FROM agent_run c JOIN agent_run p ON p.id = c.parent_run_id
         WHERE c.parent_run_id IS NOT NULL AND c.status IN ('queued', 'running', 'waiting')
           AND NOT c.cancel_requested AND (p.status = 'cancelled' OR p.cancel_requested)
         LIMIT $1",
    )
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Stops the active descendants of `parents` (a stop of a parent reaches
/// its children, and theirs), each as `POST /v1/runs/{id}/cancel` stops a
/// run: queued and waiting ones cancelled, running ones flagged (their
/// partial text kept). One transaction per child, after the parent's stop
/// committed: a child's ending locks its parent, so a stop holding the
/// parent must not wait for a child. The waiting runs' scheduler sweeps
/// what a crash between the two left ([`of_stopped`]). Returns the runs
/// stopped.
pub async fn stop(pool: &PgPool, parents: &[RunId]) -> Result<Vec<RunId>, sqlx::Error> {
    let mut stopped = Vec::new();
    let mut level: Vec<RunId> = parents.to_vec();
    // Bounded by the deepest tree (the schema's depth check).
    for _ in 0..=16 {
        if level.is_empty() {
            break;
        }
        let children: Vec<(RunId, String)> = sqlx::query_as(
            "SELECT id, owner_id FROM agent_run
             WHERE parent_run_id = ANY($1) AND status IN ('queued', 'running', 'waiting')",
        )
        .bind(level.iter().map(|r| r.0).collect::<Vec<_>>())
        .fetch_all(pool)
        .await?;
        level = Vec::with_capacity(children.len());
        for (child, owner) in children {
            super::lifecycle::cancel(pool, child, &owner).await?;
            stopped.push(child);
            level.push(child);
        }
    }
    Ok(stopped)
}
