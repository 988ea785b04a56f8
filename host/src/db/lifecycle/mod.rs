//! Every change of a run's status, and the reads that decide one: the claim
//! and the lease (`claim`), endings, reaps and hand-backs (`finish`), stops
//! (`stop`), suspensions, decisions and wakes (`suspensions`), enqueue with a
//! strategy for a busy conversation (`busy`), the eager start, a run written
//! `running` in its own enqueue (`eager`), and retry (`retry`). No other
//! module changes `agent_run.status` or writes a run other than `queued`
//! (enqueue, and the benchmark's bulk enqueue, insert runs `queued`). Each function's doc names its
//! caller and the transition it makes; the schema's trigger
//! `agent_run_status_transition` (`agent_run_transition_check`, last in
//! `migrations/0006_waiting.sql`; an AFTER trigger since
//! `migrations/0013_transition_after.sql`, which the claim's and the ending's
//! always-legal transitions pass over) enforces the same table, so a
//! transition missing here is refused by the database too.
//!
//! # The run state machine
//!
//! | from    | to        | function                         | caller                                   |
//! |---------|-----------|----------------------------------|------------------------------------------|
//! | (none)  | queued    | [`super::enqueue::enqueue`], [`retry`], [`fork`] (a new run) | HTTP API, demo, bench; HTTP retry, fork |
//! | (none)  | running   | [`enqueue_eager`] ([`Eager`]): queued and claimed in one statement, only when no other run is queued and its conversation has no active turn | HTTP API on a process with a free slot |
//! | queued  | running   | [`claim_batch`] ([`claim`]); [`finish_and_claim`] (with a batch of endings) | dispatcher; finisher |
//! | queued  | cancelled | [`cancel`], [`stop_conversation`] | HTTP cancel, HTTP stop                  |
//! | running | completed, failed, cancelled | [`finish_many`], [`finish_and_claim`] (group commit, each row fenced), [`finish`] (fenced) | run task (through the worker's finisher) |
//! | running | failed    | [`backstop`] (fenced)            | run task, when the run's own task died   |
//! | running | failed    | [`reap_or_resume`] (lease lapsed past the grace, re-checked in the write) | reaper, boot reconciler |
//! | running | queued    | [`reap_or_resume`], [`hand_back`] (fenced): a resumable run with attempts left, `attempt` raised | reaper, boot reconciler; run task at a drain timeout |
//! | running | waiting   | [`suspensions::suspend`] (fenced): a resumable run's call needs approval, or waits | run task (the run host) |
//! | waiting | queued    | [`suspensions::decide`], [`suspensions::wake_due`]: `attempt` raised | HTTP decision; the waiting runs' scheduler (`crate::worker::suspensions`) |
//! | waiting | queued    | the schema's trigger `agent_run_child_ended` (`migrations/0021_subagents.sql`), in the transaction that ends the child joining a parent's await; [`suspensions::suspend`] itself when the children were joined already: `attempt` raised | whatever ends the child (finish, reap, stop); the run host |
//! | waiting | cancelled | [`cancel`], [`stop_conversation`] | HTTP cancel, HTTP stop |
//! | running | (flag)    | [`cancel`], [`stop_conversation`] set `cancel_requested` and NOTIFY; the holder then [`finish`]es `cancelled` | HTTP cancel, HTTP stop |
//!
//! completed, failed and cancelled are terminal: the trigger refuses any
//! change out of them. Nothing re-queues a run that started except the
//! hand-back of a resumable run (its plugin's manifest says `"durability":
//! "resume"`), which the trigger admits only with `attempt` raised by one and
//! the lease cleared; every other run is at-most-once: its worker died, it
//! ends failed, and a person's [`retry`] is a new run. A handed-back run keeps
//! its `queue_pos`, so it is its conversation's head again and no later turn
//! can start before it; its next claim rotates the claim token, which fences
//! the old worker out of every write. Every terminal write commits the run's
//! one `complete` event with the status flip.
//!
//! # The message state machine (see [`MessageStatus`])
//!
//! | role      | from            | to       | by                                             |
//! |-----------|-----------------|----------|------------------------------------------------|
//! | user      | (none)          | queued   | enqueue                                        |
//! | user      | (none)          | complete | [`enqueue_eager`] (its run started in its enqueue) |
//! | user      | queued          | complete | [`claim`] (its run started)                    |
//! | user      | queued          | draft    | [`cancel`] of a queued run, [`stop_conversation`] |
//! | user      | draft, complete | queued   | [`retry`] (its run failed or was cancelled)    |
//! | assistant | (none)          | complete | [`finish`] of a completed run                  |
//! | assistant | (none)          | partial  | [`finish`] of a failed or cancelled run with text streamed |
//!
//! # Clocks
//!
//! `started_at` and `finished_at` are the statement clock,
//! `clock_timestamp()`, taken while the row is written: a claim whose
//! transaction began before the previous turn's finish committed still
//! records a start after that finish, so a conversation's turns never appear
//! to overlap. (`now()` is the transaction's start, which precedes the
//! snapshot that saw the previous turn end.) Leases (`claim_expires_at`,
//! `last_heartbeat_at`) are the database's `now()` in every statement that
//! writes or compares them (claim, heartbeat, reaper): one clock for all
//! processes, and each of those statements is its transaction's first, so
//! `now()` trails the statement clock by far less than the reap grace.
//!
//! A message's `created_at` is its column default, `clock_timestamp()`, too,
//! so an answer is stamped after its run's `finished_at`.
//!
//! A status a statement decides itself is a literal in its SQL, as in the
//! trigger and the partial indexes (the planner matches `status = 'queued'`
//! against an index's predicate by its text, which a bound parameter would
//! defeat); a status that comes from Rust is bound as its typed enum.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::{FromRow, PgConnection, PgExecutor, PgPool, Postgres, Row, Transaction};

pub use super::claimed::{is_running_conflict, ClaimedRun};
use super::enqueue::{journal_queued, Enqueued};
use super::events::{complete_payload, COMPLETE, RUN_STARTED};
use super::journal::write_complete;
use super::notify::{events_channel, notify, COMPLETE_PAYLOAD, RUN_CANCEL, RUN_ENQUEUED};
use super::{conversations, ClaimToken, ConversationId, MessageId, MessageStatus, RunId, RunStatus};

mod busy;
mod claim;
mod eager;
mod finish;
mod fork;
mod retry;
mod stop;
pub mod suspensions;

pub use busy::*;
pub use claim::*;
pub use eager::*;
pub use finish::*;
pub use fork::*;
pub use retry::*;
pub use stop::*;

/// The run state machine's table above, as data: every (from, to) change of
/// status a function here makes. `tests/lifecycle.rs` walks every pair of
/// statuses against the schema: these pass its trigger and checks (in the
/// shape the functions write), every other is refused.
pub const TRANSITIONS: &[(RunStatus, RunStatus)] = &[
    (RunStatus::Queued, RunStatus::Running),
    (RunStatus::Queued, RunStatus::Cancelled),
    (RunStatus::Running, RunStatus::Completed),
    (RunStatus::Running, RunStatus::Failed),
    (RunStatus::Running, RunStatus::Cancelled),
    (RunStatus::Running, RunStatus::Queued),
    (RunStatus::Running, RunStatus::Waiting),
    (RunStatus::Waiting, RunStatus::Queued),
    (RunStatus::Waiting, RunStatus::Cancelled),
];
