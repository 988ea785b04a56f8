//! The reaper: on every process, not a singleton. Ends runs whose lease lapsed
//! more than the grace ago; each reap re-checks the lapse in its own write, so
//! a worker that came back (its heartbeat landed) is never reaped.

use sqlx::PgPool;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::db;
use crate::db::lifecycle::Reaped;

use super::{Shared, WorkerConfig, WorkerStats, REAP_BATCH_MAX};

pub(super) async fn run(shared: Arc<Shared>) {
    // The boot sweep already ran: skip the first tick.
    super::every(&shared, shared.config.reap_interval, true, || async {
        if let Err(e) = sweep(&shared.pool, &shared.config, &shared.stats).await {
            tracing::warn!(error = %e, "reap sweep failed");
        }
    })
    .await;
}

/// One pass: read the orphans, then reap each with the liveness re-check in
/// the write: a resumable run with attempts left goes back to the queue, any
/// other ends failed. Returns how many runs this pass ended or requeued.
pub async fn sweep(pool: &PgPool, config: &WorkerConfig, stats: &WorkerStats) -> Result<usize, sqlx::Error> {
    let (grace, attempts) = (config.reap_grace, config.resume_attempts);
    let mut reaped = 0;
    for expired in db::lifecycle::find_expired(pool, grace, REAP_BATCH_MAX).await? {
        match db::lifecycle::reap_or_resume(pool, expired, grace, attempts).await? {
            None => continue,
            Some(Reaped::Requeued { attempt }) => {
                tracing::warn!(run_id = %expired.id, attempt, "worker lost: resumable run back in the queue");
                stats.requeued.fetch_add(1, Ordering::Relaxed);
            }
            Some(Reaped::Ended(status, reason)) => {
                tracing::warn!(run_id = %expired.id, %status, %reason, "reaped: worker lost, run ended");
                stats.reaped.fetch_add(1, Ordering::Relaxed);
                let failed = status == crate::db::RunStatus::Failed;
                stats.record_end(status, failed.then_some(reason));
            }
        }
        reaped += 1;
    }
    Ok(reaped)
}
