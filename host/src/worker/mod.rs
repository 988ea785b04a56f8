//! The worker side of a process: dispatcher (claim loop), run tasks (whose
//! ending `settle` decides), finisher (group-committed endings), `waker`
//! (the knock for a turn queued behind an ended run), `canceller` (the
//! cancel fast path), heartbeat, reaper, the waiting runs' scheduler
//! (`suspensions`), `shares` (a tenant's share of the slots), retention,
//! webhooks, schedules, and the two-phase drain.

mod canceller;
mod dispatcher;
mod finisher;
mod heartbeat;
mod reaper;
mod retention;
mod run_task;
mod schedules;
mod settle;
mod shares;
mod suspensions;
mod waker;
mod webhooks;

pub use webhooks::{
    secret_bytes as webhook_secret_bytes, sign as webhook_sign, tenant_key as webhook_tenant_key, WebhookConfig,
};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::agent::AgentRegistry;
use crate::db::{ClaimToken, ConversationId, RunId};
use crate::hub::Hub;

pub use finisher::{FINISH_BATCH_MAX, FINISH_WINDOW_DEFAULT, FINISH_WINDOW_MAX};
pub use reaper::sweep as reap_sweep;
pub use shares::TENANT_SLOT_SHARE_PCT_DEFAULT;

/// Article defaults.
pub const LEASE_DEFAULT: Duration = Duration::from_secs(30);
pub const HEARTBEAT_DEFAULT: Duration = Duration::from_secs(10);
pub const REAP_GRACE_DEFAULT: Duration = Duration::from_secs(30);
pub const REAP_INTERVAL_DEFAULT: Duration = Duration::from_secs(10);
pub const POLL_TICK_DEFAULT: Duration = Duration::from_secs(10);
pub const DRAIN_TIMEOUT_DEFAULT: Duration = Duration::from_secs(25);
pub const MAX_RUNS_DEFAULT: usize = 16;
pub const RETENTION_DEFAULT: Duration = Duration::from_secs(24 * 3600);
pub const RETENTION_INTERVAL_DEFAULT: Duration = Duration::from_secs(60);
/// How long a run may keep going after a stop before it is interrupted.
pub const CANCEL_GRACE_DEFAULT: Duration = Duration::from_secs(5);
/// How often due schedules are fired.
pub const SCHEDULE_TICK_DEFAULT: Duration = Duration::from_secs(1);
/// Rows one reaper pass ends at most; the next pass takes the rest.
pub const REAP_BATCH_MAX: i64 = 100;
/// Bound on waiting for aborted runs to write their ending after a drain timeout.
pub const ABORT_WAIT_MAX: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Runs executed at once (the semaphore the claim waits on).
    pub max_runs: usize,
    pub lease: Duration,
    pub heartbeat: Duration,
    pub reap_grace: Duration,
    pub reap_interval: Duration,
    /// The dispatcher's fallback poll when no wake arrives.
    pub poll_tick: Duration,
    pub drain_timeout: Duration,
    pub worker_id: String,
    /// How long content deltas merge before a journal flush.
    pub journal_flush: Duration,
    /// How long a run's journal flushes may keep failing (the database
    /// unreachable) before the run is given up and ends failed.
    pub journal_give_up: Duration,
    /// How long a terminal run's events are kept.
    pub retention: Duration,
    /// How often retention runs.
    pub retention_interval: Duration,
    /// How long a run may keep going after a stop is requested before the
    /// host interrupts it (the run still ends `cancelled`).
    pub cancel_grace: Duration,
    /// Running runs one tenant may have at most, across all processes
    /// (`None`: no cap; fairness alone orders the tenants).
    pub tenant_max_running: Option<u32>,
    /// The share of this process's slots one tenant may hold, in percent
    /// (rounded up, at least one slot); the rest stay free for the other
    /// tenants. The operator sets a tenant's own with `agent-host tenants
    /// share` (see `shares`).
    pub tenant_slot_share_pct: u8,
    /// Run the claim loop (false: this process only reaps and serves).
    pub dispatch: bool,
    /// Attempts a resumable run gets: after this many lost workers (or
    /// drains out of budget) it ends failed instead of going back to the queue.
    pub resume_attempts: u32,
    /// The completion-webhook sender (`None`: this process sends none).
    pub webhooks: Option<WebhookConfig>,
    /// How often due schedules are fired.
    pub schedule_tick: Duration,
    /// The operator's rules for what schedules enqueue (allowed webhooks).
    pub policy: Arc<crate::service::submit::Policy>,
    /// Group commit of endings: how long a batch of terminal writes waits for
    /// more after its first (at most [`FINISH_WINDOW_MAX`]; zero: only what
    /// is already queued shares a commit).
    pub finish_window: Duration,
    /// Runs submitted to this process's API start in their enqueue's
    /// statement when a slot is free and nothing else is queued
    /// ([`crate::db::lifecycle::Eager`]); false: every run is claimed.
    pub eager_start: bool,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            max_runs: MAX_RUNS_DEFAULT,
            lease: LEASE_DEFAULT,
            heartbeat: HEARTBEAT_DEFAULT,
            reap_grace: REAP_GRACE_DEFAULT,
            reap_interval: REAP_INTERVAL_DEFAULT,
            poll_tick: POLL_TICK_DEFAULT,
            drain_timeout: DRAIN_TIMEOUT_DEFAULT,
            worker_id: default_worker_id(),
            journal_flush: crate::run::journal::FLUSH_DEFAULT,
            journal_give_up: crate::run::journal::GIVE_UP_DEFAULT,
            retention: RETENTION_DEFAULT,
            retention_interval: RETENTION_INTERVAL_DEFAULT,
            cancel_grace: CANCEL_GRACE_DEFAULT,
            tenant_max_running: None,
            tenant_slot_share_pct: TENANT_SLOT_SHARE_PCT_DEFAULT,
            dispatch: true,
            resume_attempts: crate::db::lifecycle::RESUME_ATTEMPTS_DEFAULT,
            webhooks: None,
            schedule_tick: SCHEDULE_TICK_DEFAULT,
            policy: Arc::default(),
            finish_window: FINISH_WINDOW_DEFAULT,
            eager_start: true,
        }
    }
}

