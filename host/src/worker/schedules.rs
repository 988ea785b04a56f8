//! The schedules' firing loop, on every process: due schedules are fired
//! once each (`service::schedules::fire_due`; the row lock and the firing's
//! idempotency key make it one run per firing however many processes fire).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::Shared;

pub(super) async fn run(shared: Arc<Shared>) {
    let tick = shared.config.schedule_tick;
    super::every(&shared, tick, false, || async {
        match crate::service::schedules::fire_due(&shared.pool, &shared.agents, &shared.config.policy).await {
            Ok(n) => {
                shared.stats.schedule_firings.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(error = %e, "firing due schedules failed"),
        }
    })
    .await;
}
