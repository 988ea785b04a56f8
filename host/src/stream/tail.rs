//! The journal tail as a service: for (run, cursor), a [`Stream`] of the
//! run's events after the cursor, then its one ending. Every reader of a run
//! (the native SSE stream, its JSON pages, the Responses API) is an encoder
//! over this; none of them reads the journal itself.
//!
//! The mechanism (the reference article, rung 6):
//! - follow mode subscribes to the run's events channel on the hub BEFORE
//!   the catch-up read, so a wake cannot fall in the gap between them;
//! - it catches up in pages, then waits for a wake with the keepalive as the
//!   fallback poll (signals are hints; the journal is the truth), and yields
//!   a keepalive when nothing was sent for that long;
//! - the first `complete` ends the tail. A cursor at or past the run's
//!   ending gets no event at all, only the end: one ending for every reader,
//!   however often it asks;
//! - a `complete` is synthesized from the run row ONLY for a terminal run
//!   whose journal has none (a finalizer died mid-way, or retention trimmed
//!   the journal): at the journal's last seq + 1, with `synthesized: true`.
//!
//! Live tails are counted per process against a bound ([`LiveTails`]).
//!
//! Follow mode shares reads: every live tail of one run on a process is fed
//! by the run's one feed (`stream::feed`), which reads the journal once per
//! wake and queues the new events for each tail; a tail reads on its own
//! only while it is behind the feed (catching up, or its client was slow).
//! A tail whose client stops reading while events wait is cut after the
//! stall timeout ([`TailError::Stalled`], with its cursor).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use sqlx::PgPool;
use tokio::time::Instant;

use crate::db::events::{complete_payload, COMPLETE};
use crate::db::journal::{self, Event};
use crate::db::RunId;
use crate::hub::Hub;
use crate::stream::feed::{FeedConfig, FeedSub, Feeds, Take, STALL_DEFAULT};

/// Events one journal read returns at most.
pub const PAGE_EVENTS_MAX: i64 = 500;
/// Payload bytes one journal read returns at most (past the first event):
/// what one tail, and one JSON page, hold in memory at once.
pub const PAGE_BYTES_MAX: i64 = 4 << 20;
/// The default keepalive, which is also the fallback poll.
pub const KEEPALIVE_DEFAULT: Duration = Duration::from_secs(15);
/// The shortest keepalive a tail uses, whatever it is given: a zero would
/// turn the fallback poll into a busy loop.
pub const KEEPALIVE_MIN: Duration = Duration::from_millis(10);
/// Live tails one process serves by default.
pub const LIVE_TAILS_MAX_DEFAULT: usize = 10_000;

/// What a tail yields.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// A journal row (or the synthesized `complete`), in seq order.
    Event(Event),
    /// Nothing was sent for a keepalive interval (follow mode only).
    Keepalive,
    /// The last item; the stream ends after it.
    End(Ending),
}

/// Why a tail ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The run's `complete` (stored or synthesized) was the last event.
    Complete,
    /// The cursor was at or past the run's ending: there is nothing to send.
    AlreadyEnded,
    /// Catch-up mode: everything there is was sent; the run goes on.
    CaughtUp,
}

impl Ending {
    /// Whether the run has ended (a reader need not ask again).
    pub fn is_terminal(self) -> bool {
        !matches!(self, Ending::CaughtUp)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TailError {
    #[error("reading the journal failed: {0}")]
    Db(#[from] sqlx::Error),
    /// The client stopped reading while events waited for it: the tail was
    /// cut; the client rejoins after `cursor` (its last SSE id).
    #[error("the client stopped reading; cut after seq {cursor}")]
    Stalled { cursor: i32 },
}

/// A new live tail was refused: the process already serves its bound.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("this process already serves {max} live streams")]
pub struct TooManyTails {
    pub max: usize,
}

/// The process's live tails: how many, the bound, how many were refused,
/// and the per-run feeds that serve them.
#[derive(Debug)]
pub struct LiveTails {
    max: usize,
    live: AtomicUsize,
    refused: AtomicU64,
    feeds: Feeds,
}

impl LiveTails {
    pub fn new(max: usize) -> Arc<LiveTails> {
        Arc::new(LiveTails { max, live: AtomicUsize::new(0), refused: AtomicU64::new(0), feeds: Feeds::default() })
    }

    /// The per-run feeds of this process's live tails.
    pub fn feeds(&self) -> &Feeds {
        &self.feeds
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Tails live now.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Tails refused since the process started.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    fn acquire(self: &Arc<Self>) -> Result<Permit, TooManyTails> {
        let max = self.max;
        match self.live.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1)) {
            Ok(_) => Ok(Permit(self.clone())),
            Err(_) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                Err(TooManyTails { max })
            }
        }
    }
}

/// One live tail's place under the bound, given back when the tail is dropped.
#[derive(Debug)]
struct Permit(Arc<LiveTails>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug, Clone, Copy)]
pub struct TailConfig {
    /// Keepalive interval, which is also the fallback poll.
    pub keepalive: Duration,
    /// Rows per journal read.
    pub page_events_max: i64,
    /// How long a live tail may take nothing while events wait for it
    /// before it is cut (its client stopped reading).
    pub stall: Duration,
}

