//! Group commit of endings: the terminal writes of runs that end within a
//! short window share one statement and one commit
//! (`db::lifecycle::finish_many`), each row still fenced by its own token and
//! still with its `complete` event, its assistant message and its wake.
//!
//! Bounds: a batch is written once [`FINISH_BATCH_MAX`] endings are in it,
//! once the window (`WorkerConfig::finish_window`, at most
//! [`FINISH_WINDOW_MAX`]) since its first ending has passed, or at once when
//! every run this process holds is already in it (nothing else could join:
//! a full drain commits without waiting). The queue in front is bounded
//! ([`QUEUE_MAX`]); a run task waits when it is full. One batch is written at
//! a time; endings arriving meanwhile form the next one, so under load the
//! batch grows instead of the latency.
//!
//! The slots a batch's endings free are not released: the batch's statement
//! also claims up to that many queued runs (`finish_and_claim`), which start
//! before the endings' tasks are told. A busy worker thus makes one
//! statement, one commit and one round trip per batch, where a claim and an
//! ending took two of each; the dispatcher claims only for slots that are
//! free (at start, after an idle spell, after a claim found fewer rows).
//!
//! A fenced row drops out of its batch alone (its run task is told `false`).
//! If the database refuses the batch statement (a constraint or trigger),
//! each of its endings is written on its own, so one bad row never fails its
//! neighbours; if the database cannot be reached, every ending of the batch
//! fails at once (as each would have alone), rather than each waiting out
//! the pool in turn while its slot stays taken.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, OwnedSemaphorePermit};

use crate::db::{self, lifecycle::Ending, RunId};

use super::{Request, Shared};

/// Endings one statement writes at most.
pub const FINISH_BATCH_MAX: usize = 64;
const _: () = assert!(FINISH_BATCH_MAX <= db::lifecycle::FINISH_BATCH_MAX);
/// The default window: how long a batch waits for more endings after its first.
pub const FINISH_WINDOW_DEFAULT: Duration = Duration::from_millis(2);
/// The longest window a configuration may ask for.
pub const FINISH_WINDOW_MAX: Duration = Duration::from_millis(10);
/// Endings waiting for the finisher; run tasks wait when it is full.
pub(super) const QUEUE_MAX: usize = 1024;

