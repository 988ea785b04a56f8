//! The cancel fast path: one subscription to the cancel channel per process.
//! A NOTIFY names a run; if this process holds it, the flag is re-read (the
//! row is the truth, the signal a hint) and the run's cancel token fires. A
//! hub reconnect re-reads the flags of every held run, since notifies may
//! have been missed. Without the hub, the heartbeat's re-read alone stops a
//! run, one beat later.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::db::notify::{RUN_CANCEL, RUN_STEER};
use crate::db::{self, RunId};
use crate::hub::{Hub, Subscription, Wake};

use super::Shared;

/// How long a cancel for a run this process does not hold is kept, in case
/// its claim is registering (microseconds, in practice), and how many.
const EARLY_KEEP: Duration = Duration::from_secs(5);
const EARLY_MAX: usize = 10_000;

/// The next wake and every one queued behind it: whether the hub
/// reconnected (every held run may have missed one) and the runs named;
/// `None` once the services stop or the hub is gone.
async fn next_wakes(shared: &Shared, wakes: &mut Subscription) -> Option<(bool, Vec<RunId>)> {
    let wake = tokio::select! {
        _ = shared.stop_services.cancelled() => return None,
        w = wakes.recv() => w?,
    };
    let mut everything = false;
    let mut named = Vec::new();
    let mut take = |w: Wake| match w {
        Wake::Notify(payload) => named.extend(payload.parse::<RunId>().ok()),
        Wake::Reconnected => everything = true,
    };
    take(wake);
    while let Some(w) = wakes.try_recv() {
        take(w);
    }
    Some((everything, named))
}

pub(super) async fn run(shared: Arc<Shared>, hub: Hub) {
    let mut wakes = hub.subscribe(RUN_CANCEL).await;
    loop {
        let Some((everything, named)) = next_wakes(&shared, &mut wakes).await else { return };
        let held: Vec<_> = {
            let map = shared.held.lock().unwrap();
            if everything {
                map.iter().map(|(id, h)| (*id, h.token)).collect()
            } else {
                let mut early = shared.early_cancels.lock().unwrap();
                let now = Instant::now();
                early.retain(|_, at| now.duration_since(*at) < EARLY_KEEP);
                for id in named.iter().filter(|id| !map.contains_key(id)) {
                    if early.len() < EARLY_MAX {
                        early.insert(*id, now);
                    }
                }
                named.iter().filter_map(|id| map.get(id).map(|h| (*id, h.token))).collect()
            }
        };
        if held.is_empty() {
            continue;
        }
        match db::lifecycle::cancel_requested(&shared.pool, &held).await {
            Ok(ids) => {
                let map = shared.held.lock().unwrap();
                for id in ids {
                    if let Some(h) = map.get(&id) {
                        tracing::info!(run_id = %id, "stop requested");
                        h.cancel.cancel();
                    }
                }
            }
            // The heartbeat re-reads the flag: a failed read costs one beat.
            Err(e) => tracing::warn!(error = %e, "reading cancel flags failed"),
        }
    }
}

/// The steer fast path, the same way: a NOTIFY names a run with a new
/// instruction; if this process holds it, its task is woken to journal
/// `steer_received`. A hub reconnect wakes every held run (one read each).
/// Missed or early wakes lose nothing: the guest's next take announces
/// whatever was not announced before it takes it.
pub(super) async fn steers(shared: Arc<Shared>, hub: Hub) {
    let mut wakes = hub.subscribe(RUN_STEER).await;
    loop {
        let Some((everything, named)) = next_wakes(&shared, &mut wakes).await else { return };
        let map = shared.held.lock().unwrap();
        match everything {
            true => map.values().for_each(|h| h.steered.notify_one()),
            false => named.iter().filter_map(|id| map.get(id)).for_each(|h| h.steered.notify_one()),
        }
    }
}