impl Default for TailConfig {
    fn default() -> Self {
        TailConfig { keepalive: KEEPALIVE_DEFAULT, page_events_max: PAGE_EVENTS_MAX, stall: STALL_DEFAULT }
    }
}

/// Opens tails. Cheap to clone.
#[derive(Clone)]
pub struct Tails {
    pool: PgPool,
    hub: Option<Hub>,
    config: TailConfig,
    live: Arc<LiveTails>,
}

impl Tails {
    pub fn new(pool: PgPool, hub: Option<Hub>, config: TailConfig, live: Arc<LiveTails>) -> Tails {
        let config = TailConfig {
            keepalive: config.keepalive.max(KEEPALIVE_MIN),
            page_events_max: config.page_events_max.max(1),
            stall: config.stall.max(KEEPALIVE_MIN),
        };
        Tails { pool, hub, config, live }
    }

    /// Everything after `after_seq` that is in the journal now, then the end
    /// ([`Ending::CaughtUp`] while the run goes on). Never waits; not counted.
    pub fn catch_up(&self, run: RunId, after_seq: i32) -> TailStream {
        TailStream::new(Reader::new(self, run, after_seq, None))
    }

    /// Catches up, then follows the run live until its ending, with
    /// keepalives. Counted against the process's bound until dropped.
    pub fn follow(&self, run: RunId, after_seq: i32) -> Result<TailStream, TooManyTails> {
        Ok(self.follow_reserved(run, after_seq, self.reserve()?))
    }

    /// A place under the bound taken before the run to follow exists (so a
    /// request is refused before it enqueues anything, not after).
    pub fn reserve(&self) -> Result<Reserved, TooManyTails> {
        Ok(Reserved(self.live.acquire()?))
    }

    /// [`Tails::follow`] in a place taken by [`Tails::reserve`].
    pub fn follow_reserved(&self, run: RunId, after_seq: i32, place: Reserved) -> TailStream {
        let feed = FeedConfig {
            pool: self.pool.clone(),
            hub: self.hub.clone(),
            poll: self.config.keepalive,
            stall: self.config.stall,
            page_events_max: self.config.page_events_max,
            page_bytes_max: PAGE_BYTES_MAX,
        };
        let follow = Follow {
            feeds: self.live.feeds.clone(),
            feed,
            sub: None,
            last_sent: Instant::now(),
            permit: Some(place.0),
        };
        TailStream::new(Reader::new(self, run, after_seq, Some(follow)))
    }
}

/// A live tail's place under the process's bound, not yet used.
#[derive(Debug)]
pub struct Reserved(Permit);

/// A tail: `Result<Item, TailError>`s, ending after [`Item::End`] or an error.
pub struct TailStream(BoxStream<'static, Result<Item, TailError>>);

impl TailStream {
    fn new(reader: Reader) -> TailStream {
        TailStream(futures::stream::unfold(reader, |mut r| async move { r.next().await.map(|i| (i, r)) }).boxed())
    }
}

impl Stream for TailStream {
    type Item = Result<Item, TailError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.as_mut().poll_next(cx)
    }
}

/// What the reader does once the events it holds are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Read the journal after the cursor.
    Read,
    /// Caught up: ask the run row whether the run has ended.
    Check,
    /// Follow mode: wait for a wake or the keepalive.
    Wait,
    Done,
}

/// What follow mode adds.
struct Follow {
    feeds: Feeds,
    feed: FeedConfig,
    /// This tail's slot in its run's feed, joined at the first read.
    sub: Option<FeedSub>,
    last_sent: Instant,
    /// The place under the bound, until the slot holds it (a cut gives it back).
    permit: Option<Permit>,
}

struct Reader {
    pool: PgPool,
    run: RunId,
    /// The last seq sent (or the one the reader started after).
    cursor: i32,
    config: TailConfig,
    follow: Option<Follow>,
    ready: VecDeque<Event>,
    next: Next,
    ending: Option<Ending>,
}

impl Reader {
    fn new(tails: &Tails, run: RunId, after_seq: i32, follow: Option<Follow>) -> Reader {
        Reader {
            pool: tails.pool.clone(),
            run,
            cursor: after_seq,
            config: tails.config,
            follow,
            ready: VecDeque::new(),
            next: Next::Read,
            ending: None,
        }
    }

    async fn next(&mut self) -> Option<Result<Item, TailError>> {
        loop {
            if let Some(e) = self.ready.pop_front() {
                self.cursor = e.seq;
                if e.kind == COMPLETE {
                    // The first ending wins; nothing after it is sent.
                    self.ready.clear();
                    self.ending = Some(Ending::Complete);
                }
                self.sent();
                return Some(Ok(Item::Event(e)));
            }
            if let Some(end) = self.ending.take() {
                self.next = Next::Done;
                return Some(Ok(Item::End(end)));
            }
            let step = match self.next {
                Next::Done => return None,
                Next::Read if self.follow.is_some() => self.follow_read().await.map(|()| None),
                Next::Read => self.read().await.map(|()| None),
                Next::Check => self.check().await.map(|()| None),
                Next::Wait => Ok(self.wait().await),
            };
            match step {
                Ok(Some(item)) => {
                    self.sent();
                    return Some(Ok(item));
                }
                Ok(None) => {}
                Err(e) => {
                    self.next = Next::Done;
                    return Some(Err(e));
                }
            }
        }
    }

