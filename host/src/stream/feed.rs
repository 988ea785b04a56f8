//! One journal reader per live run per process, shared by every live tail
//! of that run on the process: the feed reads the run's journal once per
//! wake (or fallback poll) and hands the new events to each tail's bounded
//! queue, instead of each tail querying the journal itself.
//!
//! - The feed subscribes to the run's events channel on the hub before its
//!   first read (a wake cannot fall in the gap), reads after its `head` in
//!   bounded pages, and, when a read finds nothing new, asks the run row
//!   whether the run ended without a `complete` (then synthesizes it, as a
//!   lone tail would). The first `complete` ends it.
//! - Each tail has a slot: a queue bounded in events and bytes
//!   ([`SLOT_EVENTS_MAX`], [`SLOT_BYTES_MAX`]). A tail that falls behind (its
//!   queue is full, it joined behind the feed, or a read of the feed failed)
//!   is *lagging*: the feed stops queueing for it and the tail reads the
//!   journal itself from its own cursor, in bounded pages, until it has
//!   caught up with the feed's head; then it rejoins. Nothing is buffered
//!   without bound, and no event is skipped or repeated: the tail's cursor
//!   is the last event it handed on.
//! - A slow client: a tail that has events waiting (queued or lagging) and
//!   takes none for the stall timeout ([`STALL_DEFAULT`], `sse_stall`) is
//!   cut: its queue is freed, its place under the live-tails bound given
//!   back, and its stream ends with an error at its next poll. The client
//!   holds its cursor (the last SSE `id:` it received) and rejoins with
//!   `Last-Event-ID`. The timeout runs on the feed's task, because a stream
//!   whose client stops reading is no longer polled by the server.
//! - A feed ends when its last tail leaves (or is cut).
//! - The feeds of a process read through one reader: the reads asked while
//!   a statement is in flight go together in the next one
//!   ([`journal::pages_after`], at most [`READ_BATCH_RUNS`] runs and
//!   [`READ_BATCH_BYTES`] in one), so a wake of a thousand runs costs the
//!   database a few statements, not a thousand (and the host as many round
//!   trips).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant;

use crate::db::events::{complete_payload, COMPLETE};
use crate::db::journal::{self, Event, Page, PageAsk};
use crate::db::notify::events_channel;
use crate::db::RunId;
use crate::hub::Hub;

/// Events one tail's queue holds at most before the tail lags.
pub const SLOT_EVENTS_MAX: usize = 1024;
/// Payload bytes one tail's queue holds at most (past its first event)
/// before the tail lags.
pub const SLOT_BYTES_MAX: usize = 1 << 20;
/// How long a tail may take nothing while events wait for it before it is cut.
pub const STALL_DEFAULT: Duration = Duration::from_secs(30);
/// Runs one statement of the process's reader reads at most.
pub const READ_BATCH_RUNS: usize = 500;
/// Payload bytes one statement of the reader returns at most: shared among
/// its runs (each page still has its first event, and a page cut short is
/// read on at once), so a batch holds no more than a few pages' worth.
pub const READ_BATCH_BYTES: i64 = 16 << 20;
/// The least byte bound a run's page gets in a full batch.
const READ_PAGE_BYTES_MIN: i64 = 32 << 10;

/// The feeds' counters, for `/metrics` and tests.
#[derive(Debug, Default)]
pub struct FeedStats {
    /// Journal reads the feeds made (each serves every tail of its run).
    pub reads: AtomicU64,
    /// Statements those reads took (one serves the reads asked together).
    pub read_statements: AtomicU64,
    /// Tails that fell behind their feed and read on their own for a while.
    pub lagged: AtomicU64,
    /// Tails cut because their client stopped reading.
    pub stalled: AtomicU64,
    live: AtomicU64,
}

impl FeedStats {
    /// Feeds running now.
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }
}

