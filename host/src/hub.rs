//! The hub: one LISTEN connection per process, fanned out in-process.
//!
//! A single supervisor task owns the connection, the subscriber lists and
//! every LISTEN/UNLISTEN, so a reconnect cannot race a subscribe. Subscriber
//! queues are bounded and drop on overflow: a wake only ever means "something
//! changed", and a full queue already holds a pending wake. Signals are hints;
//! rows are truth: every consumer re-reads its rows and keeps a poll interval
//! as its fallback, so a lost NOTIFY (or the hub being down) costs latency,
//! never correctness.
//!
//! Unsubscribing cannot be lost: a dropped [`Subscription`] closes its queue
//! and wakes the supervisor through a [`Notify`] (a permit, never a queue
//! that can be full); the supervisor then prunes every subscriber whose queue
//! is closed and UNLISTENs each channel left without one. A subscribe
//! abandoned half-way (its future dropped) is pruned the same way.
//!
//! Journal wakes come on one channel: the connection always LISTENs on
//! [`RUN_EVENTS`], where every journal group commit NOTIFYs once with the
//! runs it wrote, and the hub fans each such notification out to the
//! subscribers of each named run's `events_channel` (all of them for
//! [`crate::db::notify::RUN_EVENTS_ALL`]). Tails keep subscribing to their run's own channel,
//! which also carries the run's ending. Callers:
//! the dispatcher, the canceller and the SSE tails subscribe; `/metrics`
//! reads [`HubStats`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot, Notify};

use crate::db::notify::{run_events_payload, EVENTS_CHANNEL_PREFIX, RUN_EVENTS};

/// Wakes a subscriber can hold before further ones are dropped.
pub const SUBSCRIBER_QUEUE_MAX: usize = 16;
/// Subscribes waiting for the supervisor; a subscriber waits when it is full.
/// Unsubscribing never goes through it.
pub const COMMAND_QUEUE_MAX: usize = 1024;
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Bound on one connection attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The LISTEN session's `application_name`: operators (and tests) find the
/// hub's connection by it, never by the text of its statements.
pub const APPLICATION_NAME: &str = "agent-host-hub";

/// `url` with the hub's application name.
fn listen_url(url: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={APPLICATION_NAME}")
}

/// Why a subscriber was woken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wake {
    /// A NOTIFY on the channel, with its payload.
    Notify(String),
    /// The connection was (re)established: notifies may have been missed.
    Reconnected,
}

struct Subscribe {
    channel: String,
    tx: mpsc::Sender<Wake>,
    ack: oneshot::Sender<()>,
}

/// The hub's counters, read by `/metrics` and tests.
#[derive(Debug, Default)]
pub struct HubStats {
    pub connected: AtomicBool,
    pub reconnects: AtomicU64,
    pub notifications: AtomicU64,
    /// Wakes dropped on a subscriber's full queue.
    pub dropped: AtomicU64,
    /// Subscribers removed because their receiver was gone.
    pub pruned: AtomicU64,
    subscribers: AtomicU64,
    channels: AtomicU64,
}

impl HubStats {
    /// Live subscribers, as of the supervisor's last change.
    pub fn subscribers(&self) -> u64 {
        self.subscribers.load(Ordering::Relaxed)
    }

    /// Channels with at least one subscriber: the ones the connection
    /// LISTENs on while it is up.
    pub fn channels(&self) -> u64 {
        self.channels.load(Ordering::Relaxed)
    }
}

/// Handle to the process's hub. Cheap to clone.
#[derive(Clone)]
pub struct Hub {
    commands: mpsc::Sender<Subscribe>,
    /// Wakes the supervisor to prune closed subscribers.
    prune: Arc<Notify>,
    stats: Arc<HubStats>,
}

/// A live subscription; dropping it unsubscribes.
pub struct Subscription {
    rx: mpsc::Receiver<Wake>,
    prune: Arc<Notify>,
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
        // Close first, then wake: the supervisor's prune must see this queue
        // closed. `notify_one` stores a permit if the supervisor is busy, so
        // a burst of drops costs one prune and none is lost.
        self.rx.close();
        self.prune.notify_one();
    }
}

