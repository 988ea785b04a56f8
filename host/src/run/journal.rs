//! The journal writer: one per run, owning the run's seq from
//! [`FIRST_RUN_SEQ`] on. Only [`crate::run::host::RunHost`] writes through it.
//!
//! Consecutive deltas of one stream merge in memory and flush on a clock
//! (250 ms by default); a structural event flushes the buffer and is written
//! through at once. If the fence trips, nothing of the run's batch is
//! written, nothing is announced, and the run is told to stop (`lost`).
//!
//! The group commit ([`JournalGroup`], one per process): writers do not
//! write their batches themselves; they hand them to the process's group,
//! which writes the batches of every run due together in ONE statement and
//! one commit (`db::journal::append_group`), each run's rows still fenced by
//! its own claim token, and NOTIFYs once for all of them. The flush clock is
//! the group's: a run's merged deltas are due at the clock's next tick, so
//! the writers of all live runs hand their deltas in at the same instants and
//! a process commits about once per tick, however many runs stream. A
//! structural event is urgent: it is committed at once, with whatever else
//! is waiting (it rides the next tick's commit only when that is due within
//! [`GATHER_DEFAULT`]). A fenced run's rows drop out of the statement alone;
//! only that run's writer hears it lost its claim.
//!
//! One outcome per event, whatever the database does:
//! - `event` answers `Ok` once the event is committed, and an error only when
//!   it is not written and never will be. A flush that fails (the database
//!   is unreachable) is retried by the writer while the emitter waits; a
//!   retry that finds the batch already committed (the commit's answer was
//!   lost) counts it as written, never writes it twice.
//! - The writer gives up after `give_up_after` of failing flushes, or when
//!   what waits to be written passes [`UNSENT_BYTES_MAX`]: nothing buffered is
//!   written then, every waiting and later call answers
//!   [`HostError::Unavailable`], and `gave_up` fires so the run ends failed.
//! - `delta` answers `Ok` when the text is buffered; it is written by a later
//!   flush, or lost with the run when the writer gives up.
//!
//! Text PostgreSQL cannot store (U+0000, from a guest, a tool or a model) is
//! replaced with U+FFFD on the way in and counted ([`JournalStats::nul_replaced`]).

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::db::events::CONTENT_DELTA;
pub use crate::db::events::FIRST_RUN_SEQ;
use crate::db::{self, ClaimToken, RunId};
use crate::error::HostError;
use crate::text;

pub const FLUSH_DEFAULT: Duration = Duration::from_millis(250);
/// How long flushes may keep failing before the writer gives up on the run.
pub const GIVE_UP_DEFAULT: Duration = Duration::from_secs(30);
/// Commands waiting for the writer; emitters wait when it is full.
const QUEUE_MAX: usize = 256;
/// Bytes of merged delta text before a flush regardless of the clock.
const PENDING_BYTES_MAX: usize = 64 * 1024;
/// Bytes (kinds and payloads) kept for a retry after failed flushes before
/// the writer gives up.
pub const UNSENT_BYTES_MAX: usize = 4 << 20;
/// Events of one flush statement at most; a longer backlog takes several.
const BATCH_EVENTS_MAX: usize = 1024;
/// The longest pause between two retries of a failing flush.
const RETRY_PAUSE_MAX: Duration = Duration::from_secs(2);
/// How long the group waits, after the first batch of a tick arrives, for
/// the other writers' batches of that tick (their timers fire together, but
/// their tasks run one after the other).
pub const GATHER_DEFAULT: Duration = Duration::from_millis(5);
/// Rows of one group commit statement at most; more wait for the next.
pub const GROUP_ROWS_MAX: usize = 4096;
/// Bytes (kinds and payloads) of one group commit statement at most (past
/// its first batch, however large).
pub const GROUP_BYTES_MAX: usize = 8 << 20;
/// Batches waiting for the group; writers wait when it is full.
const GROUP_QUEUE_MAX: usize = 4096;