/// What a feed needs from the tails that start it.
#[derive(Clone)]
pub(crate) struct FeedConfig {
    pub pool: PgPool,
    pub hub: Option<Hub>,
    /// The fallback poll when no wake comes.
    pub poll: Duration,
    pub stall: Duration,
    pub page_events_max: i64,
    pub page_bytes_max: i64,
}

/// The process's feeds, by run. Cheap to clone.
#[derive(Clone, Default)]
pub struct Feeds {
    inner: Arc<FeedsInner>,
}

#[derive(Default)]
struct FeedsInner {
    by_run: Mutex<HashMap<RunId, Weak<Feed>>>,
    stats: Arc<FeedStats>,
    /// The process's reader, started by the first feed.
    reader: std::sync::OnceLock<Reader>,
}

impl std::fmt::Debug for Feeds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feeds").field("stats", &self.inner.stats).finish()
    }
}

impl Feeds {
    pub fn stats(&self) -> &FeedStats {
        &self.inner.stats
    }

    /// Joins the run's feed (starting it if there is none) with a tail at
    /// `cursor`; `keep` is held by the slot until it leaves or is cut.
    pub(crate) fn join(&self, config: &FeedConfig, run: RunId, cursor: i32, keep: Box<dyn Send + Sync>) -> FeedSub {
        let mut keep = Some(keep);
        loop {
            let feed = {
                let mut map = self.inner.by_run.lock().unwrap();
                match map.get(&run).and_then(Weak::upgrade) {
                    Some(f) if !f.state.lock().unwrap().dead => f,
                    _ => {
                        let f = Arc::new(Feed {
                            run,
                            state: Mutex::new(FeedState {
                                head: cursor,
                                ended: None,
                                slots: HashMap::new(),
                                next_id: 0,
                                dead: false,
                            }),
                            changed: Notify::new(),
                        });
                        map.insert(run, Arc::downgrade(&f));
                        self.inner.stats.live.fetch_add(1, Ordering::Relaxed);
                        self.inner.reader.get_or_init(|| Reader::start(config.pool.clone(), self.inner.stats.clone()));
                        tokio::spawn(feed_task(f.clone(), self.inner.clone(), config.clone()));
                        f
                    }
                }
            };
            let mut st = feed.state.lock().unwrap();
            if st.dead {
                continue; // ended between the lookup and here: start another
            }
            let id = st.next_id;
            st.next_id += 1;
            let wake = Arc::new(Notify::new());
            // Behind the feed: read on its own until caught up.
            let lagging = cursor < st.head;
            st.slots.insert(
                id,
                Slot {
                    queue: VecDeque::new(),
                    bytes: 0,
                    upto: cursor,
                    lagging,
                    last_take: Instant::now(),
                    pending_since: None,
                    cut: false,
                    wake: wake.clone(),
                    keep: keep.take(),
                },
            );
            drop(st);
            return FeedSub { feed, id, wake };
        }
    }
}

struct Feed {
    run: RunId,
    state: Mutex<FeedState>,
    /// Wakes the feed's task: a tail left, or rejoined (read now).
    changed: Notify,
}

struct FeedState {
    /// The last seq the feed has read (or the seq it started after).
    head: i32,
    /// The seq of the ending the feed has seen (stored or synthesized).
    ended: Option<i32>,
    slots: HashMap<u64, Slot>,
    next_id: u64,
    /// The task has ended; joiners start another feed.
    dead: bool,
}

struct Slot {
    queue: VecDeque<Event>,
    bytes: usize,
    /// The last seq queued for this tail (or its cursor when it joined or
    /// rejoined): the feed queues only later ones.
    upto: i32,
    /// Reading on its own; the feed queues nothing for it.
    lagging: bool,
    /// When the tail last took events (or read on its own).
    last_take: Instant,
    /// Since when events wait for it (queued, or lagging).
    pending_since: Option<Instant>,
    cut: bool,
    wake: Arc<Notify>,
    /// The tail's place under the live bound: given back when it is cut.
    keep: Option<Box<dyn Send + Sync>>,
}

