//! The only place that holds SQL. Everything else calls these functions with a
//! pool or a transaction (`impl PgExecutor`). This file owns the pool, the
//! migrations and the typed ids; each module below owns one job:
//!
//! - [`status`]: `RunStatus` and `MessageStatus`, typed at the database boundary.
//! - [`notify`]: every NOTIFY channel, and `notify` inside a transaction.
//! - [`events`]: every event kind and the one `complete` payload.
//! - [`enqueue`]: a new turn in one transaction (message, queued run, seq
//!   1-2, wake), conversations created on the way, the idempotency lookup.
//! - [`lifecycle`]: every change of a run's status (claim, finish, backstop,
//!   reap, cancel, stop, retry), the lease and the stop flag, with the run and
//!   message state machines written down beside the trigger they mirror.
//! - [`calls`]: the recorded call log of resumable runs, fenced like the
//!   journal, and what an earlier attempt journaled.
//! - [`journal`]: fenced appends, reads from a cursor, a finalizer's
//!   `complete`, the terminal state tails synthesize from, retention's trim.
//! - [`suspensions`]: waiting runs (approvals, durable waits): suspend,
//!   decide, the scheduler's wake.
//! - [`conversations`]: ownership, transcript order, history, conversation reads.
//! - [`runs`]: run reads as clients see them; [`responses`]: the Responses
//!   API's reads of a run and its deletion mark.
//! - [`plugins`]: content-addressed components and the names pointing at them.
//! - [`tokens`]: bearer tokens (expiry, revocation) and stream tickets.
//! - [`audit`]: the append-only audit trail.
//! - [`webhooks`]: the completion-webhook outbox; [`schedules`]: cron
//!   schedules and their firings.
//! - [`cluster`]: the private PostgreSQL cluster; [`bench`]: the benchmark's SQL.

pub mod artifacts;
pub mod audit;
pub mod calls;
pub mod cluster;
pub mod conversations;
pub mod enqueue;
pub mod events;
pub mod journal;
pub mod lifecycle;
pub mod notify;
pub mod plugins;
pub mod responses;
pub mod runs;
pub mod schedules;
pub mod status;
pub mod suspensions;
pub mod tokens;
pub mod webhooks;

use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use uuid::Uuid;

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

pub use status::{MessageStatus, RunStatus};

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, sqlx::Type)]
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

/// A pool of at most `max_connections` beside `pool` (the same server and
/// settings), whose sessions always use a prepared statement's generic plan
/// (`plan_cache_mode = force_generic_plan`): for a statement whose plan must
/// not depend on its parameters' values, the worker's ending-and-claim
/// (`lifecycle::finish_and_claim`). Its plan is the same for any batch, but
/// its cost estimate swings with the queue's depth and PostgreSQL kept
/// choosing a plan made for the values instead: 2,617 plans in 6,012 calls
/// (0.4 ms each) over three 20,000-run drains; with the generic plan forced,
/// 54. Only this statement runs on it (the host's other statements keep the
/// default, since a generic plan for a LIMIT or a cursor parameter can be a
/// poor one). Connects lazily.
pub fn generic_plan_pool(pool: &PgPool, max_connections: u32) -> PgPool {
    let options = (*pool.connect_options()).clone().options([("plan_cache_mode", "force_generic_plan")]);
    pool_options(max_connections).connect_lazy_with(options)
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