pub fn default_worker_id() -> String {
    let host = nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "host".into());
    format!("{host}-{}", std::process::id())
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error(
        "heartbeat ({heartbeat:?}) must be shorter than the lease ({lease:?}), or a healthy worker loses its runs"
    )]
    HeartbeatNotBelowLease { heartbeat: Duration, lease: Duration },
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    #[error("max runs must be between 1 and {max}, not {0}", max = crate::sandbox::MAX_RUNS_MAX)]
    MaxRuns(usize),
    #[error("a tenant's slot share must be 1-100 percent, not {0}")]
    SlotShare(u8),
    #[error("worker id must be 1-200 bytes")]
    WorkerId,
    #[error("finish window must be at most {max:?}, not {0:?}", max = FINISH_WINDOW_MAX)]
    FinishWindow(Duration),
}

impl WorkerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, d) in [
            ("lease", self.lease),
            ("heartbeat", self.heartbeat),
            ("reap interval", self.reap_interval),
            ("poll tick", self.poll_tick),
            ("journal flush", self.journal_flush),
            ("journal give-up", self.journal_give_up),
            ("retention interval", self.retention_interval),
            ("schedule tick", self.schedule_tick),
        ] {
            if d.is_zero() {
                return Err(ConfigError::Zero(name));
            }
        }
        if self.heartbeat >= self.lease {
            return Err(ConfigError::HeartbeatNotBelowLease { heartbeat: self.heartbeat, lease: self.lease });
        }
        if !(1..=crate::sandbox::MAX_RUNS_MAX).contains(&self.max_runs) {
            return Err(ConfigError::MaxRuns(self.max_runs));
        }
        if self.resume_attempts == 0 {
            return Err(ConfigError::Zero("resume attempts"));
        }
        if !(1..=100).contains(&self.tenant_slot_share_pct) {
            return Err(ConfigError::SlotShare(self.tenant_slot_share_pct));
        }
        if self.tenant_max_running == Some(0) {
            return Err(ConfigError::Zero("tenant max running"));
        }
        if self.worker_id.is_empty() || self.worker_id.len() > 200 {
            return Err(ConfigError::WorkerId);
        }
        if self.finish_window > FINISH_WINDOW_MAX {
            return Err(ConfigError::FinishWindow(self.finish_window));
        }
        if let Some(w) = &self.webhooks {
            if w.attempts_max == 0 {
                return Err(ConfigError::Zero("webhook attempts"));
            }
            for (name, d) in [("webhook backoff", w.backoff), ("webhook poll", w.poll)] {
                if d.is_zero() {
                    return Err(ConfigError::Zero(name));
                }
            }
        }
        Ok(())
    }
}

