//! The schedules' firing loop, on every process: due schedules are fired
//! once each (`service::schedules::fire_due`; the row lock and the firing's
//! idempotency key make it one run per firing however many processes fire).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::Shared;

pub(super) async fn run(shared: Arc<Shared>) {
    let tick = shared.config.schedule_tick;
    // The first pass is one tick after the start, as the reaper's is: a
    // process just started fires nothing before its configured pace (a test
    // that sets an hour's tick relies on its loop staying out of the way).
    super::every(&shared, tick, true, || async {
        match crate::service::schedules::fire_due(&shared.pool, &shared.agents, &shared.config.policy).await {
            Ok(n) => {
                shared.stats.schedule_firings.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(error = %e, "firing due schedules failed"),
        }
    })
    .await;
}
