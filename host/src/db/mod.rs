//! Where the host's SQL lives: everything else calls these functions with a
//! pool or a transaction (`impl PgExecutor`). Three small exceptions hold
//! their own statements: the `/metrics` counts (`crate::api::metrics`), the
//! schedule firer's read of the database clock (`crate::service::schedules`)
//! and the private cluster's setup (`crate::cluster`). This file owns the
//! pool, the migrations and the typed ids; each module below owns one job:
//!
//! - [`status`]: `RunStatus` and `MessageStatus`, typed at the database boundary.
//! - [`notify`]: every NOTIFY channel, and `notify` inside a transaction.
//! - [`events`]: every event kind and the one `complete` payload.
//! - [`enqueue`]: a new turn in one transaction (message, queued run, seq
//!   1-2, wake), conversations created on the way, the idempotency lookup.
//! - [`lifecycle`]: every change of a run's status (claim, finish, backstop,
//!   reap, cancel, stop, suspend, decide, wake, retry; the eager start, the
//!   run written claimed in its enqueue by a process with a free slot when
//!   nothing is queued: [`lifecycle::Eager`]), the lease and the
//!   stop flag, with the run and message state machines written down beside
//!   the trigger they mirror (and `TRANSITIONS`, walked against it).
//! - [`calls`]: the recorded call log of resumable runs, fenced like the
//!   journal, and what an earlier attempt journaled.
//! - [`journal`]: fenced appends, reads from a cursor, a finalizer's
//!   `complete`, the terminal state tails synthesize from, retention's trim.
//! - [`suspensions`] (in `lifecycle`): waiting runs (approvals, durable
//!   waits): suspend, decide, the scheduler's wake.
//! - [`conversations`]: ownership, transcript order, history, conversation reads.
//! - [`runs`]: run reads as clients see them; [`responses`]: the Responses
//!   API's reads of a run and its deletion mark.
//! - [`plugins`]: content-addressed components and the names pointing at them.
//! - [`tenants`]: operator settings per tenant (its share of a process's
//!   slots, the ceilings of its own plugins' limits).
//! - [`tokens`]: bearer tokens (expiry, revocation) and stream tickets.
//! - [`audit`]: the append-only audit trail.
//! - [`model_limits`]: limits on model calls shared by every process
//!   (leases granted in arrival order, pauses).
//! - [`webhooks`]: the completion-webhook outbox; [`schedules`]: cron
//!   schedules and their firings.
//!
//! The benchmark's own SQL is in `bench/src/sql.rs`.

pub mod artifacts;
pub mod audit;
pub mod calls;
pub mod children;
pub mod claimed;
pub mod conversations;
pub mod enqueue;
pub mod events;
pub mod journal;
pub mod lifecycle;
pub mod model_limits;
pub mod notify;
pub mod plugins;
pub mod responses;
pub mod runs;
pub mod schedules;
pub mod status;
pub mod steer;
pub mod tasks;
pub use lifecycle::suspensions;
pub mod tenants;
pub mod tokens;
pub mod webhooks;

use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgConnection, PgPool};
use uuid::Uuid;

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

pub use status::{MessageStatus, RunStatus};

/// Whose rows (runs, schedules) a caller reaches: its own; an admin's, every
/// one of its tenant; an operator's, all.
#[derive(Debug, Clone, Copy)]
pub enum Reach<'a> {
    Owner(&'a str),
    Tenant(&'a str),
    All,
}

impl Reach<'_> {
    /// `(owner, tenant, all)`, to bind where [`Reach::filter`] says.
    pub fn binds(&self) -> (Option<&str>, Option<&str>, bool) {
        match *self {
            Reach::Owner(o) => (Some(o), None, false),
            Reach::Tenant(t) => (None, Some(t), false),
            Reach::All => (None, None, true),
        }
    }

    /// The filter over `owner_id` and `tenant_id` (of `alias`, with a dot, or
    /// none) with the binds at `$n`, `$n+1`, `$n+2`.
    pub fn filter(alias: &str, n: usize) -> String {
        format!("({alias}owner_id = ${n} OR {alias}tenant_id = ${} OR ${})", n + 1, n + 2)
    }
}

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, sqlx::Type, schemars::JsonSchema)]
        #[sqlx(transparent)]
        #[serde(transparent)]
        pub struct $name(pub Uuid);

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.fmt(f)
            }
        }

        impl FromStr for $name {
            type Err = uuid::Error;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s).map($name)
            }
        }
    };
}

typed_id!(
    /// Identity of one run (one turn of a conversation).
    RunId
);
typed_id!(
    /// Identity of a conversation: a sequence of turns, one running at a time.
    ConversationId
);
typed_id!(
    /// Identity of a transcript message.
    MessageId
);
typed_id!(
    /// Identity of an API token (never its secret).
    TokenId
);
typed_id!(
    /// The fence: stamped by the claim, presented by every worker write. A
    /// worker whose token no longer matches writes nothing.
    ClaimToken
);

impl RunId {
    pub fn new() -> Self {
        RunId(Uuid::now_v7())
    }
}
impl ConversationId {
    pub fn new() -> Self {
        ConversationId(Uuid::now_v7())
    }
}
impl MessageId {
    pub fn new() -> Self {
        MessageId(Uuid::now_v7())
    }
}
impl Default for RunId {
    fn default() -> Self {
        Self::new()
    }
}
impl Default for ConversationId {
    fn default() -> Self {
        Self::new()
    }
}
impl Default for MessageId {
    fn default() -> Self {
        Self::new()
    }
}

