//! Recording and replay of a resumable run's host calls, behind the run host
//! ([`crate::run::host::RunHost`]) only, so built-in agents and guests of any
//! language get them alike.
//!
//! Every call whose answer the host decides (call-tool, check-cancel, the
//! WASI clocks, list-tools) takes the next position of the run's call log
//! (`run_call`). A tool call is written, fenced, before the tool runs
//! (outcome unknown) and completed before the agent sees the answer;
//! readings (clocks, cancel checks, tool listings) are buffered and written
//! before the next durable write (a tool call, or an event the agent emits),
//! so nothing journaled ever depends on a reading the log lost. Events are not in the log: the run host numbers
//! every journal append (`run_event.op`), and a tool call's row keeps the
//! numbers before and after it.
//!
//! A resumed attempt loads the log and answers each call from it in order:
//! same import, same tool, same arguments (by hash) and the same number of
//! appends before it, or the run ends failed (`replay diverged`) naming the
//! position and both calls. Appends numbered up to what the earlier attempts
//! journaled are not written again. After the last recorded call the run goes
//! live. A call-tool row without an outcome is a call in flight when the
//! worker was lost: the run host re-issues it only if the tool is idempotent.

use std::collections::VecDeque;
use std::sync::Mutex;

use sha2::{Digest, Sha256};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::db::calls::{self, Call, Journaled};
pub use crate::db::suspensions::Decided;
use crate::db::suspensions::{self, Suspend};
use crate::db::{ClaimToken, RunId};
use crate::error::HostError;

pub const CALL_TOOL: &str = "call-tool";
pub const CHECK_CANCEL: &str = "check-cancel";
pub const WALL_CLOCK: &str = "wall-clock";
pub const MONOTONIC_CLOCK: &str = "monotonic-clock";
/// A 0.2.0 guest's `list-tools` (its answer, the granted tools, as JSON).
pub const LIST_TOOLS: &str = "list-tools";
/// A take of the run's queued instructions (steering; its answer, the
/// instructions taken, as JSON).
pub const TAKE_INSTRUCTIONS: &str = "take-instructions";

/// How long a failing write to the call log is retried before the run
/// stands down (to be resumed from its log once its lease lapses).
pub const RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(10);

/// The hash of a call's arguments kept in the log.
pub fn args_hash(args: &str) -> String {
    hex::encode(&Sha256::digest(args.as_bytes())[..16])
}

/// What the log says of the next call-tool, one flat answer.
#[derive(Debug)]
pub enum Next {
    /// Recorded with its outcome: answer from the log.
    Answer(Call),
    /// Recorded as started, outcome unknown (the last entry of the log).
    Unknown(Call),
    /// Nothing recorded: make the call live, at this position.
    Live(i32),
    /// Past the recorded-calls limit (the message says which).
    Refused(String),
    /// Not the call recorded at its position.
    Diverged(Divergence),
}

/// What the log says of the next reading (check-cancel, a clock,
/// list-tools), one flat answer, as [`Next`] is a call-tool's.
#[derive(Debug, PartialEq)]
pub enum NextReading {
    /// Recorded: answer from the log.
    Answer(String),
    /// Nothing recorded: read live at this position, then
    /// [`Recording::record_reading`].
    Live(i32),
    /// Past the recorded-calls limit (the message says which).
    Refused(String),
    /// Not the reading recorded at its position.
    Diverged(Divergence),
}

/// A call the agent made that is not the one recorded at its position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence(pub String);

/// Where a run's log is written, and what an earlier attempt left.
pub struct RecordingParts {
    pub pool: PgPool,
    pub run_id: RunId,
    pub token: ClaimToken,
    pub attempt: i32,
    /// Cancelled when a write finds the fence tripped.
    pub lost: CancellationToken,
    /// The log as earlier attempts left it (empty on the first).
    pub log: Vec<Call>,
    pub journaled: Journaled,
    /// Positions a run may record at most.
    pub max: u64,
    /// The run's seed (drawn at its first claim).
    pub seed: uuid::Uuid,
    /// Decisions on suspended calls, by call index, with whether an earlier
    /// attempt already began the approved call.
    pub decisions: std::collections::HashMap<i32, (Decided, bool)>,
}

/// One run's recording (and, when resumed, its replay).
pub struct Recording {
    pool: PgPool,
    run_id: RunId,
    token: ClaimToken,
    attempt: i32,
    lost: CancellationToken,
    max: u64,
    journaled: Journaled,
    seed: uuid::Uuid,
    decisions: std::collections::HashMap<i32, (Decided, bool)>,
    state: Mutex<State>,
}

