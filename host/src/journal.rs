//! The journal writer: one per run, owning the run's seq from 4 on.
//!
//! Consecutive deltas of one stream merge in memory and flush on a clock
//! (250 ms by default); a structural event flushes the buffer and is written
//! through at once. Every flush is one fenced, all-or-nothing statement that
//! also NOTIFYs the run's tails. If the fence trips, nothing is written,
//! nothing is announced, and the run is told to stop.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::run::error::HostError;
use crate::db::events::CONTENT_DELTA as DELTA_KIND;
use crate::db::{self, ClaimToken, RunId};

pub const FLUSH_DEFAULT: Duration = Duration::from_millis(250);
/// Commands waiting for the writer; emitters wait when it is full.
const QUEUE_MAX: usize = 256;
/// Bytes of merged delta text before a flush regardless of the clock.
const PENDING_BYTES_MAX: usize = 64 * 1024;
/// Events kept for a retry after a failed flush before the run gives up.
const UNSENT_MAX: usize = 1024;

/// Journal counters for the process.
#[derive(Debug, Default)]
pub struct JournalStats {
    pub flushes: AtomicU64,
    pub rows: AtomicU64,
    pub deltas_in: AtomicU64,
}

enum Cmd {
    Delta(Value),
    Event { kind: String, payload: Value, ack: oneshot::Sender<Result<(), HostError>> },
    Flush { ack: oneshot::Sender<Result<(), HostError>> },
}

/// Handle to a run's writer. The writer task starts with the first event, so
/// a run that emits nothing costs nothing here.
pub struct Journal {
    running: Option<(mpsc::Sender<Cmd>, JoinHandle<()>)>,
    idle: Option<Writer>,
    fenced: Arc<AtomicBool>,
}

impl Journal {
    /// Prepares the writer. `lost` is cancelled if the fence trips.
    pub fn start(
        pool: PgPool,
        run: RunId,
        token: ClaimToken,
        first_seq: i32,
        flush_every: Duration,
        lost: CancellationToken,
        stats: Arc<JournalStats>,
    ) -> Journal {
        let fenced = Arc::new(AtomicBool::new(false));
        let writer = Writer {
            pool,
            run,
            token,
            next_seq: first_seq,
            channel: db::notify::events_channel(run),
            flush_every,
            pending: None,
            unsent: Vec::new(),
            retry_at: Instant::now(),
            fenced: fenced.clone(),
            lost,
            stats,
        };
        Journal { running: None, idle: Some(writer), fenced }
    }

    fn sender(&mut self) -> Result<&mpsc::Sender<Cmd>, HostError> {
        if self.fenced.load(Ordering::Relaxed) {
            return Err(HostError::Fenced);
        }
        if let Some(writer) = self.idle.take() {
            let (tx, rx) = mpsc::channel(QUEUE_MAX);
            self.running = Some((tx, tokio::spawn(writer.run(rx))));
        }
        Ok(&self.running.as_ref().expect("writer started").0)
    }

    /// A delta: buffered, merged with its neighbours of the same stream.
    pub async fn delta(&mut self, payload: Value) -> Result<(), HostError> {
        self.sender()?.send(Cmd::Delta(payload)).await.map_err(|_| HostError::Fenced)
    }

    /// A structural event: flushes the buffer and is written at once.
    pub async fn event(&mut self, kind: &str, payload: Value) -> Result<(), HostError> {
        let (ack, done) = oneshot::channel();
        self.sender()?
            .send(Cmd::Event { kind: kind.to_string(), payload, ack })
            .await
            .map_err(|_| HostError::Fenced)?;
        done.await.map_err(|_| HostError::Fenced)?
    }

    /// Flushes and stops the writer; the run's next seq then belongs to the
    /// terminal write.
    pub async fn close(mut self) -> Result<(), HostError> {
        let Some((tx, task)) = self.running.take() else {
            return Ok(()); // nothing was ever emitted
        };
        let (ack, done) = oneshot::channel();
        let r = match tx.send(Cmd::Flush { ack }).await {
            Ok(()) => done.await.unwrap_or(Err(HostError::Fenced)),
            Err(_) => Err(HostError::Fenced),
        };
        drop(tx);
        let _ = task.await;
        r
    }
}