/// The writer's timing.
#[derive(Debug, Clone, Copy)]
pub struct JournalConfig {
    /// How long merged deltas wait before they are flushed.
    pub flush_every: Duration,
    /// How long flushes may keep failing before the writer gives up.
    pub give_up_after: Duration,
}

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig { flush_every: FLUSH_DEFAULT, give_up_after: GIVE_UP_DEFAULT }
    }
}

/// Journal counters for the process.
#[derive(Debug, Default)]
pub struct JournalStats {
    pub flushes: AtomicU64,
    pub rows: AtomicU64,
    pub deltas_in: AtomicU64,
    /// Flush statements that failed (and were retried, or given up on).
    pub flush_failures: AtomicU64,
    /// Runs whose writer gave up (the database was gone too long).
    pub gave_up: AtomicU64,
    /// U+0000 characters replaced with U+FFFD in events and run endings.
    pub nul_replaced: AtomicU64,
    /// Group commits: statements (each its own commit) that wrote the
    /// batches of one or more runs.
    pub group_commits: AtomicU64,
    /// Rows the group commits wrote (rows per commit: this / `group_commits`).
    pub group_rows: AtomicU64,
    /// Run batches the group commits carried (written or fenced).
    pub group_batches: AtomicU64,
    /// Run batches a group commit left out because their run was fenced.
    pub group_fenced: AtomicU64,
    /// NOTIFYs the group commits sent (at most one each).
    pub group_notifies: AtomicU64,
    /// The most rows one group commit wrote.
    pub group_rows_max: AtomicU64,
}

/// An event's append number (`run_event.op`): which host call of the run it
/// followed, for a resumed run to know what is already journaled. `None` for
/// events outside that order.
pub type Op = Option<i64>;

enum Cmd {
    Delta(Value, Op),
    Event { kind: String, payload: Value, op: Op, ack: oneshot::Sender<Result<(), HostError>> },
    Flush { ack: oneshot::Sender<Result<(), HostError>> },
}

const OPEN: u8 = 0;
const FENCED: u8 = 1;
const GAVE_UP: u8 = 2;

/// Handle to a run's writer. The writer task starts with the first event, so
/// a run that emits nothing costs nothing here.
pub struct Journal {
    running: Option<(mpsc::Sender<Cmd>, JoinHandle<()>)>,
    idle: Option<Writer>,
    state: Arc<AtomicU8>,
    gave_up: CancellationToken,
}

impl Journal {
    /// Prepares the writer for seqs `first_seq..`, with a group of its own
    /// (one run per commit; tests and tools). `lost` is cancelled if the
    /// fence trips; [`Journal::gave_up`] fires if the writer gives up.
    pub fn start(
        pool: PgPool,
        run: RunId,
        token: ClaimToken,
        first_seq: i32,
        config: JournalConfig,
        lost: CancellationToken,
        stats: Arc<JournalStats>,
    ) -> Journal {
        let group = JournalGroup::start(pool, config.flush_every, stats.clone());
        Journal::start_in(&group, run, token, first_seq, config, lost, stats)
    }

    /// [`Journal::start`] in the process's group: this run's batches are
    /// committed with those of every other run due at the same tick.
    pub fn start_in(
        group: &JournalGroup,
        run: RunId,
        token: ClaimToken,
        first_seq: i32,
        config: JournalConfig,
        lost: CancellationToken,
        stats: Arc<JournalStats>,
    ) -> Journal {
        let state = Arc::new(AtomicU8::new(OPEN));
        let gave_up = CancellationToken::new();
        let writer = Writer {
            pool: group.pool.clone(),
            group: group.clone(),
            run,
            token,
            next_seq: first_seq,
            config,
            pending: None,
            unsent: Vec::new(),
            unsent_bytes: 0,
            waiting: Vec::new(),
            failing_since: None,
            failures: 0,
            retry_at: None,
            state: state.clone(),
            lost,
            gave_up: gave_up.clone(),
            stats,
        };
        Journal { running: None, idle: Some(writer), state, gave_up }
    }