impl Slot {
    fn active(&self) -> bool {
        !self.cut
    }

    /// When this tail is cut if it takes nothing until then.
    fn stall_at(&self, stall: Duration) -> Option<Instant> {
        if self.cut || (self.queue.is_empty() && !self.lagging) {
            return None;
        }
        let since = self.pending_since.map_or(self.last_take, |p| p.max(self.last_take));
        Some(since + stall)
    }

    fn lag(&mut self, stats: &FeedStats) {
        if !self.lagging {
            self.lagging = true;
            stats.lagged.fetch_add(1, Ordering::Relaxed);
            self.pending_since.get_or_insert_with(Instant::now);
        }
        self.wake.notify_one();
    }
}

impl FeedState {
    /// Queues `events` for every tail that follows the feed.
    fn publish(&mut self, events: &[Event], stats: &FeedStats) {
        for slot in self.slots.values_mut().filter(|s| s.active() && !s.lagging) {
            let mut pushed = false;
            let after = slot.upto;
            for e in events.iter().filter(|e| e.seq > after) {
                let size = crate::text::json_bytes(&e.payload) + e.kind.len();
                if slot.queue.len() >= SLOT_EVENTS_MAX || (!slot.queue.is_empty() && slot.bytes + size > SLOT_BYTES_MAX)
                {
                    slot.lag(stats);
                    break;
                }
                if slot.queue.is_empty() {
                    slot.pending_since = Some(Instant::now());
                }
                slot.queue.push_back(e.clone());
                slot.bytes += size;
                slot.upto = e.seq;
                pushed = true;
            }
            if pushed {
                slot.wake.notify_one();
            }
        }
        if let Some(last) = events.last() {
            self.head = self.head.max(last.seq);
        }
    }

    /// Cuts the tails that took nothing for `stall` while events waited.
    fn cut_stalled(&mut self, stall: Duration, stats: &FeedStats) {
        let now = Instant::now();
        for slot in self.slots.values_mut() {
            if slot.stall_at(stall).is_some_and(|at| at <= now) {
                slot.cut = true;
                slot.queue = VecDeque::new();
                slot.bytes = 0;
                slot.keep = None;
                stats.stalled.fetch_add(1, Ordering::Relaxed);
                slot.wake.notify_one();
            }
        }
    }

    fn next_stall(&self, stall: Duration) -> Option<Instant> {
        self.slots.values().filter_map(|s| s.stall_at(stall)).min()
    }

    /// Tails the feed queues for (active, not lagging).
    fn following(&self) -> usize {
        self.slots.values().filter(|s| s.active() && !s.lagging).count()
    }
}

/// What a tail finds in its slot.
pub(crate) enum Take {
    /// Events after its cursor, in order.
    Events(VecDeque<Event>),
    /// Nothing yet: wait.
    Empty,
    /// Read the journal on your own from your cursor.
    Lagging,
    /// The feed saw the run's ending at or before the cursor.
    Ended,
    /// Cut for not reading.
    Cut,
}

/// A tail's slot in its run's feed; dropping it leaves.
pub(crate) struct FeedSub {
    feed: Arc<Feed>,
    id: u64,
    wake: Arc<Notify>,
}

impl FeedSub {
    /// Takes what the feed queued for this tail.
    pub fn take(&self, cursor: i32) -> Take {
        let mut st = self.feed.state.lock().unwrap();
        let ended = st.ended;
        let Some(slot) = st.slots.get_mut(&self.id) else {
            return Take::Cut;
        };
        if slot.cut {
            return Take::Cut;
        }
        slot.last_take = Instant::now();
        if !slot.queue.is_empty() {
            slot.bytes = 0;
            slot.pending_since = if slot.lagging { Some(Instant::now()) } else { None };
            return Take::Events(std::mem::take(&mut slot.queue));
        }
        if slot.lagging {
            return Take::Lagging;
        }
        match ended {
            Some(end) if cursor >= end => Take::Ended,
            // The feed ended past this tail's cursor without queueing it:
            // the tail finds its ending on its own.
            Some(_) => {
                slot.lagging = true;
                Take::Lagging
            }
            None => Take::Empty,
        }
    }

