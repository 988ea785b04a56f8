//! The waiting runs' scheduler, on every process: waiting runs whose time
//! came (an approval's timeout, a durable wait's end) go back to the queue,
//! on the reaper's interval. One query a pass, no timer held per run: a
//! waiting run holds nothing, and any process may wake it. The same pass
//! stops the active children of stopped parents (sub-agents) that the
//! stop's own cascade left, after a crash.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::db;

use super::{Shared, REAP_BATCH_MAX};

pub(super) async fn run(shared: Arc<Shared>) {
    super::every(&shared, shared.config.reap_interval, false, || async {
        match db::suspensions::wake_due(&shared.pool, REAP_BATCH_MAX).await {
            Ok(woken) => {
                shared.stats.woken.fetch_add(woken.len() as u64, Ordering::Relaxed);
                for run in woken {
                    tracing::info!(run_id = %run, "a waiting run's time came: back in the queue");
                }
            }
            Err(e) => tracing::warn!(error = %e, "waking due suspensions failed"),
        }
        // A stop reaches a stopped parent's children (what a crash between
        // the parent's stop and the children's left).
        match db::children::of_stopped(&shared.pool, REAP_BATCH_MAX).await {
            Ok(orphans) => {
                for (run, owner) in orphans {
                    match db::lifecycle::cancel(&shared.pool, run, &owner).await {
                        Ok(_) => tracing::info!(run_id = %run, "a stopped parent's child run stopped"),
                        Err(e) => tracing::warn!(run_id = %run, error = %e, "stopping a child run failed"),
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "reading a stopped parent's child runs failed"),
        }
    })
    .await;
}