/// Calls `pass` every `period` until the services stop. The first tick is
/// immediate unless `skip_first` (the caller already did a pass). A slow pass
/// delays the next one rather than bunching them up.
async fn every<F, Fut>(shared: &Shared, period: Duration, skip_first: bool, mut pass: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    if skip_first {
        tick.tick().await;
    }
    loop {
        tokio::select! {
            _ = shared.stop_services.cancelled() => return,
            _ = tick.tick() => {}
        }
        pass().await;
    }
}

/// A run this process holds: what the heartbeat presents and whom it tells
/// when the run is lost.
struct Held {
    token: ClaimToken,
    /// The run's slot, until its ending is handed to the finisher, which may
    /// pass it straight to a run it claims (see `finisher`).
    slot: Slot,
    /// Cancelled when the fence shows the claim is gone: the run stops at once.
    lost: CancellationToken,
    /// Whose run it is: a tenant holds at most its share of the slots (`shares`).
    tenant: String,
    /// Fired when a stop is requested (cancel NOTIFY, or the flag on a heartbeat).
    cancel: CancellationToken,
    /// Woken when an instruction is queued for the run (steer NOTIFY): its
    /// task journals `steer_received`.
    steered: Arc<tokio::sync::Notify>,
}

/// A run's slot: its task's permit, taken by the finisher when the slot goes
/// straight to a run claimed with the ending; whatever is left goes when the
/// run's task ends.
type Slot = Arc<Mutex<Option<tokio::sync::OwnedSemaphorePermit>>>;

/// One ending for the finisher and whom to tell: `Ok(true)` written,
/// `Ok(false)` fenced.
pub(crate) struct Request {
    pub ending: crate::db::lifecycle::Ending,
    pub reply: tokio::sync::oneshot::Sender<Result<bool, sqlx::Error>>,
    /// The run's slot (`None`: its task keeps it until it ends).
    pub slot: Option<Slot>,
}

/// Counters a person (and `/metrics`) can read.
#[derive(Debug, Default)]
pub struct WorkerStats {
    /// Claim statements executed (whatever they returned).
    pub claim_rounds: AtomicU64,
    /// Runs claimed (eager starts included).
    pub claimed: AtomicU64,
    /// Runs started in their enqueue's statement (eager start), no claim made.
    pub eager_starts: AtomicU64,
    pub finished: AtomicU64,
    pub fenced: AtomicU64,
    pub backstopped: AtomicU64,
    pub reaped: AtomicU64,
    pub claim_conflicts: AtomicU64,
    /// Statements that wrote endings (group commit: several runs each).
    pub finish_commits: AtomicU64,
    pub heartbeat_errors: AtomicU64,
    /// Resumable runs the reaper put back in the queue (their worker was lost).
    pub requeued: AtomicU64,
    /// Resumable runs this process handed back at a drain out of budget.
    pub handed_back: AtomicU64,
    /// Resumed attempts this process started.
    pub resumed: AtomicU64,
    /// Host calls answered from a call log.
    pub replayed_calls: AtomicU64,
    /// Resumed runs that ended failed because the replay diverged.
    pub divergences: AtomicU64,
    /// Runs this process suspended (waiting for a decision or a time).
    pub suspended: AtomicU64,
    /// Waiting runs this process's scheduler put back in the queue.
    pub woken: AtomicU64,
    /// Completion webhooks delivered, retried after a failed attempt, and
    /// failed for good (every attempt spent).
    pub webhooks_delivered: AtomicU64,
    pub webhooks_retried: AtomicU64,
    pub webhooks_failed: AtomicU64,
    /// Schedule firings this process made.
    pub schedule_firings: AtomicU64,
    /// Runs whose journal retention trimmed.
    pub trimmed: AtomicU64,
    /// Idle waits that ended on the poll tick rather than a wake.
    pub poll_wakeups: AtomicU64,
    /// Enqueue commit to claim, by the database's clock.
    pub pickup: crate::metrics::Histogram,
    /// Terminal writes this process made, by (status, reason class).
    pub ended: Mutex<std::collections::BTreeMap<(&'static str, &'static str), u64>>,
}

