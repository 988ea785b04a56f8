//! The journal writer: one per run, owning the run's seq from
//! [`FIRST_RUN_SEQ`] on. Only [`crate::run::host::RunHost`] writes through it.
//!
//! Consecutive deltas of one stream merge in memory and flush on a clock
//! (250 ms by default); a structural event flushes the buffer and is written
//! through at once. Every flush is one fenced, all-or-nothing statement that
//! also NOTIFYs the run's tails. If the fence trips, nothing is written,
//! nothing is announced, and the run is told to stop (`lost`).
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
    /// Prepares the writer for seqs `first_seq..`. `lost` is cancelled if the
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
        let state = Arc::new(AtomicU8::new(OPEN));
        let gave_up = CancellationToken::new();
        let writer = Writer {
            pool,
            run,
            token,
            next_seq: first_seq,
            channel: db::notify::events_channel(run),
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
    run: RunId,
    token: ClaimToken,
    next_seq: i32,
    channel: String,
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
                (None, Some(p)) => Some(p.since + self.config.flush_every),
                (None, None) => None,
            };
            let cmd = tokio::select! {
                cmd = rx.recv() => cmd,
                _ = sleep_until(deadline) => {
                    self.flush().await;
                    continue;
                }
            };
            match cmd {
                None => {
                    // Every handle is gone (the run task was dropped): write what we have.
                    self.flush().await;
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
                            self.flush().await;
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
            self.flush().await;
            if self.done() || self.unsent.is_empty() {
                return;
            }
        }
    }

    /// One attempt to write everything unsent (in batches), acking waiting
    /// emitters once their events are committed.
    async fn flush(&mut self) {
        if self.done() {
            return;
        }
        if self.retry_at.is_none() || self.retry_at.is_some_and(|at| at <= Instant::now()) {
            self.retry_at = None;
        } else {
            return;
        }
        if self.pending.as_ref().is_some_and(|p| p.since + self.config.flush_every <= Instant::now()) {
            self.take_pending();
        }
        while !self.unsent.is_empty() {
            let n = self.unsent.len().min(BATCH_EVENTS_MAX);
            match self.write_batch(n).await {
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

    /// Writes the first `n` unsent events. A unique violation on the seq means
    /// an earlier attempt committed although its answer was lost: the batch is
    /// written, and is not written again.
    async fn write_batch(&mut self, n: usize) -> Result<bool, sqlx::Error> {
        let events: Vec<(&str, Value)> = self.unsent[..n].iter().map(|(k, v, _)| (k.as_str(), v.clone())).collect();
        let ops: Vec<Op> = self.unsent[..n].iter().map(|e| e.2).collect();
        let channel = Some(self.channel.as_str());
        let r =
            db::journal::append_numbered(&self.pool, self.run, self.token, self.next_seq, &events, &ops, channel).await;
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
                    Some(e) if e.seq == self.next_seq && e.kind == events[0].0 => Ok(true),
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

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
