//! Retention, on every process: trims the journal of runs terminal for longer
//! than the retention (24 h by default) in bounded batches, and nulls their
//! request snapshots. Tails of trimmed runs still end with the run's state.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::db;

use super::Shared;

/// Runs trimmed per statement.
const BATCH_RUNS: i64 = 100;
/// Statements per pass; the next pass takes the rest.
const BATCHES_PER_PASS_MAX: usize = 50;

pub(super) async fn run(shared: Arc<Shared>) {
    super::every(&shared, shared.config.retention_interval, false, || pass(&shared)).await;
}

async fn pass(shared: &Shared) {
    for _ in 0..BATCHES_PER_PASS_MAX {
        match db::journal::trim_terminal(&shared.pool, shared.config.retention, BATCH_RUNS).await {
            Ok(n) => {
                shared.stats.trimmed.fetch_add(n, Ordering::Relaxed);
                if (n as i64) < BATCH_RUNS {
                    return;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "retention pass failed");
                return;
            }
        }
    }
}