impl WorkerStats {
    /// Counts one terminal write; `reason` is the failure's class (`None`:
    /// the label `none`).
    pub(crate) fn record_end(&self, status: crate::db::RunStatus, reason: Option<crate::error::FailReason>) {
        let key = (status.as_str(), reason.map_or("none", |r| r.label()));
        *self.ended.lock().unwrap().entry(key).or_default() += 1;
    }
}

pub(crate) struct Shared {
    pool: PgPool,
    agents: AgentRegistry,
    config: WorkerConfig,
    held: Mutex<HashMap<RunId, Held>>,
    /// Cancel NOTIFYs for runs not (yet) held here, by arrival: a claim's
    /// run task may register just after the stop's NOTIFY. Locked after `held`.
    early_cancels: Mutex<HashMap<RunId, std::time::Instant>>,
    slots: Arc<Semaphore>,
    /// Each tenant's share of `slots`, and the claims in flight.
    shares: Arc<shares::Shares>,
    tasks: TaskTracker,
    /// Phase 1 of the drain: stop claiming.
    stop_claiming: CancellationToken,
    /// After the drain budget: abort the runs still in flight.
    abort_runs: CancellationToken,
    /// Background services (heartbeat, reaper) stop last.
    stop_services: CancellationToken,
    stats: Arc<WorkerStats>,
    journal_stats: Arc<crate::run::journal::JournalStats>,
    /// The process's journal group commit: every run's writer hands its
    /// batches to it.
    journal_group: crate::run::journal::JournalGroup,
    /// Conversations whose run this process just ended, for the waker.
    ended: mpsc::Sender<(RunId, ConversationId)>,
    /// Endings for the group commit.
    finisher: mpsc::Sender<Request>,
    /// The process's hub (`None`: every wait falls back to its poll).
    hub: Option<Hub>,
    /// The last claim left the queue dry and no wake has come since (see
    /// [`Shared::queue_dry`]).
    dry: AtomicBool,
    /// What the runs' agents start their child runs with (sub-agents).
    children: Arc<dyn crate::run::host::Children>,
}

impl Shared {
    /// After a claim (the dispatcher's, or one made with endings): whether
    /// its statement found the queue dry (`db::lifecycle::Batch::dry`).
    /// Kept only while the hub is connected: the hint lasts until the next
    /// wake, and without the hub no wake comes.
    fn claimed(&self, dry: bool) {
        self.dry.store(dry && self.hub_connected(), Ordering::Relaxed);
    }

    /// A wake came (a run was queued or put back, or the hub reconnected):
    /// the queue may hold work again.
    fn woken(&self) {
        self.dry.store(false, Ordering::Relaxed);
    }

    /// Whether the queue is known to hold nothing this process could claim:
    /// the last claim found it dry and no wake has come since. Then a
    /// batch of endings is written without a claim (its slots go back to
    /// the dispatcher, which claims when woken), and a claim that found
    /// fewer runs than slots is not made again at once.
    fn queue_dry(&self) -> bool {
        self.dry.load(Ordering::Relaxed) && self.hub_connected()
    }

    /// The runs this process holds, by tenant.
    fn held_by_tenant(&self) -> HashMap<String, usize> {
        let mut by = HashMap::new();
        for h in self.held.lock().unwrap().values() {
            *by.entry(h.tenant.clone()).or_default() += 1;
        }
        by
    }

    /// Rooms for a claim of up to `limit` rows, reserved until the
    /// reservation is dropped (after its runs are held). The rows are
    /// reserved before the held runs are counted: a claim that starts its
    /// runs meanwhile is then counted twice (stricter), never not at all.
    fn reserve(&self, limit: usize) -> (crate::db::lifecycle::Rooms, shares::Reservation) {
        self.shares.reserve(limit, || self.held_by_tenant())
    }

    fn hub_connected(&self) -> bool {
        self.hub.as_ref().is_some_and(|h| h.stats().connected.load(Ordering::Relaxed))
    }
}

/// What `/metrics` reads of a running worker.
#[derive(Clone)]
pub struct WorkerObserver {
    pub worker: Arc<WorkerStats>,
    pub journal: Arc<crate::run::journal::JournalStats>,
    shared: Arc<Shared>,
}