    /// A lagging tail caught up with the journal at `cursor`: it follows the
    /// feed again if the feed has read nothing past it. Returns whether it did.
    pub fn rejoin(&self, cursor: i32) -> bool {
        let mut st = self.feed.state.lock().unwrap();
        if st.head > cursor {
            return false;
        }
        let alone = st.following() == 0;
        if alone {
            // No one else follows: the feed moves on from here (it may not
            // have read while every tail read on its own).
            st.head = cursor;
        }
        let Some(slot) = st.slots.get_mut(&self.id) else {
            return false;
        };
        if slot.cut {
            return false;
        }
        slot.lagging = false;
        slot.upto = cursor;
        slot.pending_since = None;
        slot.last_take = Instant::now();
        drop(st);
        // Read now: what was committed since this tail's last read may
        // have woken the feed while no one followed it.
        self.feed.changed.notify_one();
        true
    }

    /// Waits until the feed queues something (or cuts, or lags this tail).
    pub async fn changed(&self) {
        self.wake.notified().await
    }
}

impl Drop for FeedSub {
    fn drop(&mut self) {
        let mut st = self.feed.state.lock().unwrap();
        st.slots.remove(&self.id);
        drop(st);
        self.feed.changed.notify_one();
    }
}

/// The process's journal reader: the feeds' reads, batched. A read asked
/// while a statement is in flight waits for the next one, which takes
/// every read waiting then; one statement is in flight at a time.
struct Reader {
    asks: mpsc::UnboundedSender<(PageAsk, oneshot::Sender<Result<Page, String>>)>,
}

impl Reader {
    fn start(pool: PgPool, stats: Arc<FeedStats>) -> Reader {
        let (asks, rx) = mpsc::unbounded_channel();
        tokio::spawn(reader_task(pool, stats, rx));
        Reader { asks }
    }

    async fn read(&self, ask: PageAsk) -> Result<Page, String> {
        let (tx, rx) = oneshot::channel();
        self.asks.send((ask, tx)).map_err(|_| "the journal reader has stopped".to_string())?;
        rx.await.map_err(|_| "the journal reader has stopped".to_string())?
    }
}

/// Ends when the process's feeds are dropped (with their [`Reader`]).
async fn reader_task(
    pool: PgPool,
    stats: Arc<FeedStats>,
    mut rx: mpsc::UnboundedReceiver<(PageAsk, oneshot::Sender<Result<Page, String>>)>,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < READ_BATCH_RUNS {
            match rx.try_recv() {
                Ok(ask) => batch.push(ask),
                Err(_) => break,
            }
        }
        let share = (READ_BATCH_BYTES / batch.len() as i64).max(READ_PAGE_BYTES_MIN);
        let asks: Vec<PageAsk> =
            batch.iter().map(|(a, _)| PageAsk { bytes_max: a.bytes_max.min(share), ..*a }).collect();
        let pages = journal::pages_after(&pool, &asks).await;
        stats.read_statements.fetch_add(1, Ordering::Relaxed);
        match pages {
            Ok(pages) => {
                for ((_, answer), page) in batch.into_iter().zip(pages) {
                    let _ = answer.send(Ok(page));
                }
            }
            Err(e) => {
                let e = e.to_string();
                for (_, answer) in batch {
                    let _ = answer.send(Err(e.clone()));
                }
            }
        }
    }
}