impl Hub {
    /// Starts the supervisor. It connects in the background and keeps
    /// reconnecting with backoff; until it is connected, subscribers simply
    /// get no wakes and fall back to their poll intervals.
    pub fn start(url: String) -> Hub {
        let (commands, rx) = mpsc::channel(COMMAND_QUEUE_MAX);
        let stats = Arc::new(HubStats::default());
        let prune = Arc::new(Notify::new());
        tokio::spawn(supervise(url, rx, prune.clone(), stats.clone()));
        Hub { commands, prune, stats }
    }

    pub fn stats(&self) -> &HubStats {
        &self.stats
    }

    /// Subscribes to a channel. Returns once the LISTEN is in place (or the hub
    /// is disconnected, in which case the reconnect will wake this subscriber):
    /// subscribe before reading rows, and no wake can fall in the gap.
    pub async fn subscribe(&self, channel: &str) -> Subscription {
        let (tx, rx) = mpsc::channel(SUBSCRIBER_QUEUE_MAX);
        // Built before the first await: if this future is dropped half-way,
        // the subscription's drop still closes the queue and asks for a prune.
        let subscription = Subscription { rx, prune: self.prune.clone() };
        let (ack, acked) = oneshot::channel();
        if self.commands.send(Subscribe { channel: channel.to_string(), tx, ack }).await.is_ok() {
            let _ = acked.await;
        }
        subscription
    }
}

/// The supervisor's subscriber lists, by channel. A channel is a key exactly
/// while it has a subscriber, and then (while connected) it is LISTENed.
#[derive(Default)]
struct Subscribers {
    by_channel: HashMap<String, Vec<mpsc::Sender<Wake>>>,
    count: u64,
}

impl Subscribers {
    /// Wakes the channel's subscribers; returns whether one was found closed.
    fn send(&self, stats: &HubStats, channel: &str, wake: &Wake) -> bool {
        let mut closed = false;
        for tx in self.by_channel.get(channel).into_iter().flatten() {
            match tx.try_send(wake.clone()) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => {
                    stats.dropped.fetch_add(1, Ordering::Relaxed);
                }
                Err(TrySendError::Closed(_)) => closed = true,
            }
        }
        closed
    }

    /// Fans a [`RUN_EVENTS`] notification out to the runs it names (every
    /// run's channel for [`crate::db::notify::RUN_EVENTS_ALL`]); returns whether a subscriber
    /// was found closed.
    fn send_run_events(&self, stats: &HubStats, payload: &str) -> bool {
        let wake = Wake::Notify(RUN_EVENTS.to_string());
        let mut closed = false;
        match run_events_payload(payload) {
            Some(ids) => {
                let mut channel = String::with_capacity(EVENTS_CHANNEL_PREFIX.len() + 32);
                for id in ids {
                    channel.clear();
                    channel.push_str(EVENTS_CHANNEL_PREFIX);
                    channel.push_str(id);
                    if self.by_channel.contains_key(&channel) {
                        closed |= self.send(stats, &channel, &wake);
                    }
                }
            }
            None => {
                for channel in self.by_channel.keys().filter(|c| c.starts_with(EVENTS_CHANNEL_PREFIX)) {
                    closed |= self.send(stats, channel, &wake);
                }
            }
        }
        closed
    }

    fn wake_all(&self, stats: &HubStats) {
        for channel in self.by_channel.keys() {
            self.send(stats, channel, &Wake::Reconnected);
        }
    }

    /// Adds a subscriber; returns whether its channel is new (needs a LISTEN).
    fn add(&mut self, channel: &str, tx: mpsc::Sender<Wake>) -> bool {
        let entry = self.by_channel.entry(channel.to_string()).or_default();
        let new_channel = entry.is_empty();
        entry.push(tx);
        self.count += 1;
        new_channel
    }

    /// Removes every subscriber whose receiver is gone; returns the channels
    /// left without subscribers (to UNLISTEN).
    fn prune(&mut self, stats: &HubStats) -> Vec<String> {
        let mut emptied = Vec::new();
        let mut pruned = 0;
        self.by_channel.retain(|channel, txs| {
            let before = txs.len();
            txs.retain(|tx| !tx.is_closed());
            pruned += (before - txs.len()) as u64;
            if txs.is_empty() {
                emptied.push(channel.clone());
            }
            !txs.is_empty()
        });
        self.count -= pruned;
        stats.pruned.fetch_add(pruned, Ordering::Relaxed);
        emptied
    }

    fn publish(&self, stats: &HubStats) {
        stats.subscribers.store(self.count, Ordering::Relaxed);
        stats.channels.store(self.by_channel.len() as u64, Ordering::Relaxed);
    }
}