    fn sent(&mut self) {
        if let Some(f) = &mut self.follow {
            f.last_sent = Instant::now();
        }
    }

    /// Follow mode: takes what the run's feed queued for this tail, or
    /// reads on its own while behind the feed.
    async fn follow_read(&mut self) -> Result<(), TailError> {
        let f = self.follow.as_mut().expect("follow mode");
        if f.sub.is_none() {
            // Joined before the first read (the feed subscribes to the hub
            // before its own): nothing committed after this can be missed.
            let keep: Box<dyn Send + Sync> = Box::new(f.permit.take());
            f.sub = Some(f.feeds.join(&f.feed, self.run, self.cursor, keep));
        }
        let sub = f.sub.as_ref().expect("joined");
        match sub.take(self.cursor) {
            Take::Events(events) => {
                let cursor = self.cursor;
                self.ready.extend(events.into_iter().filter(|e| e.seq > cursor));
                self.next = Next::Read;
                Ok(())
            }
            Take::Empty => {
                self.next = Next::Wait;
                Ok(())
            }
            Take::Ended => {
                self.ending = Some(Ending::AlreadyEnded);
                Ok(())
            }
            Take::Cut => Err(TailError::Stalled { cursor: self.cursor }),
            Take::Lagging => self.read().await,
        }
    }

    async fn read(&mut self) -> Result<(), TailError> {
        let (events, cut) = journal::events_after_bounded(
            &self.pool,
            self.run,
            self.cursor,
            self.config.page_events_max,
            PAGE_BYTES_MAX,
        )
        .await?;
        // A full page (in rows or bytes): read on before asking whether the run ended.
        let full = cut || events.len() as i64 == self.config.page_events_max;
        self.next = if full { Next::Read } else { Next::Check };
        self.ready.extend(events);
        Ok(())
    }

    /// Caught up with the journal: has the run ended, and where?
    async fn check(&mut self) -> Result<(), TailError> {
        let Some((status, error, last_seq)) = journal::terminal_state(&self.pool, self.run).await? else {
            match &self.follow {
                // Caught up on its own: follow the feed again, unless it
                // has read past us meanwhile (then read on).
                Some(f) => match &f.sub {
                    Some(sub) if !sub.rejoin(self.cursor) => self.next = Next::Read,
                    _ => self.next = Next::Wait,
                },
                None => self.ending = Some(Ending::CaughtUp),
            }
            return Ok(());
        };
        // The row and its `complete` commit together, and nothing is
        // appended after the ending: the journal is final.
        if last_seq > self.cursor {
            self.next = Next::Read;
            return Ok(());
        }
        let last = match last_seq {
            0 => None,
            seq => journal::events_after(&self.pool, self.run, seq - 1, 1).await?.pop(),
        };
        if last.is_some_and(|e| e.kind == COMPLETE) {
            // The journal's complete is at or before the cursor.
            self.ending = Some(Ending::AlreadyEnded);
            return Ok(());
        }
        // No complete in the journal: the ending is synthesized at its end + 1,
        // once; a cursor there or past it has had it.
        let seq = last_seq + 1;
        if self.cursor >= seq {
            self.ending = Some(Ending::AlreadyEnded);
            return Ok(());
        }
        let mut payload = complete_payload(status, error.as_deref());
        payload["synthesized"] = serde_json::Value::Bool(true);
        self.ready.push_back(Event { seq, kind: COMPLETE.to_string(), payload });
        Ok(())
    }

    /// Waits for a wake, or until a keepalive is due; a due keepalive is the answer.
    async fn wait(&mut self) -> Option<Item> {
        let keepalive = self.config.keepalive;
        let f = self.follow.as_mut().expect("only follow mode waits");
        let due = f.last_sent + keepalive;
        if Instant::now() >= due {
            // The poll that just ran found nothing new.
            return Some(Item::Keepalive);
        }
        match &f.sub {
            Some(sub) => {
                tokio::select! {
                    _ = sub.changed() => {}
                    _ = tokio::time::sleep_until(due) => {}
                }
            }
            None => tokio::time::sleep_until(due).await,
        }
        self.next = Next::Read;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_counts_permits_and_refusals() {
        let live = LiveTails::new(2);
        let a = live.acquire().unwrap();
        let b = live.acquire().unwrap();
        assert_eq!(live.acquire().unwrap_err().max, 2);
        assert_eq!((live.live(), live.refused()), (2, 1));
        drop(a);
        assert_eq!(live.live(), 1);
        let _c = live.acquire().unwrap();
        drop(b);
        assert_eq!((live.live(), live.refused()), (1, 1));
    }
}