/// How long a session may sit idle inside a transaction before the server ends it.
const IDLE_IN_TRANSACTION_MAX: &str = "10s";

/// Opens a pool. `max_connections` is a bound like every other.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, sqlx::Error> {
    // A process that stalls mid-transaction (SIGSTOP, a long GC-like pause)
    // must not hold row locks that other processes' reapers and fences wait
    // on: the server ends such a session after a while. Every transaction
    // here is a few statements long.
    //
    // No JIT: the claim's estimated cost grows with the queue's depth (its
    // LIMIT is applied after per-tenant scans the planner prices whole), and
    // past `jit_above_cost` (PostgreSQL's default: on, at 100,000) every
    // claim compiled about a hundred functions first: 45 ms against 0.9 ms
    // run, at 20,000 queued. Nothing here runs long enough to gain from it.
    let options = PgConnectOptions::from_str(url)?
        .application_name("agent-host")
        .options([("idle_in_transaction_session_timeout", IDLE_IN_TRANSACTION_MAX), ("jit", "off")]);
    pool_options(max_connections).connect_with(options).await
}

/// A connection of its own beside a pool (the same server and settings),
/// whose session always uses a prepared statement's generic plan
/// (`plan_cache_mode = force_generic_plan`), for a worker service that runs
/// one statement at a time: the finisher's ending-and-claim
/// (`lifecycle::finish_and_claim`) and the waker's read
/// (`lifecycle::announce_ended`). The ending-and-claim's plan is the same
/// for any batch, but its cost estimate swings with the queue's depth and
/// PostgreSQL kept choosing a plan made for the values instead: 2,617 plans
/// in 6,012 calls (0.4 ms each) over three 20,000-run drains; with the
/// generic plan forced, 54. Only these statements run on it (the host's
/// other statements keep the default, since a generic plan for a LIMIT or a
/// cursor parameter can be a poor one).
///
/// Nor does it plan a sequential scan (`enable_seqscan = off`). Its
/// statements reach `agent_run` and `message` rows by key, but a plan kept
/// for the connection's life is replanned only when the tables' statistics
/// change: made while the tables were small (a fresh database; any table of
/// a few thousand rows, where ten index probes look dearer than one scan and
/// a hash), each claim scanned every run and every message again. A drain of
/// 2,000 runs read about 500 rows per run that way, at 1.4 times the
/// database's CPU per run; `a_claim_planned_on_empty_tables_reaches_rows_by_key_once_they_grow`
/// (tests/plans.rs).
///
/// A connection, not a pool of one: a pool pings every connection given
/// back to it (sqlx tests it on release), a round trip the next statement
/// waited for, once per batch of a busy worker. Like the pool, it pings a
/// connection that sat idle before using it (a database restart leaves it
/// dead) and opens a new one if the ping fails; made within the pool's
/// acquire timeout.
pub struct OwnConnection {
    pool: PgPool,
    conn: Option<PgConnection>,
    used: std::time::Instant,
}

impl OwnConnection {
    /// Made when first used.
    pub fn new(pool: &PgPool) -> Self {
        OwnConnection { pool: pool.clone(), conn: None, used: std::time::Instant::now() }
    }

    /// The connection, made or checked first as needed.
    pub async fn get(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        let idle = std::mem::replace(&mut self.used, std::time::Instant::now()).elapsed();
        if let Some(mut c) = self.conn.take() {
            if idle < PING_AFTER_IDLE || sqlx::Connection::ping(&mut c).await.is_ok() {
                return Ok(self.conn.insert(c));
            }
        }
        let options = (*self.pool.connect_options())
            .clone()
            .options([("plan_cache_mode", "force_generic_plan"), ("enable_seqscan", "off")]);
        let timeout = self.pool.options().get_acquire_timeout();
        match tokio::time::timeout(timeout, options.connect()).await {
            Ok(c) => Ok(self.conn.insert(c?)),
            Err(_) => Err(sqlx::Error::PoolTimedOut),
        }
    }

    /// After an error that may have broken it: the next use makes a new one.
    pub fn broke(&mut self) {
        self.conn = None;
    }

    /// Closes it, if made.
    pub async fn close(self) {
        if let Some(c) = self.conn {
            let _ = sqlx::Connection::close(c).await;
        }
    }
}

fn pool_options(max_connections: u32) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        // A connection that sat idle is pinged before it is handed out (a
        // database restart leaves the pool's connections dead; the ping
        // finds them and the pool opens new ones). One back from use moments
        // ago is not: a ping is a round trip on every statement of the claim
        // loop and of every ending, which a busy host repeats thousands of
        // times a second on connections it just used.
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_AFTER_IDLE {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// Idle this long, a connection is pinged before use (see [`connect`]).
const PING_AFTER_IDLE: Duration = Duration::from_millis(100);

/// Applies the embedded migrations. Safe to call from many processes at once:
/// sqlx serialises them with an advisory lock.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}

/// Readiness: the database answers and every embedded migration is applied.
pub async fn ready(pool: &PgPool) -> Result<bool, sqlx::Error> {
    let applied: i64 =
        sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success").fetch_one(pool).await?;
    Ok(applied as usize >= MIGRATOR.iter().count())
}
