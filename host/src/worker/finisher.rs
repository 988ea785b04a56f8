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
//! ([`QUEUE_MAX`]); a run task waits when it is full.
//!
//! [`WRITERS`] batches are written at a time, each on a connection of its
//! own; endings arriving while both are in flight form the next batch, so
//! under load the batch grows instead of the latency. A batch holds at most
//! half the worker's slots, so a wave of endings (every slot's run ending at
//! once, as in a drain of short runs) goes out as two statements in flight
//! together: the database works on one while the host starts the runs the
//! other claimed, where one writer left one of the two idle in turn. A
//! writer whose statement starts while the other's is in flight claims only
//! its lane of the queue (`db::lifecycle::Lane`), so the two claims never
//! reach for the same row; a writer alone claims from the whole queue.
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

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use crate::db::{self, lifecycle::Ending, lifecycle::Lane, RunId};

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

/// Statements writing endings at once, each on a connection of its own.
pub const WRITERS: usize = 2;

/// Endings one batch holds at most with `max_runs` slots: a wave of endings
/// (every slot's run ending at once) is split between the writers.
fn batch_cap(max_runs: usize) -> usize {
    max_runs.div_ceil(WRITERS).clamp(1, FINISH_BATCH_MAX)
}

/// What one statement hands back when it lands: its connection, its lane,
/// and each lane's oldest queued position as it saw them (if it claimed).
type Landed = (db::OwnConnection, Lane, Option<[Option<i64>; 2]>);

/// The writers' state: idle connections, the lanes of the statements in
/// flight, and how far each lane has been drained (the last statement to
/// land read each lane's oldest queued position).
struct Writers {
    idle: Vec<db::OwnConnection>,
    flying: Vec<Lane>,
    oldest: [Option<i64>; 2],
    /// How far a lane may run ahead of the other, in queue positions.
    margin: i64,
}

impl Writers {
    fn landed(&mut self, (conn, lane, oldest): Landed) {
        self.idle.push(conn);
        if let Some(i) = self.flying.iter().position(|l| *l == lane) {
            self.flying.swap_remove(i);
        }
        if let Some(oldest) = oldest {
            self.oldest = oldest;
        }
    }

    /// The lane of a statement about to start, or `None`: wait for the one
    /// in flight to land first. Alone, every lane: no row waits for a lane
    /// nobody claims in. Beside a laned statement, the other lane, unless
    /// that lane has run ahead (its oldest queued run is more than `margin`
    /// positions newer than the other's, or it is empty while the other is
    /// not): claiming there would start newer runs before older ones, so the
    /// statement waits, then claims alone, oldest first. Beside a statement
    /// in every lane, the lane left behind.
    fn lane(&self) -> Option<Lane> {
        const _: () = assert!(WRITERS == 2, "two writers, two lanes");
        // With two writers and one idle, at most one statement is in flight.
        match self.flying.first() {
            None => Some(Lane::ALL),
            Some(&Lane::ALL) => {
                let odd_behind = match self.oldest {
                    [Some(even), Some(odd)] => odd < even,
                    [None, Some(_)] => true,
                    _ => false,
                };
                Some(Lane { index: u32::from(odd_behind), of: 2 })
            }
            Some(other) => {
                let mine = 1 - other.index;
                (!self.ahead(mine as usize, other.index as usize)).then_some(Lane { index: mine, of: 2 })
            }
        }
    }

    /// Whether lane `a` has run ahead of lane `b`.
    fn ahead(&self, a: usize, b: usize) -> bool {
        match (self.oldest[a], self.oldest[b]) {
            (Some(a), Some(b)) => a > b + self.margin,
            (None, Some(_)) => true,
            (_, None) => false,
        }
    }
}