/// What the supervisor is asked to do besides reading notifications.
enum Input {
    Subscribe(Subscribe),
    Prune,
}

/// The next subscribe or prune request; `None` once every `Hub` is gone.
async fn next_input(commands: &mut mpsc::Receiver<Subscribe>, prune: &Notify) -> Option<Input> {
    tokio::select! {
        cmd = commands.recv() => cmd.map(Input::Subscribe),
        _ = prune.notified() => Some(Input::Prune),
    }
}

async fn supervise(url: String, mut commands: mpsc::Receiver<Subscribe>, prune: Arc<Notify>, stats: Arc<HubStats>) {
    let mut subs = Subscribers::default();
    let mut listener: Option<PgListener> = None;
    let mut backoff = BACKOFF_MIN;
    let mut ever_connected = false;
    loop {
        let Some(conn) = listener.as_mut() else {
            // Connect while still serving subscribes: a subscriber must never
            // wait on a database that is down, only fall back to polling.
            let url = listen_url(&url);
            let connecting = tokio::time::timeout(CONNECT_TIMEOUT, PgListener::connect(&url));
            tokio::pin!(connecting);
            let result = loop {
                tokio::select! {
                    r = &mut connecting => break r,
                    input = next_input(&mut commands, &prune) => match input {
                        Some(input) => { handle(input, &mut subs, &stats, None).await; }
                        None => return,
                    },
                }
            };
            let result = match result {
                Ok(Ok(mut l)) => {
                    // The group commits' channel, always; then every subscribed one.
                    let channels: Vec<&str> = std::iter::once(RUN_EVENTS)
                        .chain(subs.by_channel.keys().map(String::as_str).filter(|c| *c != RUN_EVENTS))
                        .collect();
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
                            input = next_input(&mut commands, &prune) => match input {
                                Some(input) => { handle(input, &mut subs, &stats, None).await; }
                                None => return,
                            },
                        }
                    }
                }
            }
            continue;
        };
        tokio::select! {
            input = next_input(&mut commands, &prune) => match input {
                Some(input) => {
                    if !handle(input, &mut subs, &stats, Some(conn)).await {
                        lost(&mut listener, &stats, &subs);
                    }
                }
                None => return,
            },
            n = conn.try_recv() => match n {
                Ok(Some(n)) => {
                    stats.notifications.fetch_add(1, Ordering::Relaxed);
                    let closed = if n.channel() == RUN_EVENTS {
                        subs.send_run_events(&stats, n.payload())
                            | subs.send(&stats, RUN_EVENTS, &Wake::Notify(n.payload().to_string()))
                    } else {
                        subs.send(&stats, n.channel(), &Wake::Notify(n.payload().to_string()))
                    };
                    // A closed subscriber found here is pruned now, not at
                    // its drop's wake (which may already have been taken).
                    if closed
                        && !handle(Input::Prune, &mut subs, &stats, Some(conn)).await
                    {
                        lost(&mut listener, &stats, &subs);
                    }
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

/// Applies one input. Returns false if the connection failed doing it (the
/// lists are updated regardless: a reconnect LISTENs on exactly their keys).
async fn handle(input: Input, subs: &mut Subscribers, stats: &HubStats, conn: Option<&mut PgListener>) -> bool {
    let ok = match input {
        Input::Subscribe(Subscribe { channel, tx, ack }) => {
            let mut ok = true;
            // Abandoned before we got to it: nothing to add, nothing to LISTEN.
            // RUN_EVENTS is LISTENed from the connection's start, for good.
            if !tx.is_closed() && subs.add(&channel, tx) && channel != RUN_EVENTS {
                if let Some(conn) = conn {
                    ok = conn.listen(&channel).await.is_ok();
                }
            }
            let _ = ack.send(());
            ok
        }
        Input::Prune => {
            let mut ok = true;
            let emptied = subs.prune(stats);
            if let Some(conn) = conn {
                for channel in emptied.into_iter().filter(|c| c != RUN_EVENTS) {
                    if conn.unlisten(&channel).await.is_err() {
                        ok = false;
                        break;
                    }
                }
            }
            ok
        }
    };
    subs.publish(stats);
    ok
}