    /// Fires when the writer gives up: nothing more will be written.
    pub fn gave_up(&self) -> CancellationToken {
        self.gave_up.clone()
    }

    fn refusal(&self) -> Option<HostError> {
        match self.state.load(Ordering::Acquire) {
            FENCED => Some(HostError::Fenced),
            GAVE_UP => Some(gave_up_error()),
            _ => None,
        }
    }

    fn sender(&mut self) -> Result<&mpsc::Sender<Cmd>, HostError> {
        if let Some(e) = self.refusal() {
            return Err(e);
        }
        if let Some(writer) = self.idle.take() {
            let (tx, rx) = mpsc::channel(QUEUE_MAX);
            self.running = Some((tx, tokio::spawn(writer.run(rx))));
        }
        Ok(&self.running.as_ref().expect("writer started").0)
    }

    /// The writer is gone: say why.
    fn gone(&self) -> HostError {
        self.refusal().unwrap_or(HostError::Fenced)
    }

    /// A delta: buffered, merged with its neighbours of the same stream (the
    /// merged row carries the last piece's `op`).
    pub async fn delta(&mut self, payload: Value, op: Op) -> Result<(), HostError> {
        let sent = self.sender()?.send(Cmd::Delta(payload, op)).await;
        sent.map_err(|_| self.gone())
    }

    /// A structural event: flushes the buffer and is written at once. `Ok`
    /// once committed; an error means it is not written and never will be.
    pub async fn event(&mut self, kind: &str, payload: Value, op: Op) -> Result<(), HostError> {
        let (ack, done) = oneshot::channel();
        let sent = self.sender()?.send(Cmd::Event { kind: kind.to_string(), payload, op, ack }).await;
        sent.map_err(|_| self.gone())?;
        done.await.map_err(|_| self.gone())?
    }

    /// Flushes and stops the writer; the run's next seq then belongs to the
    /// terminal write.
    pub async fn close(mut self) -> Result<(), HostError> {
        if let Some(e) = self.refusal() {
            return Err(e);
        }
        let Some((tx, task)) = self.running.take() else {
            return Ok(()); // nothing was ever emitted
        };
        let (ack, done) = oneshot::channel();
        let r = match tx.send(Cmd::Flush { ack }).await {
            Ok(()) => done.await.unwrap_or_else(|_| Err(self.gone())),
            Err(_) => Err(self.gone()),
        };
        drop(tx);
        let _ = task.await;
        r
    }
}

fn gave_up_error() -> HostError {
    HostError::Unavailable("the run's journal could not be written: the database was unreachable too long".into())
}

struct Pending {
    /// The first delta's payload; its `delta` grows as neighbours merge.
    payload: Value,
    text: String,
    op: Op,
    since: Instant,
}

struct Writer {
    pool: PgPool,
    group: JournalGroup,
    run: RunId,
    token: ClaimToken,
    next_seq: i32,
    config: JournalConfig,
    pending: Option<Pending>,
    /// Events not yet written, in order: retried first by every flush.
    unsent: Vec<(String, Value, Op)>,
    unsent_bytes: usize,
    /// Emitters waiting for their event (the last in `unsent`) to be written.
    waiting: Vec<oneshot::Sender<Result<(), HostError>>>,
    /// Since when flushes fail (None: the last one succeeded).
    failing_since: Option<Instant>,
    failures: u32,
    retry_at: Option<Instant>,
    state: Arc<AtomicU8>,
    lost: CancellationToken,
    gave_up: CancellationToken,
    stats: Arc<JournalStats>,
}

/// Two deltas are of one stream when everything but the text is equal.
fn same_stream(a: &Value, b: &Value) -> bool {
    match (a.as_object(), b.as_object()) {
        (Some(a), Some(b)) => a.len() == b.len() && a.iter().all(|(k, v)| k == "delta" || b.get(k) == Some(v)),
        _ => false,
    }
}