struct State {
    /// Recorded calls not replayed yet, in order.
    replay: VecDeque<Call>,
    replayed: u64,
    next_position: i32,
    /// Readings not written yet, in order.
    pending: Vec<Call>,
    /// The last monotonic reading handed out: live ones never go below it.
    monotonic_floor: u64,
    /// Added to the live monotonic clock so it continues from the replayed one.
    monotonic_offset: Option<i128>,
}

impl Recording {
    pub fn new(parts: RecordingParts) -> Recording {
        let next_position = parts.log.last().map_or(1, |c| c.position + 1);
        // Live monotonic readings go on from the last recorded one.
        let monotonic_floor = parts
            .log
            .iter()
            .filter(|c| c.import == MONOTONIC_CLOCK)
            .filter_map(|c| c.result.as_deref()?.parse::<u64>().ok())
            .max()
            .unwrap_or(0);
        Recording {
            pool: parts.pool,
            run_id: parts.run_id,
            token: parts.token,
            attempt: parts.attempt,
            lost: parts.lost,
            max: parts.max,
            journaled: parts.journaled,
            seed: parts.seed,
            decisions: parts.decisions,
            state: Mutex::new(State {
                replay: parts.log.into(),
                replayed: 0,
                next_position,
                pending: Vec::new(),
                monotonic_floor,
                monotonic_offset: None,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }

    pub fn attempt(&self) -> i32 {
        self.attempt
    }

    /// The decision on the suspended call `call_index`, if one was made,
    /// and whether an earlier attempt already began the approved call.
    pub fn decision(&self, call_index: i32) -> Option<&(Decided, bool)> {
        self.decisions.get(&call_index)
    }

    /// Marks the approved call begun (fenced) before it is made.
    pub async fn start_approved(&self, call_index: i32) -> Result<(), HostError> {
        let (pool, run, token) = (&self.pool, self.run_id, self.token);
        self.retrying(|| suspensions::start_approved(pool, run, token, call_index)).await
    }

    /// Suspends the run (running -> waiting, fenced) at a recorded call:
    /// `Ok` once it waits; `Fenced` when the claim is gone or the write
    /// kept failing (the run stands down and is resumed from its log).
    pub async fn suspend(&self, s: &Suspend<'_>) -> Result<(), HostError> {
        let (pool, run, token) = (&self.pool, self.run_id, self.token);
        match self.retrying_for(|| suspensions::suspend(pool, run, token, s)).await? {
            suspensions::Suspended::Waiting => Ok(()),
            suspensions::Suspended::StopRequested => Err(HostError::Cancelled),
        }
    }

    /// The seed of the guest's random generators, the same on every attempt.
    pub fn seed(&self) -> [u8; 32] {
        Sha256::digest(self.seed.as_bytes()).into()
    }

    /// Calls answered from the log so far.
    pub fn replayed(&self) -> u64 {
        self.state().replayed
    }

    /// Calls of the log with a recorded outcome: what the resumed attempt replays.
    pub fn to_replay(&self) -> usize {
        self.state().replay.iter().filter(|c| c.outcome.is_some()).count()
    }

    /// When the agent ended with calls of the log not replayed: what the
    /// first of them was (the agent ended early: a divergence).
    pub fn left_unreplayed(&self) -> Option<Divergence> {
        let s = self.state();
        let first = s.replay.front()?;
        Some(divergence(first, &format!("no more calls ({} recorded calls were not made)", s.replay.len())))
    }

    /// Whether the log's next call is one with a recorded outcome (its
    /// answer is replayed: nothing live, such as a server's listing, is
    /// needed for it).
    pub fn next_answered(&self) -> bool {
        self.state().replay.front().is_some_and(|c| c.outcome.is_some())
    }

    /// Whether calls of the log remain to be answered from it.
    pub fn replaying(&self) -> bool {
        !self.state().replay.is_empty()
    }

    /// The journal's next seq after what earlier attempts wrote (0 on a first attempt).
    pub fn next_seq(&self) -> i32 {
        self.journaled.next_seq
    }

    /// The last append number an earlier attempt journaled.
    pub fn journaled_op(&self) -> i64 {
        self.journaled.last_op
    }

    /// The text earlier attempts journaled from appends `after < op <= upto`.
    pub fn journaled_text(&self, after: i64, upto: i64) -> String {
        self.journaled.deltas.iter().filter(|(op, _)| *op > after && *op <= upto).map(|(_, t)| t.as_str()).collect()
    }

    /// Why a call at `position` is refused: past the recorded-calls limit.
    fn past_limit(&self, position: i32) -> Option<String> {
        (position as u64 > self.max).then(|| format!("more than {} recorded calls", self.max))
    }

    /// The log's answer for the next call-tool.
    pub fn next_tool(&self, name: &str, hash: &str, ops: i64) -> Next {
        let mut s = self.state();
        let Some(call) = s.replay.pop_front() else {
            let position = s.next_position;
            if let Some(refused) = self.past_limit(position) {
                return Next::Refused(refused);
            }
            s.next_position += 1;
            return Next::Live(position);
        };
        let same = call.import == CALL_TOOL
            && call.name.as_deref() == Some(name)
            && call.args_hash.as_deref() == Some(hash)
            && call.ops_before == ops;
        if !same {
            let now = format!("call-tool {name:?} (args {hash}) after {ops} journal appends");
            return Next::Diverged(divergence(&call, &now));
        }
        s.replayed += 1;
        if call.outcome.is_some() {
            Next::Answer(call)
        } else {
            Next::Unknown(call)
        }
    }

    /// The log's answer for the next reading (check-cancel, a clock,
    /// list-tools): the recorded one on replay, else its position, taken.
    pub fn next_reading(&self, import: &'static str, ops: i64) -> NextReading {
        let mut s = self.state();
        if let Some(call) = s.replay.pop_front() {
            if call.import != import || call.ops_before != ops {
                return NextReading::Diverged(divergence(&call, &format!("{import} after {ops} journal appends")));
            }
            s.replayed += 1;
            return NextReading::Answer(call.result.unwrap_or_default());
        }
        let position = s.next_position;
        if let Some(refused) = self.past_limit(position) {
            return NextReading::Refused(refused);
        }
        s.next_position += 1;
        NextReading::Live(position)
    }

    /// A reading made live at `position` (read without the state's lock),
    /// buffered for the next durable write; returns it.
    pub fn record_reading(&self, position: i32, import: &'static str, ops: i64, value: String) -> String {
        self.state().pending.push(Call {
            position,
            import: import.to_string(),
            name: None,
            args_hash: None,
            ops_before: ops,
            ops_after: Some(ops),
            outcome: Some("ok".into()),
            result: Some(value.clone()),
        });
        value
    }

    /// A live monotonic reading: it continues from the last replayed value
    /// and never goes back.
    pub fn monotonic_live(&self, live_ns: u64) -> u64 {
        // The first live reading fixes the offset that continues the
        // clock from the last recorded value (0 on a first attempt).
        let mut s = self.state();
        let floor = s.monotonic_floor;
        let offset = *s.monotonic_offset.get_or_insert((floor as i128 - live_ns as i128).max(0));
        ((live_ns as i128 + offset).max(0) as u64).max(floor)
    }

    /// A monotonic reading handed out (replayed or live): later live ones
    /// never go below it.
    pub fn monotonic_seen(&self, ns: u64) -> u64 {
        let mut s = self.state();
        s.monotonic_floor = s.monotonic_floor.max(ns);
        ns
    }

    /// Writes buffered readings (fenced). `Fenced` when the claim is gone.
    pub async fn flush(&self) -> Result<(), HostError> {
        let pending = std::mem::take(&mut self.state().pending);
        if pending.is_empty() {
            return Ok(());
        }
        self.write(&pending).await
    }

    /// Records that call-tool `name` starts at `position` (with the readings
    /// before it), before the tool runs.
    pub async fn start(&self, position: i32, name: &str, hash: &str, ops: i64) -> Result<(), HostError> {
        let mut calls = std::mem::take(&mut self.state().pending);
        calls.push(Call {
            position,
            import: CALL_TOOL.into(),
            name: Some(name.to_string()),
            args_hash: Some(hash.to_string()),
            ops_before: ops,
            ops_after: None,
            outcome: None,
            result: None,
        });
        self.write(&calls).await
    }

    /// Takes a call whose outcome is unknown before it is made again (fenced):
    /// a stale process resuming the same run is shut out before it re-sends.
    pub async fn retake(&self, position: i32) -> Result<(), HostError> {
        let (pool, run, token, attempt) = (&self.pool, self.run_id, self.token, self.attempt);
        self.retrying(|| calls::retake(pool, run, token, position, attempt)).await
    }

    /// Records a call's outcome, before the agent sees it.
    pub async fn complete(&self, position: i32, ops: i64, answer: &Result<String, HostError>) -> Result<(), HostError> {
        let (outcome, result) = match answer {
            Ok(text) => ("ok", crate::text::storable(text).into_owned()),
            Err(e) => (e.kind(), crate::text::storable(&refusal_message(e)).into_owned()),
        };
        let (pool, run, token) = (&self.pool, self.run_id, self.token);
        self.retrying(|| calls::complete(pool, run, token, position, ops, outcome, &result)).await
    }

    async fn write(&self, calls: &[Call]) -> Result<(), HostError> {
        let (pool, run, token, attempt) = (&self.pool, self.run_id, self.token, self.attempt);
        self.retrying(|| calls::insert(pool, run, token, attempt, calls)).await
    }

    /// Runs a fenced write until it lands; while the database is away it is
    /// retried for [`RETRY_MAX`], then the run stands down as if fenced (it
    /// is requeued once its lease lapses and resumed from what was recorded).
    async fn retrying<F, Fut>(&self, mut write: F) -> Result<(), HostError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool, sqlx::Error>>,
    {
        self.retrying_for(|| {
            let w = write();
            async move { w.await.map(|written| written.then_some(())) }
        })
        .await
    }

    /// [`retrying`](Self::retrying) for a write that answers a value
    /// (`None`: fenced; a lost answer of a committed call-log insert: the default).
    async fn retrying_for<T, F, Fut>(&self, mut write: F) -> Result<T, HostError>
    where
        T: Default,
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<Option<T>, sqlx::Error>>,
    {
        let started = std::time::Instant::now();
        let mut pause = std::time::Duration::from_millis(50);
        loop {
            match write().await {
                Ok(Some(value)) => return Ok(value),
                // Zero rows: the claim is gone (or a retry found its own
                // earlier try committed; standing down is safe either way).
                Ok(None) => return self.fenced(),
                // An earlier try committed though its answer was lost.
                Err(sqlx::Error::Database(d)) if d.constraint() == Some("run_call_pkey") => return Ok(T::default()),
                Err(e) if started.elapsed() < RETRY_MAX => {
                    tracing::warn!(run_id = %self.run_id, error = %e, "recording a call failed; will retry");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_secs(1));
                }
                Err(e) => {
                    tracing::error!(run_id = %self.run_id, error = %e, "recording kept failing; the run stands down");
                    return self.fenced();
                }
            }
        }
    }

    fn fenced<T>(&self) -> Result<T, HostError> {
        self.lost.cancel();
        Err(HostError::Fenced)
    }
}

fn divergence(recorded: &Call, now: &str) -> Divergence {
    let was = match (&recorded.name, &recorded.args_hash) {
        (Some(n), Some(h)) => format!("{} {n:?} (args {h})", recorded.import),
        _ => recorded.import.clone(),
    };
    Divergence(format!(
        "at call {}: the log has {was} after {} journal appends, the agent made {now}",
        recorded.position, recorded.ops_before
    ))
}

fn refusal_message(e: &HostError) -> String {
    match e {
        HostError::Cancelled | HostError::Fenced => String::new(),
        HostError::Denied(m)
        | HostError::Invalid(m)
        | HostError::Limit(m)
        | HostError::ToolFailed(m)
        | HostError::Unavailable(m) => m.clone(),
        HostError::Throttled { .. } => e.to_string(),
    }
}

/// A recorded outcome as the agent gets it again.
pub fn recorded_answer(call: &Call) -> Result<String, HostError> {
    let m = call.result.clone().unwrap_or_default();
    match call.outcome.as_deref() {
        Some("ok") => Ok(m),
        Some("cancelled") => Err(HostError::Cancelled),
        Some("fenced") => Err(HostError::Fenced),
        Some("denied") => Err(HostError::Denied(m)),
        Some("invalid") => Err(HostError::Invalid(m)),
        Some("limit") => Err(HostError::Limit(m)),
        Some("unavailable") => Err(HostError::Unavailable(m)),
        _ => Err(HostError::ToolFailed(m)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_survives_the_log() {
        for e in [
            HostError::Cancelled,
            HostError::Denied("d".into()),
            HostError::Invalid("i".into()),
            HostError::Limit("l".into()),
            HostError::ToolFailed("t".into()),
            HostError::Unavailable("u".into()),
        ] {
            let call = Call {
                position: 1,
                import: CALL_TOOL.into(),
                name: Some("x".into()),
                args_hash: Some(args_hash("{}")),
                ops_before: 0,
                ops_after: Some(0),
                outcome: Some(e.kind().into()),
                result: Some(refusal_message(&e)),
            };
            assert_eq!(recorded_answer(&call), Err(e));
        }
    }
}
