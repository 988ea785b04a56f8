//! One heartbeat per process: every interval, renew the lease of every run
//! this process holds in one fenced statement. A run missing from the answer
//! was lost (reaped, or ended by someone else): it is stopped at once.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::db;

use super::Shared;

pub(super) async fn run(shared: Arc<Shared>) {
    super::every(&shared, shared.config.heartbeat, false, || beat(&shared)).await;
}

async fn beat(shared: &Shared) {
    // The operator's tenant shares, read again each beat (`shares`).
    if shared.config.dispatch {
        match db::tenants::shares(&shared.pool).await {
            Ok(s) => shared.shares.set_overrides(s),
            Err(e) => tracing::warn!(error = %e, "reading the tenants' slot shares failed; keeping the last ones"),
        }
    }
    let held: Vec<_> = shared.held.lock().unwrap().iter().map(|(id, h)| (*id, h.token)).collect();
    if held.is_empty() {
        return;
    }
    let alive = match db::lifecycle::heartbeat(&shared.pool, &held, shared.config.lease).await {
        Ok(alive) => alive,
        Err(e) => {
            // Not a verdict: the lease may still be ours. If it lapses, the
            // reaper decides and the fence keeps our later writes out.
            shared.stats.heartbeat_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, runs = held.len(), "heartbeat failed");
            return;
        }
    };
    let alive: std::collections::HashMap<_, _> = alive.into_iter().collect();
    let map = shared.held.lock().unwrap();
    for (id, token) in held {
        let Some(h) = map.get(&id) else { continue };
        if h.token != token {
            continue;
        }
        match alive.get(&id) {
            Some(true) => h.cancel.cancel(),
            Some(false) => {}
            None => {
                tracing::warn!(run_id = %id, "heartbeat found the claim gone; stopping the run");
                h.lost.cancel();
            }
        }
    }
}
