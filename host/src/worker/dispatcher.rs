//! The claim loop. Acquire-before-pull: a slot is taken before a row is
//! claimed, so a saturated process never strands a claimed row it has no
//! capacity to run; overload shows up as queue depth instead. A dispatcher
//! with k free slots holds k permits and claims up to k rows in one
//! statement (`db::lifecycle::claim_batch_on`, on a connection of its own):
//! never more rows than slots, and an index conflict claims fewer rows
//! rather than none.
//!
//! A claim that takes fewer rows than it asked for also says whether its
//! snapshot held any other queued run (`Batch::dry`). When it held none,
//! the dispatcher waits for the next wake instead of claiming again at once
//! (that claim would find nothing), and until a wake comes the finisher
//! writes endings without a claim in their statement (`Shared::queue_dry`):
//! runs that arrive one at a time cost one claim and one ending each. Every
//! way a run becomes claimable NOTIFYs `run_enqueued`, so the wake comes;
//! without a connected hub the hint is never kept.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;

use crate::db::{self, lifecycle::Claim, lifecycle::ClaimedRun, notify::RUN_ENQUEUED};
use crate::hub::{Hub, Subscription, Wake};

use super::{run_task, Shared};

/// Immediate re-claims after an index conflict before waiting for a wake.
const CONFLICT_RETRIES_MAX: u32 = 3;
/// Pause after a failed claim (database down): bounded by the poll tick.
const ERROR_BACKOFF: Duration = Duration::from_millis(500);

pub(super) async fn run(shared: Arc<Shared>, hub: Option<Hub>) {
    // Subscribe once, before the first claim: a wake that lands between a
    // claim that found nothing and the wait is then still queued for us.
    let mut wakes = match &hub {
        Some(hub) => Some(hub.subscribe(RUN_ENQUEUED).await),
        None => None,
    };
    let mut conflicts = 0;
    // A connection of its own, as the finisher and the waker have: a pool
    // pings each connection given back, and each pooled connection planned
    // its first claims anew (custom plans, about 2 ms each here); this one
    // keeps one generic plan per claim shape. Made again after an error.
    let mut conn = db::OwnConnection::new(&shared.pool);
    loop {
        let first = tokio::select! {
            biased;
            _ = shared.stop_claiming.cancelled() => break,
            permit = shared.slots.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
            // Every slot is taken: a wake means the queue may hold work
            // again, which the next batch of endings claims with its statement.
            Some(_) = next_wake(wakes.as_mut()) => {
                shared.woken();
                continue;
            }
        };
        let mut permits = vec![first];
        // Runs finishing at this instant release their slots when they next
        // run: give them that turn, so one claim statement can take several rows.
        tokio::task::yield_now().await;
        while let Ok(p) = shared.slots.clone().try_acquire_owned() {
            permits.push(p);
        }
        if let Some(w) = wakes.as_mut() {
            // We are about to read the rows; wakes so far are answered.
            w.drain();
        }
        let asked = permits.len();
        let (claim, reserved) = claim_of(&shared, asked);
        let result = async { db::lifecycle::claim_batch_on(conn.get().await?, &claim).await }.await;
        shared.stats.claim_rounds.fetch_add(1, Ordering::Relaxed);
        // The reservation lasts until the claimed runs are held (`start`);
        // a claim that starts nothing gives it back before it waits.
        let reserved = match &result {
            Ok(batch) if !batch.runs.is_empty() => Some(reserved),
            _ => {
                drop(reserved);
                None
            }
        };
        let claimed = match result {
            Ok(batch) => {
                shared.claimed(batch.dry);
                shared.stats.claim_conflicts.fetch_add(u64::from(batch.conflicts), Ordering::Relaxed);
                if batch.runs.is_empty() && batch.conflicts > 0 {
                    // Every candidate was turned away: its turn is running
                    // elsewhere and ends with a wake. Try again a few times
                    // at once, then wait for that wake.
                    drop(permits);
                    conflicts += 1;
                    if conflicts <= CONFLICT_RETRIES_MAX {
                        continue;
                    }
                    conflicts = 0;
                    idle_wait(&shared, wakes.as_mut(), shared.config.poll_tick).await;
                    continue;
                }
                batch.runs
            }
            Err(e) => {
                tracing::warn!(error = %e, "claim failed");
                if !matches!(e, sqlx::Error::Database(_)) {
                    conn.broke();
                }
                drop(permits);
                idle_wait(&shared, wakes.as_mut(), ERROR_BACKOFF.min(shared.config.poll_tick)).await;
                continue;
            }
        };
        conflicts = 0;
        if claimed.is_empty() {
            drop(permits);
            idle_wait(&shared, wakes.as_mut(), shared.config.poll_tick).await;
            continue;
        }
        // Fewer runs than slots, and nothing else was queued: claiming again
        // at once would find nothing; the next run queued wakes us.
        let dry = claimed.len() < asked && shared.queue_dry();
        start(&shared, claimed, permits);
        drop(reserved);
        if dry {
            idle_wait(&shared, wakes.as_mut(), shared.config.poll_tick).await;
        }
    }
    conn.close().await;
}

/// A claim of up to `limit` rows as this worker makes it, with the rows
/// reserved against every tenant's share until the reservation is dropped
/// (after [`start`]: its runs are held by then).
pub(super) fn claim_of(shared: &Shared, limit: usize) -> (Claim<'_>, super::shares::Reservation) {
    let (rooms, reserved) = shared.reserve(limit);
    let claim = Claim {
        limit: limit as i64,
        lease: shared.config.lease,
        worker_id: &shared.config.worker_id,
        prefilter: true,
        tenant_max_running: shared.config.tenant_max_running.map(i64::from),
        rooms,
    };
    (claim, reserved)
}

/// Starts the runs of a claim (the dispatcher's, or the finisher's made
/// with its endings), one slot each; surplus slots go back first.
pub(super) fn start(shared: &Arc<Shared>, claimed: Vec<ClaimedRun>, mut permits: Vec<OwnedSemaphorePermit>) {
    debug_assert!(claimed.len() <= permits.len(), "never more rows than slots");
    shared.stats.claimed.fetch_add(claimed.len() as u64, Ordering::Relaxed);
    for row in &claimed {
        if row.attempt == 1 {
            // Enqueue to first claim; a resumed attempt waited for its worker to die.
            shared.stats.pickup.observe(row.waited_s);
        }
    }
    permits.truncate(claimed.len());
    for (row, permit) in claimed.into_iter().zip(permits) {
        run_task::spawn(shared, row, permit);
    }
}

/// The next wake; never, without a hub.
async fn next_wake(wakes: Option<&mut Subscription>) -> Option<Wake> {
    match wakes {
        Some(w) => w.recv().await,
        None => std::future::pending().await,
    }
}

/// Blocks on the hub with `timeout` as the fallback ceiling on a missed wake.
async fn idle_wait(shared: &Shared, wakes: Option<&mut Subscription>, timeout: Duration) {
    let wait = async {
        match wakes {
            Some(w) => match tokio::time::timeout(timeout, w.recv()).await {
                Ok(_) => shared.woken(),
                Err(_) => {
                    shared.stats.poll_wakeups.fetch_add(1, Ordering::Relaxed);
                }
            },
            None => {
                tokio::time::sleep(timeout).await;
                shared.stats.poll_wakeups.fetch_add(1, Ordering::Relaxed);
            }
        }
    };
    tokio::select! {
        _ = shared.stop_claiming.cancelled() => {}
        _ = wait => {}
    }
}