pub(super) async fn run(shared: Arc<Shared>, mut queue: mpsc::Receiver<Request>) {
    let cap = batch_cap(shared.config.max_runs);
    let mut batch: Vec<Request> = Vec::with_capacity(cap);
    let mut writers = Writers {
        idle: (0..WRITERS).map(|_| db::OwnConnection::new(&shared.pool)).collect(),
        flying: Vec::with_capacity(WRITERS),
        oldest: [None, None],
        margin: 4 * shared.config.max_runs as i64,
    };
    // The statements in flight.
    let mut busy = FuturesUnordered::new();
    loop {
        if writers.idle.is_empty() {
            if let Some(done) = busy.next().await {
                writers.landed(done);
            }
            continue;
        }
        // The first ending of a batch; the finisher ends once the worker's
        // services stop and nothing is queued (run tasks stop before them).
        tokio::select! {
            biased;
            Some(done) = busy.next() => {
                writers.landed(done);
                continue;
            }
            n = queue.recv_many(&mut batch, cap) => if n == 0 { break },
            _ = shared.stop_services.cancelled() => {
                queue.close();
                if queue.recv_many(&mut batch, cap).await == 0 {
                    break;
                }
            }
        }
        let deadline = tokio::time::Instant::now() + shared.config.finish_window;
        while batch.len() < cap && !everyone_ending(&shared) {
            let room = cap - batch.len();
            tokio::select! {
                biased;
                n = queue.recv_many(&mut batch, room) => if n == 0 { break },
                Some(done) = busy.next() => writers.landed(done),
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        let lane = loop {
            match writers.lane() {
                Some(lane) => break lane,
                None => match busy.next().await {
                    Some(done) => writers.landed(done),
                    None => break Lane::ALL,
                },
            }
        };
        writers.flying.push(lane);
        let mut conn = writers.idle.pop().expect("a writer is idle");
        let mut batch = std::mem::replace(&mut batch, Vec::with_capacity(cap));
        let shared = shared.clone();
        busy.push(async move {
            let oldest = write(&shared, &mut batch, &mut conn, lane).await;
            (conn, lane, oldest)
        });
    }
    while let Some(done) = busy.next().await {
        writers.landed(done);
    }
    for conn in writers.idle {
        conn.close().await;
    }
}

/// Whether every run this process holds has its ending in the batch (the
/// run task drops its `held` entry before it asks): no one else can join.
fn everyone_ending(shared: &Shared) -> bool {
    shared.held.lock().unwrap().is_empty()
}

/// Writes a batch of endings (with a claim in `lane` when it can); returns
/// each lane's oldest queued position as its claim saw them.
async fn write(
    shared: &Arc<Shared>,
    batch: &mut Vec<Request>,
    conn: &mut db::OwnConnection,
    lane: Lane,
) -> Option<[Option<i64>; 2]> {
    let endings: Vec<Ending> = batch.iter().map(|r| r.ending.clone()).collect();
    if let Some(oldest) = turnover(shared, batch, &endings, conn, lane).await {
        return oldest;
    }
    match db::lifecycle::finish_many(&shared.pool, &endings).await {
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
    None
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
/// taken here, and surplus slots go back. The claim looks only at `lane`.
/// Not while the worker stops claiming, nor in a process that does not
/// dispatch. Returns `Some` when every ending's task was told (with each
/// lane's oldest queued position, when the claim was made); `None`, with
/// every slot back with its run, when there was nothing to claim with or
/// the database refused the statement (a constraint, a trigger): the caller
/// then writes the endings alone, as it would have without the claim. Unreachable, every ending
/// fails at once (its slot back with its run), as `write` fails them.
/// Runs on the finisher's own connection, `conn` (with no connection to be
/// had, the endings go alone, on the host's pool), made anew after the
/// statement failed for want of the database.
async fn turnover(
    shared: &Arc<Shared>,
    batch: &mut Vec<Request>,
    endings: &[Ending],
    conn: &mut db::OwnConnection,
    lane: Lane,
) -> Option<Option<[Option<i64>; 2]>> {
    if !shared.config.dispatch || shared.stop_claiming.is_cancelled() {
        return None;
    }
    let c = match conn.get().await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, endings = batch.len(), "no connection for endings with a claim; writing the endings alone");
            return None;
        }
    };
    let taken: Vec<(usize, OwnedSemaphorePermit)> = batch
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.slot.as_ref().and_then(|s| s.lock().unwrap().take()).map(|p| (i, p)))
        .collect();
    if taken.is_empty() {
        return None;
    }
    let claim = super::dispatcher::claim_of(shared, taken.len());
    match db::lifecycle::finish_and_claim(c, endings, &claim, lane).await {
        Ok(t) => {
            shared.stats.finish_commits.fetch_add(1, Ordering::Relaxed);
            if lane != Lane::ALL {
                shared.stats.laned_claims.fetch_add(1, Ordering::Relaxed);
            }
            shared.stats.claim_rounds.fetch_add(1, Ordering::Relaxed);
            shared.stats.claim_conflicts.fetch_add(u64::from(t.conflicts), Ordering::Relaxed);
            if t.claimed.len() < taken.len() {
                shared.stats.short_claims.fetch_add(1, Ordering::Relaxed);
            }
            super::dispatcher::start(shared, t.claimed, taken.into_iter().map(|(_, p)| p).collect());
            tell(batch, t.written);
            Some(t.oldest)
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
                return Some(None);
            }
            tracing::warn!(error = %e, endings = batch.len(), "endings with a claim refused; writing the endings alone");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writers(flying: &[Lane], oldest: [Option<i64>; 2]) -> Writers {
        Writers { idle: Vec::new(), flying: flying.to_vec(), oldest, margin: 40 }
    }

    const EVEN: Lane = Lane { index: 0, of: 2 };
    const ODD: Lane = Lane { index: 1, of: 2 };

    #[test]
    fn a_statement_alone_claims_in_every_lane_and_beside_one_in_the_other() {
        // Alone: every lane, however the lanes stand.
        assert_eq!(writers(&[], [Some(10), Some(500)]).lane(), Some(Lane::ALL));
        // Beside a laned statement: the other lane, while it keeps level.
        assert_eq!(writers(&[EVEN], [Some(100), Some(101)]).lane(), Some(ODD));
        assert_eq!(writers(&[ODD], [Some(140), Some(101)]).lane(), Some(EVEN));
        // Beside one in every lane: the lane left behind.
        assert_eq!(writers(&[Lane::ALL], [Some(100), Some(121)]).lane(), Some(EVEN));
        assert_eq!(writers(&[Lane::ALL], [Some(150), Some(121)]).lane(), Some(ODD));
        assert_eq!(writers(&[Lane::ALL], [None, Some(121)]).lane(), Some(ODD));
        // Nothing read yet: the lanes count as level.
        assert_eq!(writers(&[EVEN], [None, None]).lane(), Some(ODD));
    }

    #[test]
    fn a_lane_run_ahead_waits_for_the_other_statement_to_land() {
        // The odd lane's oldest run is 41 positions newer than the even
        // lane's (the margin is 40): a statement beside the even lane's waits.
        assert_eq!(writers(&[EVEN], [Some(100), Some(141)]).lane(), None);
        assert_eq!(writers(&[EVEN], [Some(100), Some(140)]).lane(), Some(ODD));
        // An empty lane beside one with runs has run ahead of it.
        assert_eq!(writers(&[EVEN], [Some(100), None]).lane(), None);
        assert_eq!(writers(&[ODD], [None, Some(7)]).lane(), None);
        // Both empty: neither is ahead (the claim finds nothing anyway).
        assert_eq!(writers(&[ODD], [None, None]).lane(), Some(EVEN));
        // Once the statement in flight lands, the waiting one claims alone.
        let mut w = writers(&[EVEN], [Some(100), Some(141)]);
        w.flying.clear();
        assert_eq!(w.lane(), Some(Lane::ALL));
    }

    #[test]
    fn a_wave_of_endings_splits_in_two() {
        assert_eq!(batch_cap(1), 1);
        assert_eq!(batch_cap(3), 2);
        assert_eq!(batch_cap(10), 5);
        assert_eq!(batch_cap(1000), FINISH_BATCH_MAX);
    }
}