pub(super) async fn run(shared: Arc<Shared>, mut queue: mpsc::Receiver<Request>) {
    let mut batch: Vec<Request> = Vec::with_capacity(FINISH_BATCH_MAX);
    // The ending-and-claim statement's own connection (`db::OwnConnection`).
    let mut conn = db::OwnConnection::new(&shared.pool);
    loop {
        // The first ending of a batch; the finisher ends once the worker's
        // services stop and nothing is queued (run tasks stop before them).
        tokio::select! {
            biased;
            n = queue.recv_many(&mut batch, FINISH_BATCH_MAX) => if n == 0 { break },
            _ = shared.stop_services.cancelled() => {
                queue.close();
                if queue.recv_many(&mut batch, FINISH_BATCH_MAX).await == 0 {
                    break;
                }
            }
        }
        let deadline = tokio::time::Instant::now() + shared.config.finish_window;
        while batch.len() < FINISH_BATCH_MAX && !everyone_ending(&shared) {
            let room = FINISH_BATCH_MAX - batch.len();
            tokio::select! {
                biased;
                n = queue.recv_many(&mut batch, room) => if n == 0 { break },
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        write(&shared, &mut batch, &mut conn).await;
    }
    conn.close().await;
}

/// Whether every run this process holds has its ending in the batch (the
/// run task drops its `held` entry before it asks): no one else can join.
fn everyone_ending(shared: &Shared) -> bool {
    shared.held.lock().unwrap().is_empty()
}

async fn write(shared: &Arc<Shared>, batch: &mut Vec<Request>, conn: &mut db::OwnConnection) {
    let endings: Vec<Ending> = batch.iter().map(|r| r.ending.clone()).collect();
    if turnover(shared, batch, &endings, conn).await {
        return;
    }
    // The endings alone: on the finisher's own connection when it has one.
    let alone = match conn.get().await {
        Ok(c) => {
            let written = db::lifecycle::finish_many(c, &endings).await;
            if matches!(&written, Err(e) if !matches!(e, sqlx::Error::Database(_))) {
                conn.broke();
            }
            written
        }
        Err(_) => db::lifecycle::finish_many(&shared.pool, &endings).await,
    };
    match alone {
        Ok(written) => {
            shared.stats.finish_commits.fetch_add(1, Ordering::Relaxed);
            tell(batch, written);
        }
        // The database refused the statement (a constraint, a trigger): write
        // the endings one by one, so a row it refuses fails alone.
        Err(e @ sqlx::Error::Database(_)) => {
            tracing::warn!(error = %e, endings = batch.len(), "group-committed endings refused; writing them one by one");
            let mut away: Option<String> = None;
            for r in batch.drain(..) {
                if let Some(why) = &away {
                    let _ = r.reply.send(Err(sqlx::Error::Protocol(why.clone())));
                    continue;
                }
                let one = db::lifecycle::finish_many(&shared.pool, std::slice::from_ref(&r.ending)).await;
                match &one {
                    Ok(_) => {
                        shared.stats.finish_commits.fetch_add(1, Ordering::Relaxed);
                    }
                    // The database went away mid-way: the rest fail at once
                    // instead of each waiting out the pool in turn.
                    Err(e) if !matches!(e, sqlx::Error::Database(_)) => away = Some(e.to_string()),
                    Err(_) => {}
                }
                let _ = r.reply.send(one.map(|w| !w.is_empty()));
            }
        }
        // The database is unreachable (pool, connection, I/O): one by one
        // would only wait out the pool once per ending, holding every slot.
        // Every ending in the batch fails at once, as each would alone.
        Err(e) => {
            tracing::warn!(error = %e, endings = batch.len(), "group-committed endings failed");
            fail_all(batch, &e);
        }
    }
}

/// Tells each ending's task whether its ending is among those `written`.
fn tell(batch: &mut Vec<Request>, written: Vec<RunId>) {
    let written: HashSet<RunId> = written.into_iter().collect();
    for r in batch.drain(..) {
        let _ = r.reply.send(Ok(written.contains(&r.ending.run)));
    }
}

/// Tells every ending's task that its ending failed with `e`.
fn fail_all(batch: &mut Vec<Request>, e: &sqlx::Error) {
    let why = e.to_string();
    for r in batch.drain(..) {
        let _ = r.reply.send(Err(sqlx::Error::Protocol(why.clone())));
    }
}

/// The endings written with a claim into the slots they free, in one
/// statement and one commit (`db::lifecycle::finish_and_claim`): the slots
/// of the batch's runs pass straight to the runs claimed, which start before
/// any ending's task is told (so a drain waiting for the tasks sees them).
/// Acquire-before-pull holds: the claim takes at most one row per slot
/// taken here, and surplus slots go back. Not while the worker stops
/// claiming, nor in a process that does not dispatch, nor while the queue
/// is known dry (`Shared::queue_dry`: the last claim found nothing else
/// queued and no wake has come since). Returns true when
/// every ending's task was told; false, with every slot back with its run,
/// when there was nothing to claim with or the database refused the
/// statement (a constraint, a trigger): the caller then writes the endings
/// alone, as it would have without the claim. Unreachable, every ending
/// fails at once (its slot back with its run), as `write` fails them.
/// Runs on the finisher's own connection, `conn` (with no connection to be
/// had, the endings go alone, on the host's pool), made anew after the
/// statement failed for want of the database.
async fn turnover(
    shared: &Arc<Shared>,
    batch: &mut Vec<Request>,
    endings: &[Ending],
    conn: &mut db::OwnConnection,
) -> bool {
    if !shared.config.dispatch || shared.stop_claiming.is_cancelled() || shared.queue_dry() {
        return false;
    }
    let c = match conn.get().await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, endings = batch.len(), "no connection for endings with a claim; writing the endings alone");
            return false;
        }
    };
    let taken: Vec<(usize, OwnedSemaphorePermit)> = batch
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.slot.as_ref().and_then(|s| s.lock().unwrap().take()).map(|p| (i, p)))
        .collect();
    if taken.is_empty() {
        return false;
    }
    let (claim, _reserved) = super::dispatcher::claim_of(shared, taken.len());
    match db::lifecycle::finish_and_claim(c, endings, &claim).await {
        Ok(t) => {
            shared.claimed(t.dry);
            shared.stats.finish_commits.fetch_add(1, Ordering::Relaxed);
            shared.stats.claim_rounds.fetch_add(1, Ordering::Relaxed);
            shared.stats.claim_conflicts.fetch_add(u64::from(t.conflicts), Ordering::Relaxed);
            super::dispatcher::start(shared, t.claimed, taken.into_iter().map(|(_, p)| p).collect());
            tell(batch, t.written);
            true
        }
        Err(e) => {
            for (i, p) in taken {
                if let Some(slot) = &batch[i].slot {
                    *slot.lock().unwrap() = Some(p);
                }
            }
            if !matches!(e, sqlx::Error::Database(_)) {
                // The database is unreachable: every ending of the batch
                // fails at once, as in `write`, rather than waiting out the
                // pool while the slots stay taken. The connection is made
                // anew for the next batch.
                conn.broke();
                tracing::warn!(error = %e, endings = batch.len(), "endings with a claim failed");
                fail_all(batch, &e);
                return true;
            }
            tracing::warn!(error = %e, endings = batch.len(), "endings with a claim refused; writing the endings alone");
            false
        }
    }
}
