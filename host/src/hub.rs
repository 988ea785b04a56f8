//! The hub: one LISTEN connection per process, fanned out in-process.
//!
//! A single supervisor task owns the connection and every LISTEN/UNLISTEN, so
//! a reconnect cannot race a subscribe. Subscriber queues are bounded and drop
//! on overflow: a wake only ever means "something changed", and a full queue
//! already holds a pending wake. Signals are hints; rows are truth: every
//! consumer re-reads its rows and keeps a poll interval as its fallback, so a
//! lost NOTIFY (or the hub being down) costs latency, never correctness.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio::sync::{mpsc, oneshot};

/// Wakes a subscriber can hold before further ones are dropped.
pub const SUBSCRIBER_QUEUE_MAX: usize = 16;
/// Commands (subscribe/unsubscribe) waiting for the supervisor.
const COMMAND_QUEUE_MAX: usize = 1024;
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Bound on one connection attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a subscriber was woken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wake {
    /// A NOTIFY on the channel, with its payload.
    Notify(String),
    /// The connection was (re)established: notifies may have been missed.
    Reconnected,
}

enum Command {
    Subscribe { channel: String, id: u64, tx: mpsc::Sender<Wake>, ack: oneshot::Sender<()> },
    Unsubscribe { channel: String, id: u64 },
}

#[derive(Debug, Default)]
pub struct HubStats {
    pub connected: AtomicBool,
    pub reconnects: AtomicU64,
    pub notifications: AtomicU64,
    pub dropped: AtomicU64,
}

/// Handle to the process's hub. Cheap to clone.
#[derive(Clone)]
pub struct Hub {
    commands: mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
    stats: Arc<HubStats>,
}

/// A live subscription; dropping it unsubscribes.
pub struct Subscription {
    rx: mpsc::Receiver<Wake>,
    channel: String,
    id: u64,
    commands: mpsc::Sender<Command>,
}

impl Subscription {
    /// The next wake, or `None` if the hub has shut down.
    pub async fn recv(&mut self) -> Option<Wake> {
        self.rx.recv().await
    }

    /// A wake already queued, without waiting.
    pub fn try_recv(&mut self) -> Option<Wake> {
        self.rx.try_recv().ok()
    }

    /// Discards wakes already queued (the caller is about to re-read rows).
    pub fn drain(&mut self) {
        while self.rx.try_recv().is_ok() {}
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let _ =
            self.commands.try_send(Command::Unsubscribe { channel: std::mem::take(&mut self.channel), id: self.id });
    }
}

impl Hub {
    /// Starts the supervisor. It connects in the background and keeps
    /// reconnecting with backoff; until it is connected, subscribers simply
    /// get no wakes and fall back to their poll intervals.
    pub fn start(url: String) -> Hub {
        let (commands, rx) = mpsc::channel(COMMAND_QUEUE_MAX);
        let stats = Arc::new(HubStats::default());
        tokio::spawn(supervise(url, rx, stats.clone()));
        Hub { commands, next_id: Arc::new(AtomicU64::new(1)), stats }
    }

    pub fn stats(&self) -> &HubStats {
        &self.stats
    }

    /// Subscribes to a channel. Returns once the LISTEN is in place (or the hub
    /// is disconnected, in which case the reconnect will wake this subscriber):
    /// subscribe before reading rows, and no wake can fall in the gap.
    pub async fn subscribe(&self, channel: &str) -> Subscription {
        let (tx, rx) = mpsc::channel(SUBSCRIBER_QUEUE_MAX);
        let (ack, acked) = oneshot::channel();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let cmd = Command::Subscribe { channel: channel.to_string(), id, tx, ack };
        if self.commands.send(cmd).await.is_ok() {
            let _ = acked.await;
        }
        Subscription { rx, channel: channel.to_string(), id, commands: self.commands.clone() }
    }
}

struct Subscribers {
    by_channel: HashMap<String, Vec<(u64, mpsc::Sender<Wake>)>>,
}