impl WorkerObserver {
    /// The observer of the worker `shared` belongs to.
    pub(super) fn of(shared: &Arc<Shared>) -> Self {
        WorkerObserver { worker: shared.stats.clone(), journal: shared.journal_stats.clone(), shared: shared.clone() }
    }

    pub fn in_flight(&self) -> usize {
        self.shared.held.lock().unwrap().len()
    }
}

impl crate::service::submit::LocalWorker for WorkerObserver {
    /// A free slot of this worker for a run to start in its enqueue (eager
    /// start, [`crate::db::lifecycle::Eager`]): `None` when it is off, the
    /// worker claims nothing or is draining, or every slot is taken. The
    /// slot is taken before the enqueue (acquire-before-pull, as the
    /// dispatcher's); dropped unused, it goes back.
    ///
    /// Only while the queue is known dry (the dispatcher's last claim found
    /// nothing else queued and no wake came since) or no hub tells: behind
    /// a backlog the enqueue could not start its run anyway, and the slot
    /// is the dispatcher's to fill.
    fn start_slot(&self, tenant: &str) -> Option<Box<dyn crate::service::submit::StartSlot>> {
        let shared = &self.shared;
        // Before the drain's check: a drain that begins after it waits for
        // this start to reach its run task.
        let tracked = shared.tasks.token();
        if !shared.config.eager_start || !shared.config.dispatch || shared.stop_claiming.is_cancelled() {
            return None;
        }
        if !shared.queue_dry() && shared.hub_connected() {
            return None;
        }
        let permit = shared.slots.clone().try_acquire_owned().ok()?;
        // A tenant at its share of the slots waits in the queue for a
        // process with room (`shares`).
        let (rooms, reserved) = shared.reserve(1);
        let room =
            rooms.tenants.iter().position(|t| t == tenant).map_or(rooms.default.unwrap_or(1), |i| rooms.slots[i]);
        if room < 1 {
            return None;
        }
        Some(Box::new(EagerSlot { permit, shared: shared.clone(), _tracked: tracked, _reserved: reserved }))
    }
}

/// A slot taken for a run that may start in its enqueue (see
/// `LocalWorker::start_slot` of [`WorkerObserver`]).
struct EagerSlot {
    permit: tokio::sync::OwnedSemaphorePermit,
    shared: Arc<Shared>,
    /// Keeps the worker's drain waiting until the run is handed over.
    _tracked: tokio_util::task::task_tracker::TaskTrackerToken,
    /// The slot counted against every tenant's share until the run is held.
    _reserved: shares::Reservation,
}

impl crate::service::submit::StartSlot for EagerSlot {
    fn claim(&self) -> crate::db::lifecycle::Eager<'_> {
        let config = &self.shared.config;
        crate::db::lifecycle::Eager {
            worker_id: &config.worker_id,
            lease: config.lease,
            tenant_max_running: config.tenant_max_running.map(i64::from),
        }
    }

    /// Runs a run its enqueue started, in this slot: held, heartbeated and
    /// fenced from here on exactly as a claimed run (it waited no time in
    /// the queue: the pickup histogram says so). A run that never reaches
    /// it (the process died) is the reaper's when its lease lapses, as a
    /// claimed run's is.
    fn start(self: Box<Self>, run: crate::db::lifecycle::ClaimedRun) {
        let EagerSlot { permit, shared, _tracked, _reserved } = *self;
        shared.stats.eager_starts.fetch_add(1, Ordering::Relaxed);
        dispatcher::start(&shared, vec![run], vec![permit]);
    }
}

/// The running worker services of one process.
pub struct Worker {
    shared: Arc<Shared>,
    dispatcher: Option<JoinHandle<()>>,
    services: Vec<JoinHandle<()>>,
}

/// What a drain did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainReport {
    /// Runs that finished within the drain budget.
    pub finished_in_budget: bool,
    /// Runs aborted after the budget (each ended failed, fenced, or left to the reaper).
    pub aborted: usize,
}