impl Writer {
    fn done(&self) -> bool {
        self.state.load(Ordering::Acquire) != OPEN
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Cmd>) {
        loop {
            if self.done() {
                // Refuse whatever is still queued, then end.
                rx.close();
                let e = if self.state.load(Ordering::Acquire) == FENCED { HostError::Fenced } else { gave_up_error() };
                while let Some(cmd) = rx.recv().await {
                    if let Cmd::Event { ack, .. } | Cmd::Flush { ack } = cmd {
                        let _ = ack.send(Err(e.clone()));
                    }
                }
                return;
            }
            let deadline = match (&self.retry_at, &self.pending) {
                (Some(at), _) => Some(*at),
                (None, Some(p)) => Some(self.group.due(p.since)),
                (None, None) => None,
            };
            let cmd = tokio::select! {
                cmd = rx.recv() => cmd,
                _ = sleep_until(deadline) => {
                    self.flush(false).await;
                    continue;
                }
            };
            match cmd {
                None => {
                    // Every handle is gone (the run task was dropped): write what we have.
                    self.take_pending();
                    self.flush(true).await;
                    return;
                }
                Some(Cmd::Delta(payload, op)) => {
                    self.stats.deltas_in.fetch_add(1, Ordering::Relaxed);
                    let text = payload.get("delta").and_then(Value::as_str).unwrap_or_default().to_string();
                    let merge = self.pending.as_ref().is_some_and(|p| same_stream(&p.payload, &payload));
                    if merge {
                        let p = self.pending.as_mut().unwrap();
                        p.text.push_str(&text);
                        p.op = op.or(p.op);
                    } else {
                        self.take_pending();
                        self.pending = Some(Pending { payload, text, op, since: Instant::now() });
                    }
                    if self.pending.as_ref().is_some_and(|p| p.text.len() >= PENDING_BYTES_MAX) {
                        self.take_pending();
                        if self.retry_at.is_none() {
                            self.flush(false).await;
                        }
                    }
                    self.check_bounds();
                }
                Some(Cmd::Event { kind, payload, op, ack }) => {
                    self.take_pending();
                    self.push(kind, payload, op);
                    self.waiting.push(ack);
                    self.check_bounds();
                    // Written through at once; while flushes fail, the
                    // emitter waits and the retry clock drives the writes.
                    self.flush_until_written().await;
                }
                Some(Cmd::Flush { ack }) => {
                    self.take_pending();
                    self.waiting.push(ack);
                    self.flush_until_written().await;
                }
            }
        }
    }

    /// Moves the merged delta into the unsent queue.
    fn take_pending(&mut self) {
        if let Some(p) = self.pending.take() {
            let mut payload = p.payload;
            payload["delta"] = Value::String(p.text);
            self.push(CONTENT_DELTA.to_string(), payload, p.op);
        }
    }

    fn push(&mut self, kind: String, mut payload: Value, op: Op) {
        let replaced = text::storable_json(&mut payload) + text::nul_count(&kind);
        if replaced > 0 {
            self.stats.nul_replaced.fetch_add(replaced as u64, Ordering::Relaxed);
        }
        self.unsent_bytes += kind.len() + text::json_bytes(&payload);
        self.unsent.push((text::storable(&kind).into_owned(), payload, op));
    }

    fn check_bounds(&mut self) {
        let pending = self.pending.as_ref().map_or(0, |p| p.text.len());
        if self.unsent_bytes + pending > UNSENT_BYTES_MAX {
            tracing::error!(run_id = %self.run, bytes = self.unsent_bytes + pending, "journal backlog past its bound");
            self.give_up();
        }
    }

    /// Flushes until everything waiting is written, the fence trips, or the
    /// writer gives up; pauses between failing attempts.
    async fn flush_until_written(&mut self) {
        loop {
            if let Some(at) = self.retry_at {
                tokio::time::sleep_until(at).await;
            }
            self.flush(true).await;
            if self.done() || self.unsent.is_empty() {
                return;
            }
        }
    }