impl Subscribers {
    fn send(&self, stats: &HubStats, channel: &str, wake: &Wake) {
        if let Some(subs) = self.by_channel.get(channel) {
            for (_, tx) in subs {
                if tx.try_send(wake.clone()).is_err() {
                    stats.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    fn wake_all(&self, stats: &HubStats) {
        for channel in self.by_channel.keys() {
            self.send(stats, channel, &Wake::Reconnected);
        }
    }
}

async fn supervise(url: String, mut commands: mpsc::Receiver<Command>, stats: Arc<HubStats>) {
    let mut subs = Subscribers { by_channel: HashMap::new() };
    let mut listener: Option<PgListener> = None;
    let mut backoff = BACKOFF_MIN;
    let mut ever_connected = false;
    loop {
        let Some(conn) = listener.as_mut() else {
            // Connect while still serving subscribes: a subscriber must never
            // wait on a database that is down, only fall back to polling.
            let connecting = tokio::time::timeout(CONNECT_TIMEOUT, PgListener::connect(&url));
            tokio::pin!(connecting);
            let result = loop {
                tokio::select! {
                    r = &mut connecting => break r,
                    cmd = commands.recv() => match cmd {
                        Some(cmd) => { handle(cmd, &mut subs, None).await; }
                        None => return,
                    },
                }
            };
            let result = match result {
                Ok(Ok(mut l)) => {
                    let channels: Vec<&str> = subs.by_channel.keys().map(String::as_str).collect();
                    match l.listen_all(channels).await {
                        Ok(()) => Ok(l),
                        Err(e) => Err(e.to_string()),
                    }
                }
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no connection within {CONNECT_TIMEOUT:?}")),
            };
            match result {
                Ok(l) => {
                    listener = Some(l);
                    backoff = BACKOFF_MIN;
                    stats.connected.store(true, Ordering::Relaxed);
                    if ever_connected {
                        stats.reconnects.fetch_add(1, Ordering::Relaxed);
                        tracing::info!("hub reconnected");
                    }
                    ever_connected = true;
                    // Anything may have happened while we were away.
                    subs.wake_all(&stats);
                }
                Err(e) => {
                    tracing::warn!(error = %e, ?backoff, "hub connect failed; subscribers fall back to polling");
                    let sleep = tokio::time::sleep(backoff);
                    tokio::pin!(sleep);
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    loop {
                        tokio::select! {
                            _ = &mut sleep => break,
                            cmd = commands.recv() => match cmd {
                                Some(cmd) => { handle(cmd, &mut subs, None).await; }
                                None => return,
                            },
                        }
                    }
                }
            }
            continue;
        };
        tokio::select! {
            cmd = commands.recv() => match cmd {
                Some(cmd) => {
                    if !handle(cmd, &mut subs, Some(conn)).await {
                        lost(&mut listener, &stats, &subs);
                    }
                }
                None => return,
            },
            n = conn.try_recv() => match n {
                Ok(Some(n)) => {
                    stats.notifications.fetch_add(1, Ordering::Relaxed);
                    subs.send(&stats, n.channel(), &Wake::Notify(n.payload().to_string()));
                }
                Ok(None) | Err(_) => lost(&mut listener, &stats, &subs),
            },
        }
    }
}

fn lost(listener: &mut Option<PgListener>, stats: &HubStats, subs: &Subscribers) {
    tracing::warn!("hub connection lost; reconnecting");
    *listener = None;
    stats.connected.store(false, Ordering::Relaxed);
    // Wake everyone now: they re-read their rows and poll until we are back.
    subs.wake_all(stats);
}

/// Applies one command. Returns false if the connection failed doing it.
async fn handle(cmd: Command, subs: &mut Subscribers, conn: Option<&mut PgListener>) -> bool {
    match cmd {
        Command::Subscribe { channel, id, tx, ack } => {
            let entry = subs.by_channel.entry(channel.clone()).or_default();
            let new_channel = entry.is_empty();
            entry.push((id, tx));
            let mut ok = true;
            if new_channel {
                if let Some(conn) = conn {
                    ok = conn.listen(&channel).await.is_ok();
                }
            }
            let _ = ack.send(());
            ok
        }
        Command::Unsubscribe { channel, id } => {
            let mut ok = true;
            if let Some(entry) = subs.by_channel.get_mut(&channel) {
                entry.retain(|(i, _)| *i != id);
                if entry.is_empty() {
                    subs.by_channel.remove(&channel);
                    if let Some(conn) = conn {
                        ok = conn.unlisten(&channel).await.is_ok();
                    }
                }
            }
            ok
        }
    }
}