struct Pending {
    /// The first delta's payload; its `delta` grows as neighbours merge.
    payload: Value,
    text: String,
    since: Instant,
}

struct Writer {
    pool: PgPool,
    run: RunId,
    token: ClaimToken,
    next_seq: i32,
    channel: String,
    flush_every: Duration,
    pending: Option<Pending>,
    /// Events of a flush that failed (database unreachable), retried first.
    unsent: Vec<(String, Value)>,
    retry_at: Instant,
    fenced: Arc<AtomicBool>,
    lost: CancellationToken,
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
    async fn run(mut self, mut rx: mpsc::Receiver<Cmd>) {
        loop {
            let deadline = match &self.pending {
                Some(p) => Some(p.since + self.flush_every),
                None if !self.unsent.is_empty() => Some(self.retry_at),
                None => None,
            };
            let cmd = tokio::select! {
                cmd = rx.recv() => cmd,
                _ = sleep_until(deadline) => {
                    let _ = self.write(None).await;
                    continue;
                }
            };
            match cmd {
                None => {
                    let _ = self.write(None).await;
                    return;
                }
                Some(Cmd::Delta(payload)) => {
                    self.stats.deltas_in.fetch_add(1, Ordering::Relaxed);
                    let text = payload.get("delta").and_then(Value::as_str).unwrap_or_default().to_string();
                    let merge = self.pending.as_ref().is_some_and(|p| same_stream(&p.payload, &payload));
                    if merge {
                        self.pending.as_mut().unwrap().text.push_str(&text);
                    } else {
                        let _ = self.write(None).await;
                        self.pending = Some(Pending { payload, text, since: Instant::now() });
                    }
                    if self.pending.as_ref().is_some_and(|p| p.text.len() >= PENDING_BYTES_MAX) {
                        let _ = self.write(None).await;
                    }
                }
                Some(Cmd::Event { kind, payload, ack }) => {
                    let r = self.write(Some((kind, payload))).await;
                    let _ = ack.send(r);
                }
                Some(Cmd::Flush { ack }) => {
                    let r = self.write(None).await;
                    let _ = ack.send(r);
                }
            }
        }
    }

    /// One flush: retried events, the merged delta, then `event`, in one
    /// fenced statement.
    async fn write(&mut self, event: Option<(String, Value)>) -> Result<(), HostError> {
        if self.fenced.load(Ordering::Relaxed) {
            return Err(HostError::Fenced);
        }
        let mut batch = std::mem::take(&mut self.unsent);
        if let Some(p) = self.pending.take() {
            let mut payload = p.payload;
            payload["delta"] = Value::String(p.text);
            batch.push((DELTA_KIND.to_string(), payload));
        }
        batch.extend(event);
        if batch.is_empty() {
            return Ok(());
        }
        let events: Vec<(&str, Value)> = batch.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        match db::journal::append_events(&self.pool, self.run, self.token, self.next_seq, &events, Some(&self.channel))
            .await
        {
            Ok(true) => {
                self.next_seq += batch.len() as i32;
                self.stats.flushes.fetch_add(1, Ordering::Relaxed);
                self.stats.rows.fetch_add(batch.len() as u64, Ordering::Relaxed);
                Ok(())
            }
            Ok(false) => {
                self.fenced.store(true, Ordering::Relaxed);
                self.lost.cancel();
                Err(HostError::Fenced)
            }
            Err(e) => {
                tracing::warn!(error = %e, events = batch.len(), "journal flush failed; will retry");
                if batch.len() > UNSENT_MAX {
                    // The database has been gone too long to keep buffering.
                    self.fenced.store(true, Ordering::Relaxed);
                    self.lost.cancel();
                    return Err(HostError::Unavailable(e.to_string()));
                }
                self.unsent = batch;
                self.retry_at = Instant::now() + self.flush_every;
                Err(HostError::Unavailable(e.to_string()))
            }
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
