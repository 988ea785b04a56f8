//! The schedules' firing loop, on every process: due schedules are fired
//! once each (`service::schedules::fire_due`; the row lock and the firing's
//! idempotency key make it one run per firing however many processes fire).
//! A firing's run starts in its enqueue on this process's worker when it
//! has a free slot (eager start, as a run posted to its API does).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::Shared;

pub(super) async fn run(shared: Arc<Shared>) {
    let tick = shared.config.schedule_tick;
    // The first pass is one tick after the start, as the reaper's is: a
    // process just started fires nothing before its configured pace (a test
    // that sets an hour's tick relies on its loop staying out of the way).
    let local = super::WorkerObserver::of(&shared);
    super::every(&shared, tick, true, || async {
        let (pool, agents, policy) = (&shared.pool, &shared.agents, &shared.config.policy);
        match crate::service::schedules::fire_due(pool, agents, policy, Some(&local)).await {
            Ok(n) => {
                shared.stats.schedule_firings.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(error = %e, "firing due schedules failed"),
        }
    })
    .await;
}