    /// One attempt to write everything unsent (in batches), acking waiting
    /// emitters once their events are committed. `urgent`: a structural
    /// event (or a close) waits, so the group commits without waiting for
    /// the tick.
    async fn flush(&mut self, urgent: bool) {
        if self.done() {
            return;
        }
        if self.retry_at.is_none() || self.retry_at.is_some_and(|at| at <= Instant::now()) {
            self.retry_at = None;
        } else {
            return;
        }
        if self.pending.as_ref().is_some_and(|p| self.group.due(p.since) <= Instant::now()) {
            self.take_pending();
        }
        while !self.unsent.is_empty() {
            let n = self.unsent.len().min(BATCH_EVENTS_MAX);
            match self.write_batch(n, urgent).await {
                Ok(true) => {
                    let written: Vec<_> = self.unsent.drain(..n).collect();
                    self.unsent_bytes = self
                        .unsent_bytes
                        .saturating_sub(written.iter().map(|(k, v, _)| k.len() + text::json_bytes(v)).sum());
                    self.next_seq += n as i32;
                    self.failing_since = None;
                    self.failures = 0;
                }
                Ok(false) => {
                    self.state.store(FENCED, Ordering::Release);
                    self.lost.cancel();
                    for ack in self.waiting.drain(..) {
                        let _ = ack.send(Err(HostError::Fenced));
                    }
                    return;
                }
                Err(e) => {
                    self.stats.flush_failures.fetch_add(1, Ordering::Relaxed);
                    let since = *self.failing_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= self.config.give_up_after {
                        tracing::error!(run_id = %self.run, error = %e, "journal flushes kept failing; giving up on the run");
                        self.give_up();
                        return;
                    }
                    self.failures += 1;
                    let pause = (self.config.flush_every * self.failures).min(RETRY_PAUSE_MAX);
                    tracing::warn!(run_id = %self.run, error = %e, events = self.unsent.len(), "journal flush failed; will retry");
                    self.retry_at = Some(Instant::now() + pause);
                    return;
                }
            }
        }
        for ack in self.waiting.drain(..) {
            let _ = ack.send(Ok(()));
        }
    }

    /// Writes the first `n` unsent events through the group. A unique
    /// violation on the seq means an earlier attempt committed although its
    /// answer was lost: the batch is written, and is not written again.
    async fn write_batch(&mut self, n: usize, urgent: bool) -> Result<bool, sqlx::Error> {
        let events = self.unsent[..n].to_vec();
        let first_kind = events[0].0.clone();
        let r = self.group.append(self.run, self.token, self.next_seq, events, urgent).await;
        match r {
            Ok(written) => {
                if written {
                    self.stats.flushes.fetch_add(1, Ordering::Relaxed);
                    self.stats.rows.fetch_add(n as u64, Ordering::Relaxed);
                }
                Ok(written)
            }
            Err(sqlx::Error::Database(d)) if d.constraint() == Some("run_event_pkey") => {
                let first = db::journal::events_after(&self.pool, self.run, self.next_seq - 1, 1).await?;
                match first.first() {
                    Some(e) if e.seq == self.next_seq && e.kind == first_kind => Ok(true),
                    _ => Err(sqlx::Error::Protocol(format!(
                        "seq {} of run {} is taken by another writer",
                        self.next_seq, self.run
                    ))),
                }
            }
            Err(e) => Err(e),
        }
    }

    fn give_up(&mut self) {
        self.state.store(GAVE_UP, Ordering::Release);
        self.stats.gave_up.fetch_add(1, Ordering::Relaxed);
        self.pending = None;
        self.unsent.clear();
        self.unsent_bytes = 0;
        for ack in self.waiting.drain(..) {
            let _ = ack.send(Err(gave_up_error()));
        }
        self.gave_up.cancel();
    }
}

