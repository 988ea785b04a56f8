//! The reaper: on every process, not a singleton. Ends runs whose lease lapsed
//! more than the grace ago; each reap re-checks the lapse in its own write, so
//! a worker that came back (its heartbeat landed) is never reaped.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use crate::db;

use super::{Shared, WorkerStats, REAP_BATCH_MAX};

pub(super) async fn run(shared: Arc<Shared>) {
    // The boot sweep already ran: skip the first tick.
    super::every(&shared, shared.config.reap_interval, true, || async {
        if let Err(e) = sweep(&shared.pool, shared.config.reap_grace, &shared.stats).await {
            tracing::warn!(error = %e, "reap sweep failed");
        }
    })
    .await;
}

/// One pass: read the orphans, then reap each with the liveness re-check in
/// the write. Returns how many runs this pass ended.
pub async fn sweep(pool: &PgPool, grace: Duration, stats: &WorkerStats) -> Result<usize, sqlx::Error> {
    let mut reaped = 0;
    for expired in db::lifecycle::find_expired(pool, grace, REAP_BATCH_MAX).await? {
        if db::lifecycle::reap(pool, expired, grace).await? {
            tracing::warn!(run_id = %expired.id, "reaped: worker lost, run ended failed");
            reaped += 1;
            stats.record_end(crate::db::RunStatus::Failed, Some(crate::error::FailReason::WorkerLost));
        }
    }
    stats.reaped.fetch_add(reaped as u64, Ordering::Relaxed);
    Ok(reaped)
}