impl Worker {
    /// Starts the reaper (after one boot sweep), the heartbeat, and, if
    /// configured, the dispatcher.
    pub async fn start(
        pool: PgPool,
        hub: Option<Hub>,
        agents: AgentRegistry,
        config: WorkerConfig,
    ) -> Result<Worker, ConfigError> {
        config.validate()?;
        let (ended, ended_rx) = mpsc::channel(waker::QUEUE_MAX);
        let (finisher, finisher_rx) = mpsc::channel(finisher::QUEUE_MAX);
        let journal_stats = Arc::new(crate::run::journal::JournalStats::default());
        let journal_group =
            crate::run::journal::JournalGroup::start(pool.clone(), config.journal_flush, journal_stats.clone());
        let children = Arc::new(crate::service::children::Starter::new(
            pool.clone(),
            Arc::new(agents.clone()),
            config.policy.clone(),
        ));
        let shared = Arc::new(Shared {
            pool,
            agents,
            children,
            slots: Arc::new(Semaphore::new(config.max_runs)),
            shares: Arc::new(shares::Shares::new(config.max_runs, config.tenant_slot_share_pct)),
            config,
            held: Mutex::new(HashMap::new()),
            early_cancels: Mutex::new(HashMap::new()),
            tasks: TaskTracker::new(),
            stop_claiming: CancellationToken::new(),
            abort_runs: CancellationToken::new(),
            stop_services: CancellationToken::new(),
            stats: Arc::new(WorkerStats::default()),
            journal_stats,
            journal_group,
            ended,
            finisher,
            hub: hub.clone(),
            dry: AtomicBool::new(false),
        });
        // The boot reconciler: a full-cluster restart leaves orphans no
        // running loop noticed. Errors here are not fatal; the loop retries.
        if let Err(e) = reaper::sweep(&shared.pool, &shared.config, &shared.stats).await {
            tracing::warn!(error = %e, "boot reap sweep failed; the reaper loop will retry");
        }
        let mut services = vec![
            tokio::spawn(heartbeat::run(shared.clone())),
            tokio::spawn(reaper::run(shared.clone())),
            tokio::spawn(suspensions::run(shared.clone())),
            tokio::spawn(waker::run(shared.clone(), ended_rx)),
            tokio::spawn(finisher::run(shared.clone(), finisher_rx)),
            tokio::spawn(retention::run(shared.clone())),
            tokio::spawn(schedules::run(shared.clone())),
        ];
        if let Some(webhooks) = shared.config.webhooks.clone() {
            services.push(tokio::spawn(webhooks::run(shared.clone(), webhooks)));
        }
        if let Some(hub) = &hub {
            services.push(tokio::spawn(canceller::run(shared.clone(), hub.clone())));
            services.push(tokio::spawn(canceller::steers(shared.clone(), hub.clone())));
        }
        let dispatcher = shared.config.dispatch.then(|| tokio::spawn(dispatcher::run(shared.clone(), hub)));
        Ok(Worker { shared, dispatcher, services })
    }

    pub fn stats(&self) -> Arc<WorkerStats> {
        self.shared.stats.clone()
    }

    pub fn journal_stats(&self) -> Arc<crate::run::journal::JournalStats> {
        self.shared.journal_stats.clone()
    }

    /// Runs this process holds right now.
    pub fn in_flight(&self) -> usize {
        self.shared.held.lock().unwrap().len()
    }

    /// A handle `/metrics` reads while the worker runs.
    pub fn observer(&self) -> WorkerObserver {
        WorkerObserver::of(&self.shared)
    }

    /// The two-phase drain. Phase 1 stops claiming (milliseconds: the loop is
    /// parked on the semaphore or the idle wait). Phase 2 lets in-flight runs
    /// finish within the drain budget; whatever outlives it is aborted and
    /// ends failed (fenced), or is left to the reaper if even that fails.
    pub async fn drain(mut self) -> DrainReport {
        self.shared.stop_claiming.cancel();
        if let Some(d) = self.dispatcher.take() {
            let _ = d.await;
        }
        self.shared.tasks.close();
        let finished_in_budget =
            tokio::time::timeout(self.shared.config.drain_timeout, self.shared.tasks.wait()).await.is_ok();
        let mut aborted = 0;
        if !finished_in_budget {
            aborted = self.shared.tasks.len();
            tracing::warn!(aborted, "drain budget spent; aborting runs still in flight");
            self.shared.abort_runs.cancel();
            let _ = tokio::time::timeout(ABORT_WAIT_MAX, self.shared.tasks.wait()).await;
        }
        self.shared.stop_services.cancel();
        for s in self.services.drain(..) {
            let _ = s.await;
        }
        DrainReport { finished_in_budget, aborted }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.shared.stop_claiming.cancel();
        self.shared.stop_services.cancel();
        self.shared.abort_runs.cancel();
    }
}