/// One run's batch handed to the group.
struct Batch {
    run: RunId,
    token: ClaimToken,
    first_seq: i32,
    events: Vec<(String, Value, Op)>,
    bytes: usize,
    urgent: bool,
    /// `Ok(true)` written, `Ok(false)` fenced (nothing written).
    reply: oneshot::Sender<Result<bool, sqlx::Error>>,
}

/// The process's journal group commit (see the module docs): a task that
/// writes the batches handed to it, all those due together in one
/// statement, and the flush clock the writers align their deltas to.
/// Cheap to clone; the task ends when every handle is gone.
#[derive(Clone)]
pub struct JournalGroup {
    pool: PgPool,
    batches: mpsc::Sender<Batch>,
    /// The clock's origin and tick: deltas are due at `t0 + k * every`.
    t0: Instant,
    every: Duration,
}

impl JournalGroup {
    /// Starts the group's task; `flush_every` is the flush clock's tick.
    pub fn start(pool: PgPool, flush_every: Duration, stats: Arc<JournalStats>) -> JournalGroup {
        let gather = GATHER_DEFAULT.min(flush_every / 4);
        JournalGroup::start_with_gather(pool, flush_every, gather, stats)
    }

    /// [`JournalGroup::start`] waiting `gather` after a tick's first batch
    /// (or an urgent one's) for the others: tests make it long, to know
    /// which batches share a commit.
    pub fn start_with_gather(
        pool: PgPool,
        flush_every: Duration,
        gather: Duration,
        stats: Arc<JournalStats>,
    ) -> JournalGroup {
        let (batches, rx) = mpsc::channel(GROUP_QUEUE_MAX);
        let every = flush_every.max(Duration::from_millis(1));
        tokio::spawn(group_task(pool.clone(), rx, gather, stats));
        JournalGroup { pool, batches, t0: Instant::now(), every }
    }

    /// When deltas merged since `since` are due: the clock's first tick
    /// after `since` (so at most one tick later, and at the same instant
    /// as every other run's).
    pub fn due(&self, since: Instant) -> Instant {
        let every = self.every.as_nanos();
        let ticks = since.saturating_duration_since(self.t0).as_nanos() / every + 1;
        self.t0 + Duration::from_nanos((ticks * every).min(u64::MAX as u128) as u64)
    }

    /// Hands a batch to the group and waits for its commit: `Ok(true)`
    /// written, `Ok(false)` fenced.
    async fn append(
        &self,
        run: RunId,
        token: ClaimToken,
        first_seq: i32,
        events: Vec<(String, Value, Op)>,
        urgent: bool,
    ) -> Result<bool, sqlx::Error> {
        let bytes = events.iter().map(|(k, v, _)| k.len() + text::json_bytes(v)).sum();
        let (reply, answer) = oneshot::channel();
        let batch = Batch { run, token, first_seq, events, bytes, urgent, reply };
        if self.batches.send(batch).await.is_err() {
            return Err(sqlx::Error::Protocol("the journal group has stopped".into()));
        }
        answer.await.unwrap_or_else(|_| Err(sqlx::Error::Protocol("the journal group has stopped".into())))
    }
}