async fn feed_task(feed: Arc<Feed>, feeds: Arc<FeedsInner>, config: FeedConfig) {
    let stats = &feeds.stats;
    let reader = feeds.reader.get().expect("the reader starts before its first feed");
    // Subscribed before the first read: a wake in between is queued, not lost.
    let mut wakes = match &config.hub {
        Some(hub) => Some(hub.subscribe(&events_channel(feed.run)).await),
        None => None,
    };
    let mut read = true;
    loop {
        let stall_at = {
            let mut st = feed.state.lock().unwrap();
            st.cut_stalled(config.stall, stats);
            if st.slots.values().all(|s| !s.active()) {
                st.dead = true;
                break;
            }
            if read && (st.following() == 0 || st.ended.is_some()) {
                read = false; // every tail reads on its own, or the run has ended
            }
            st.next_stall(config.stall)
        };
        if read {
            if let Some(w) = &mut wakes {
                w.drain(); // answered by this read
            }
            if let Err(e) = read_round(&feed, &config, reader, stats).await {
                tracing::warn!(run_id = %feed.run, error = %e, "a feed's journal read failed; its tails read on their own");
                let mut st = feed.state.lock().unwrap();
                for slot in st.slots.values_mut().filter(|s| s.active()) {
                    slot.lag(stats);
                }
            }
        }
        let poll = tokio::time::sleep(config.poll);
        let stall = sleep_until(stall_at);
        read = tokio::select! {
            wake = recv(&mut wakes) => {
                if wake.is_none() {
                    wakes = None; // the hub has shut down: poll from now on
                }
                true
            }
            _ = poll => true,
            _ = stall => false,
            _ = feed.changed.notified() => true,
        };
    }
    stats.live.fetch_sub(1, Ordering::Relaxed);
    let mut map = feeds.by_run.lock().unwrap();
    if map.get(&feed.run).is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&feed))) {
        map.remove(&feed.run);
    }
}

async fn recv(wakes: &mut Option<crate::hub::Subscription>) -> Option<crate::hub::Wake> {
    match wakes {
        Some(w) => w.recv().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Reads what is new after the feed's head (in pages) and queues it; when
/// nothing is new, finds whether the run ended without a `complete` (the
/// page says, read in the same snapshot).
async fn read_round(feed: &Feed, config: &FeedConfig, reader: &Reader, stats: &FeedStats) -> Result<(), String> {
    loop {
        let head = feed.state.lock().unwrap().head;
        let ask = PageAsk {
            run: feed.run,
            after: head,
            events_max: config.page_events_max,
            bytes_max: config.page_bytes_max,
        };
        let Page { mut events, cut, ended } = reader.read(ask).await?;
        stats.reads.fetch_add(1, Ordering::Relaxed);
        let full = cut || events.len() as i64 >= config.page_events_max;
        let got = !events.is_empty();
        // The first ending wins; nothing after it is sent.
        let end = events.iter().position(|e| e.kind == COMPLETE);
        if let Some(i) = end {
            events.truncate(i + 1);
        }
        {
            let mut st = feed.state.lock().unwrap();
            st.publish(&events, stats);
            if let Some(i) = end {
                st.ended = Some(events[i].seq);
                return Ok(());
            }
        }
        if full {
            continue;
        }
        if got {
            return Ok(());
        }
        // Caught up: has the run ended, and where?
        let Some((status, error, last_seq)) = ended else {
            return Ok(());
        };
        if last_seq > head {
            continue; // the ending's rows came after our read
        }
        let last = match last_seq {
            0 => None,
            seq => journal::events_after(&config.pool, feed.run, seq - 1, 1).await.map_err(|e| e.to_string())?.pop(),
        };
        let mut st = feed.state.lock().unwrap();
        if last.is_some_and(|e| e.kind == COMPLETE) {
            st.ended = Some(last_seq);
        } else {
            // No complete in the journal: synthesized at its end + 1.
            let mut payload = complete_payload(status, error.as_deref());
            payload["synthesized"] = serde_json::Value::Bool(true);
            let seq = last_seq + 1;
            st.publish(&[Event { seq, kind: COMPLETE.to_string(), payload }], stats);
            st.ended = Some(seq);
        }
        // Tails past the ending learn it now.
        for slot in st.slots.values() {
            slot.wake.notify_one();
        }
        return Ok(());
    }
}