/// The group's task: gathers the batches due together, writes them in one
/// statement (bounded in rows and bytes), and answers each writer.
async fn group_task(pool: PgPool, mut rx: mpsc::Receiver<Batch>, gather: Duration, stats: Arc<JournalStats>) {
    let mut queue: std::collections::VecDeque<Batch> = std::collections::VecDeque::new();
    loop {
        if queue.is_empty() {
            match rx.recv().await {
                Some(b) => queue.push_back(b),
                None => return,
            }
        }
        // A tick's first batch waits `gather` for the rest of the tick; an
        // urgent one (or a leftover past the bounds) does not wait.
        let mut commit_at = Instant::now() + gather;
        let mut closed = false;
        loop {
            let (rows, bytes): (usize, usize) =
                queue.iter().fold((0, 0), |(r, b), x| (r + x.events.len(), b + x.bytes));
            if queue.iter().any(|b| b.urgent) || rows >= GROUP_ROWS_MAX || bytes >= GROUP_BYTES_MAX {
                commit_at = Instant::now();
            }
            // Whatever is already waiting rides along.
            while let Ok(b) = rx.try_recv() {
                if b.urgent {
                    commit_at = Instant::now();
                }
                queue.push_back(b);
            }
            if Instant::now() >= commit_at || closed {
                break;
            }
            tokio::select! {
                b = rx.recv() => match b {
                    Some(b) => queue.push_back(b),
                    None => closed = true,
                },
                _ = tokio::time::sleep_until(commit_at) => {}
            }
        }
        // Take batches up to the bounds (always the first, however large).
        let (mut rows, mut bytes, mut take) = (0, 0, 0);
        for b in &queue {
            if take > 0 && (rows + b.events.len() > GROUP_ROWS_MAX || bytes + b.bytes > GROUP_BYTES_MAX) {
                break;
            }
            rows += b.events.len();
            bytes += b.bytes;
            take += 1;
        }
        let batches: Vec<Batch> = queue.drain(..take).collect();
        commit(&pool, batches, &stats).await;
    }
}

/// One group commit, and each writer's answer.
async fn commit(pool: &PgPool, batches: Vec<Batch>, stats: &JournalStats) {
    let parts: Vec<db::journal::GroupPart<'_>> = batches
        .iter()
        .map(|b| db::journal::GroupPart { run: b.run, token: b.token, first_seq: b.first_seq, events: &b.events })
        .collect();
    match db::journal::append_group(pool, &parts).await {
        Ok(written) => {
            count(stats, &batches, &written);
            drop(parts);
            for b in batches {
                let ok = written.runs.contains(&b.run);
                let _ = b.reply.send(Ok(ok));
            }
        }
        Err(sqlx::Error::Database(e)) if batches.len() > 1 => {
            // One part broke the statement (a seq already committed by an
            // attempt whose answer was lost): each part alone, so the
            // error reaches its own writer and the others are written.
            tracing::debug!(error = %e, batches = batches.len(), "journal group commit failed; writing its parts one by one");
            drop(parts);
            for b in batches {
                let part =
                    [db::journal::GroupPart { run: b.run, token: b.token, first_seq: b.first_seq, events: &b.events }];
                let r = db::journal::append_group(pool, &part).await;
                if let Ok(written) = &r {
                    count(stats, std::slice::from_ref(&b), written);
                }
                let _ = b.reply.send(r.map(|w| w.runs.contains(&b.run)));
            }
        }
        Err(e) => {
            let message = e.to_string();
            drop(parts);
            let mut e = Some(e);
            for b in batches {
                // Each writer retries on its own clock; the first gets the
                // error itself (its kind matters to the writer), the rest its text.
                let err = e.take().unwrap_or_else(|| sqlx::Error::Protocol(message.clone()));
                let _ = b.reply.send(Err(err));
            }
        }
    }
}

fn count(stats: &JournalStats, batches: &[Batch], written: &db::journal::GroupWritten) {
    let rows: usize = batches.iter().filter(|b| written.runs.contains(&b.run)).map(|b| b.events.len()).sum();
    stats.group_commits.fetch_add(1, Ordering::Relaxed);
    stats.group_rows.fetch_add(rows as u64, Ordering::Relaxed);
    stats.group_rows_max.fetch_max(rows as u64, Ordering::Relaxed);
    stats.group_batches.fetch_add(batches.len() as u64, Ordering::Relaxed);
    stats.group_fenced.fetch_add((batches.len() - written.runs.len().min(batches.len())) as u64, Ordering::Relaxed);
    if written.notified {
        stats.group_notifies.fetch_add(1, Ordering::Relaxed);
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
