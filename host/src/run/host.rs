//! The host side of one run: every import a run can make (emit an event,
//! call a tool, check for a stop), with the plugin's grants and limits, the
//! tool-call ordinal, journaling and model usage. Built-in agents call it
//! directly; a Wasm guest's imports are translated to it by the sandbox, so
//! both get the same checks, refusals and journal.
//!
//! Every import is fenced: once the claim is lost, they refuse with
//! [`HostError::Fenced`]. A limit refusal is also recorded as the run's
//! failure ([`RunHost::failure`]): the run ends failed with reason `limit`
//! whatever the agent does next.
//!
//! A resumable run's host also records every call whose answer it decides
//! and, on a resumed attempt, answers them from the log ([`crate::run::record`]):
//! here, behind the one owner of the imports, so every agent gets it.
//! Every journal append is numbered (`op`), so a resumed attempt knows what is
//! already journaled and writes only what comes after.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::db::children::Child;
use crate::db::enqueue::Owner;
use crate::db::events::{
    AGENT_FINISHED, AGENT_STARTED, CONTENT_DELTA, CONTENT_ROLLBACK, RESERVED, RUN_RESUMED, STEER_RECEIVED, STEER_TAKEN,
};
use crate::db::suspensions::{Kind as SuspendKind, Suspend};
use crate::db::{ClaimToken, RunId};
use crate::error::{AgentError, FailReason, HostError};
use crate::run::journal::Journal;
use crate::run::manifest::Limits;
use crate::run::manifest::Manifest;
use crate::run::record::{self, Decided, Divergence, Next, NextReading, Recording};
pub use crate::tools::TAKE_INSTRUCTIONS;
use crate::tools::{EventSink, ToolCall, ToolInfo, ToolRegistry, AGENT_TOOL_PREFIX, AWAIT_AGENTS, LLM_TOOL, WAIT_TOOL};

/// The longest durable wait.
pub const WAIT_MAX: Duration = Duration::from_secs(30 * 24 * 3600);

/// How long the `wait` tool's arguments ask to wait: `{seconds}` (a number
/// above 0) or `{until}` (an RFC 3339 time), at most [`WAIT_MAX`].
fn wait_for(args: &Value) -> Result<Duration, HostError> {
    let invalid = || HostError::Invalid("wait takes {\"seconds\": n} or {\"until\": \"<RFC 3339 time>\"}".into());
    let d = match (args.get("seconds").and_then(Value::as_f64), args.get("until").and_then(Value::as_str)) {
        (Some(s), None) if s > 0.0 && s.is_finite() => Duration::from_secs_f64(s.min(WAIT_MAX.as_secs_f64())),
        (None, Some(until)) => {
            let until = chrono::DateTime::parse_from_rfc3339(until).map_err(|_| invalid())?;
            let left = until.with_timezone(&chrono::Utc) - chrono::Utc::now();
            left.to_std().unwrap_or(Duration::ZERO).max(Duration::from_millis(1))
        }
        _ => return Err(invalid()),
    };
    if d > WAIT_MAX {
        return Err(HostError::Invalid(format!("wait at most {} days", WAIT_MAX.as_secs() / 86_400)));
    }
    Ok(d)
}

/// How long `await-agents` waits at most; then it answers the children as
/// they are.
pub const AWAIT_AGENTS_MAX: Duration = WAIT_MAX;

/// Child runs one `await-agents` names at most.
pub const AWAIT_RUNS_MAX: usize = crate::run::manifest::CHILDREN_CEILING as usize;

/// What a run's host starts and reads its child runs with (sub-agents):
/// the worker's, built on the enqueue service
/// ([`crate::service::children::Starter`]).
#[async_trait]
pub trait Children: Send + Sync {
    /// Starts the child a parent's tool call asks for within the parent's
    /// limits, or finds the one that call started before (a re-issued
    /// call starts nothing).
    async fn start(&self, child: &ChildStart<'_>) -> Result<StartedChild, HostError>;
    /// The parent's children among `runs` (every one when empty), in the
    /// order they were started.
    async fn read(&self, parent: RunId, runs: &[RunId]) -> Result<Vec<Child>, HostError>;
}

/// A child run as its parent's agent asks for it.
pub struct ChildStart<'a> {
    pub parent: RunId,
    /// The parent's tool-call ordinal that starts it.
    pub call: i32,
    /// The parent's owner and tenant: the child's.
    pub owner: &'a Owner,
    pub plugin: &'a str,
    pub input: &'a str,
    pub config: Option<Value>,
    /// The parent's limits (`children_max`, `children_active_max`, `agent_depth_max`).
    pub limits: &'a Limits,
}

/// A child run started (or found).
#[derive(Debug, Clone, Copy)]
pub struct StartedChild {
    pub run_id: RunId,
    pub conversation_id: crate::db::ConversationId,
}

/// A take that found nothing, as the log keeps it.
const NONE_TAKEN: &str = "[]";

/// Length of an event kind.
pub const EVENT_KIND_BYTES_MAX: usize = 64;
/// Bytes of streamed text a run keeps as its partial answer (the journal has
/// all of it); past this the partial answer is cut.
pub const STREAMED_BYTES_MAX: usize = 1 << 20;

/// Model tokens a run used, over all its model calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Usage {
    pub model_calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Of the prompt tokens, those the providers read from their caches.
    pub cached_tokens: u64,
    /// USD by the tools file's price table (calls without a price count 0).
    pub cost_usd: f64,
}

/// What a run's host is built from (by the worker, at the claim).
pub struct RunHostParts {
    pub run_id: RunId,
    pub journal: Journal,
    /// Fired when a stop is requested (the NOTIFY or the heartbeat saw the flag).
    pub cancel: CancellationToken,
    /// What `call-tool` reaches, behind `manifest`'s grants.
    pub tools: ToolRegistry,
    /// The plugin's grants and limits, as pinned on the run.
    pub manifest: Manifest,
    /// The call log of a resumable run (`None`: at-most-once, nothing recorded).
    pub recording: Option<Recording>,
    /// Tools whose calls the run's client asked to wait for approval (its
    /// config's `require_approval`: more than the manifest, never less).
    pub require_approval: Vec<String>,
    /// The tenant whose own plugin this is (`None`: a published plugin or a
    /// built-in agent): its calls are held to the operator's grants for
    /// that tenant too, not only to its manifest's.
    pub plugin_tenant: Option<String>,
    /// Where the run's queued instructions are read (steering), and the
    /// claim that fences those reads.
    pub pool: sqlx::PgPool,
    pub token: ClaimToken,
    /// The run's owner and tenant (its children's).
    pub owner: Owner,
    /// What starts and reads its children (`None`: no sub-agents here).
    pub children: Option<Arc<dyn Children>>,
}

/// The imports of one run. Cheap to clone (a guest's store holds a clone);
/// the run task keeps one and closes the journal after the agent, however
/// the agent ended.
#[derive(Clone)]
pub struct RunHost {
    inner: Arc<Inner>,
}

struct Inner {
    run_id: RunId,
    cancel: CancellationToken,
    journal_gave_up: CancellationToken,
    /// Serialises appends: the journal sees them in the order they were made.
    journal: tokio::sync::Mutex<Option<Journal>>,
    tools: ToolRegistry,
    manifest: Manifest,
    recording: Option<Recording>,
    require_approval: Vec<String>,
    plugin_tenant: Option<String>,
    pool: sqlx::PgPool,
    token: ClaimToken,
    owner: Owner,
    children: Option<Arc<dyn Children>>,
    /// Serialises announcing and taking instructions, so `steer_received`
    /// always precedes its `steer_taken` in the journal.
    steering: tokio::sync::Mutex<()>,
    /// Fired when the run must end now with its failure (a replay diverged,
    /// a call's outcome is unknown).
    abort: CancellationToken,
    /// Fired when a suspension's write has returned, whichever way (see
    /// [`RunHost::suspension_settled`]).
    suspension_settled: CancellationToken,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Text streamed so far as `content_delta`, up to [`STREAMED_BYTES_MAX`]:
    /// kept as the partial answer if the turn is cut off.
    streamed: String,
    /// Events the agent emitted (host-written ones are not counted).
    events: u64,
    /// Bytes appended to the journal (kinds and payloads, every event).
    journal_bytes: u64,
    /// Calls of the host interface a guest made.
    host_calls: u64,
    /// Tool calls made: the next call's ordinal is this plus one.
    tool_calls: u64,
    usage: Usage,
    /// Journal appends made (the next one's `op` is this plus one),
    /// including those a resumed attempt did not write again.
    ops: i64,
    /// The failure the run must end with, if any (a limit it hit, a replay
    /// that diverged): it ends failed with it whatever the agent does next.
    failure: Option<(FailReason, String)>,
    /// A suspension's write was sent: the run's claim may be gone by its
    /// own doing.
    suspending: bool,
    /// The run was suspended: it waits, and the worker lets it go.
    suspended: bool,
    /// Children whose ending an await told the agent (`agent_finished`
    /// journaled once each; replayed awaits count too).
    agents_told: std::collections::HashSet<RunId>,
}

/// A call-tool past its gate.
struct GatedCall<'n> {
    name: &'n str,
    /// 1-based among the run's tool calls (the webhook's Idempotency-Key with the run id).
    ordinal: u64,
    args: Value,
    /// Whether the call waits, and for what (a person, a time), how long.
    waits: Option<(SuspendKind, Duration)>,
    /// The journal appends before it.
    ops: i64,
}

/// What the log says of a gated call-tool, one flat plan.
enum Plan {
    /// A run that records nothing: make the call.
    Unrecorded,
    /// Answer from the log.
    Answer(crate::db::calls::Call),
    /// In flight when the worker died: make it again if idempotent.
    Reissue(crate::db::calls::Call),
    /// A waiting call in flight when the worker died: its decision says.
    Decided(crate::db::calls::Call),
    /// A new call that waits: record it and suspend.
    Suspend(i32, (SuspendKind, Duration)),
    /// A new call: record it, then make it.
    Live(i32),
    /// Past the recorded-calls limit.
    Refused(String),
    /// Not the call recorded at its position.
    Diverged(Divergence),
}

/// A gated reading's plan: what the log answers, or a live reading at this
/// position after these journal appends.
enum Planned {
    Answer(String),
    Live(i32, i64),
}

/// What a waiting call's decision leaves to do.
enum Decision {
    Answered(Result<String, HostError>),
    Invoke,
}

impl RunHost {
    pub fn new(parts: RunHostParts) -> Self {
        let journal_gave_up = parts.journal.gave_up();
        RunHost {
            inner: Arc::new(Inner {
                run_id: parts.run_id,
                cancel: parts.cancel,
                journal_gave_up,
                journal: tokio::sync::Mutex::new(Some(parts.journal)),
                tools: parts.tools,
                manifest: parts.manifest,
                recording: parts.recording,
                require_approval: parts.require_approval,
                plugin_tenant: parts.plugin_tenant,
                pool: parts.pool,
                token: parts.token,
                owner: parts.owner,
                children: parts.children,
                steering: tokio::sync::Mutex::new(()),
                abort: CancellationToken::new(),
                suspension_settled: CancellationToken::new(),
                state: Mutex::new(State::default()),
            }),
        }
    }

    pub fn run_id(&self) -> RunId {
        self.inner.run_id
    }

    pub fn manifest(&self) -> &Manifest {
        &self.inner.manifest
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().unwrap()
    }

    /// A limit refusal: the agent gets the typed error, and the run will end
    /// failed with the reason whatever the agent does next.
    fn limit(&self, reason: String) -> HostError {
        self.state().failure.get_or_insert_with(|| (FailReason::Limit, reason.clone()));
        HostError::Limit(reason)
    }

    /// Ends the run now, failed for `reason` (the agent's future is dropped);
    /// the agent gets `unavailable` meanwhile.
    fn abort(&self, reason: FailReason, message: String) -> HostError {
        tracing::warn!(run_id = %self.inner.run_id, %reason, %message, "the run cannot go on");
        self.state().failure.get_or_insert_with(|| (reason, message.clone()));
        self.inner.abort.cancel();
        HostError::Unavailable(reason.message(message))
    }

    /// The failure this run must end with, if any (a limit it hit, a replay
    /// that diverged, a call whose outcome is unknown).
    pub fn failure(&self) -> Option<AgentError> {
        self.state().failure.clone().map(|(reason, message)| AgentError::failed(reason, message))
    }

    /// Resolves when the run must end at once with its [`failure`](Self::failure).
    pub async fn aborted(&self) {
        self.inner.abort.cancelled().await
    }

    /// The resumed attempt, if this run is one, with the calls to replay.
    pub fn resumed(&self) -> Option<(i32, usize)> {
        let rec = self.inner.recording.as_ref()?;
        (rec.attempt() > 1).then(|| (rec.attempt(), rec.to_replay()))
    }

    /// Calls answered from the log so far.
    pub fn replayed(&self) -> u64 {
        self.inner.recording.as_ref().map_or(0, |r| r.replayed())
    }

    /// Journals `run_resumed` (outside the append order: a resumed attempt writes it).
    pub async fn journal_resumed(&self, worker_id: &str) -> Result<(), HostError> {
        let Some((attempt, calls)) = self.resumed() else { return Ok(()) };
        let payload = json!({ "attempt": attempt, "worker_id": worker_id, "replayed_calls": calls });
        self.append_unnumbered(RUN_RESUMED, payload).await
    }

    /// Whether the agent is still being answered from the log (or re-making
    /// what an earlier attempt journaled): live checks such as a stop do
    /// not apply then, so the replay sees what the first attempt saw.
    fn replaying(&self) -> bool {
        self.inner.recording.as_ref().is_some_and(|r| r.replaying() || self.state().ops < r.journaled_op())
    }

    fn diverged(&self, d: Divergence) -> HostError {
        self.abort(FailReason::Divergence, d.0)
    }

    /// Once the run must end (an abort), every import refuses: the agent is
    /// about to be dropped and may make no call meanwhile.
    fn ended(&self) -> Result<(), HostError> {
        match self.inner.abort.is_cancelled() {
            true => Err(HostError::Fenced),
            false => Ok(()),
        }
    }

    /// When the agent has ended with calls of a resumed run's log not made
    /// again: the run ends failed, a divergence.
    pub fn check_replayed(&self) -> Option<AgentError> {
        let d = self.inner.recording.as_ref()?.left_unreplayed()?;
        self.diverged(d);
        self.failure()
    }

    /// The plugin's `payload_bytes` limit on one host call's arguments or
    /// answer; `what` names them, `verb` agrees with it.
    fn check_payload_size(&self, what: &str, verb: &str, bytes: usize) -> Result<(), HostError> {
        let max = self.inner.manifest.limits.payload_bytes;
        if bytes as u64 > max {
            return Err(self.limit(format!("{what} of {bytes} bytes {verb} {max}")));
        }
        Ok(())
    }

    fn count_event(&self) -> Result<(), HostError> {
        let max = self.inner.manifest.limits.events_max;
        let n = {
            let mut s = self.state();
            s.events += 1;
            s.events
        };
        if n > max {
            return Err(self.limit(format!("more than {max} events")));
        }
        Ok(())
    }

    /// Counts one call of the host interface by a guest against the
    /// plugin's `host_calls_max`; past it the run will end failed (`limit`).
    pub fn count_host_call(&self) -> Result<(), HostError> {
        let max = self.inner.manifest.limits.host_calls_max;
        let n = {
            let mut s = self.state();
            s.host_calls += 1;
            s.host_calls
        };
        if n > max {
            return Err(self.limit(format!("more than {max} host calls")));
        }
        Ok(())
    }

    /// The plugin's `journal_bytes_max`: every event the run's journal takes
    /// (the agent's, streamed model text, the host's own) counts; past the
    /// budget the run ends at once, failed with reason `limit`.
    fn count_journal_bytes(&self, bytes: usize) -> Result<(), HostError> {
        let max = self.inner.manifest.limits.journal_bytes_max;
        let total = {
            let mut s = self.state();
            s.journal_bytes += bytes as u64;
            s.journal_bytes
        };
        if total > max {
            return Err(self.abort(FailReason::Limit, format!("journal budget of {max} bytes spent")));
        }
        Ok(())
    }

    /// `emit-event` as a guest calls it: `payload` is JSON text.
    pub async fn emit_event_json(&self, kind: &str, payload: &str) -> Result<(), HostError> {
        self.check_payload_size("event payload", "exceeds", payload.len())?;
        self.count_event()?;
        let value: Value = match serde_json::from_str(payload) {
            Ok(v @ Value::Object(_)) => v,
            _ => return Err(HostError::Invalid("payload must be a JSON object".into())),
        };
        self.emit_checked(kind, value).await
    }

    /// Appends one event to the run's journal (fenced): `content_delta` with a
    /// string `delta` is buffered and merged; anything else is written
    /// through. Counted against the plugin's `events_max`.
    pub async fn emit_event(&self, kind: &str, payload: Value) -> Result<(), HostError> {
        self.check_payload_size("event payload", "exceeds", crate::text::json_bytes(&payload))?;
        self.count_event()?;
        if !payload.is_object() {
            return Err(HostError::Invalid("event payload must be a JSON object".into()));
        }
        self.emit_checked(kind, payload).await
    }

    async fn emit_checked(&self, kind: &str, payload: Value) -> Result<(), HostError> {
        if kind.is_empty() || kind.len() > EVENT_KIND_BYTES_MAX {
            return Err(HostError::Invalid(format!("event kind must be 1-{EVENT_KIND_BYTES_MAX} bytes")));
        }
        if RESERVED.contains(&kind) {
            return Err(HostError::Invalid(format!("event kind {kind:?} is reserved for the host")));
        }
        self.ended()?;
        if !self.replaying() && self.stop_requested() {
            return Err(HostError::Cancelled);
        }
        self.append(kind, payload, true).await
    }

    /// Streams a piece of the answer (`content_delta`).
    pub async fn emit_delta(&self, delta: &str) -> Result<(), HostError> {
        self.emit_event(CONTENT_DELTA, json!({ "delta": delta })).await
    }

    /// Journals a call of a client's function the turn ended with
    /// (`function_call`, reserved: only the host writes it, once it has
    /// checked the call against the turn's client tools), in the agent's order.
    pub async fn journal_function_call(&self, payload: Value) -> Result<(), HostError> {
        self.check_payload_size("function call", "exceeds", crate::text::json_bytes(&payload))?;
        self.count_event()?;
        self.ended()?;
        self.append(crate::db::events::FUNCTION_CALL, payload, true).await
    }

    /// Appends one event in the run's append order (numbered). What an
    /// earlier attempt of a resumed run journaled is not written again; the
    /// readings an agent's event may depend on are recorded before it.
    async fn append(&self, kind: &str, payload: Value, by_agent: bool) -> Result<(), HostError> {
        self.count_journal_bytes(kind.len() + crate::text::json_bytes(&payload))?;
        let mut journal = self.inner.journal.lock().await;
        let journal = journal.as_mut().ok_or(HostError::Fenced)?;
        let op = {
            let mut s = self.state();
            s.ops += 1;
            s.ops
        };
        let delta = payload.get("delta").and_then(Value::as_str).filter(|_| kind == CONTENT_DELTA);
        if let Some(delta) = delta {
            self.keep_streamed(delta);
        }
        if let Some(rec) = &self.inner.recording {
            if op <= rec.journaled_op() {
                return Ok(());
            }
            if by_agent {
                rec.flush().await?;
            }
        }
        match delta {
            Some(_) => journal.delta(payload, Some(op)).await,
            None => journal.event(kind, payload, Some(op)).await,
        }
    }

    /// Appends a host event outside the append order (`op` null): one a
    /// resumed attempt writes that the first did not.
    async fn append_unnumbered(&self, kind: &str, payload: Value) -> Result<(), HostError> {
        let mut journal = self.inner.journal.lock().await;
        let journal = journal.as_mut().ok_or(HostError::Fenced)?;
        journal.event(kind, payload, None).await
    }

    /// Keeps `delta` as part of the partial answer, up to the bound.
    fn keep_streamed(&self, delta: &str) {
        let mut s = self.state();
        let room = STREAMED_BYTES_MAX.saturating_sub(s.streamed.len());
        if room >= delta.len() {
            s.streamed.push_str(delta);
        } else if room > 0 {
            let mut end = room;
            while !delta.is_char_boundary(end) {
                end -= 1;
            }
            s.streamed.push_str(&delta[..end]);
        }
    }

    /// `call-tool`: checks the grant and the limits, takes the call's
    /// ordinal, runs the tool (journaled `tool_call_started` and
    /// `tool_call_finished`, dropped on a stop or past its timeout) and
    /// returns its JSON answer as text.
    pub async fn call_tool(&self, name: &str, args: &str) -> Result<String, HostError> {
        if name == TAKE_INSTRUCTIONS {
            let taken = self.take_instructions().await?;
            return Ok(json!({ "instructions": taken }).to_string());
        }
        let mut call = self.gate(name, args).await?;
        if name == AWAIT_AGENTS {
            call.args = self.await_args(&call.args).await?;
        }
        let recorded = match self.plan(&call, args) {
            Plan::Unrecorded => None,
            Plan::Answer(logged) => return self.replay_answer(&logged, name),
            Plan::Refused(message) => return Err(self.limit(message)),
            Plan::Diverged(d) => return Err(self.diverged(d)),
            Plan::Reissue(logged) => {
                self.reissue(&logged, name, call.ordinal).await?;
                Some(logged.position)
            }
            Plan::Decided(logged) => match self.decided(&logged, &mut call).await? {
                Decision::Answered(answer) => return answer,
                Decision::Invoke => Some(logged.position),
            },
            Plan::Suspend(position, wait) => {
                self.recording().start(position, name, &record::args_hash(args), call.ops).await?;
                // Children joined already: answered now, nothing waits.
                if name == AWAIT_AGENTS {
                    if let Some(joined) = self.joined(&call).await? {
                        let ops = self.state().ops;
                        self.recording().complete(position, ops, &joined).await?;
                        return joined;
                    }
                }
                return self.suspend(position, call.ordinal, name, &call.args, wait).await;
            }
            Plan::Live(position) => {
                self.recording().start(position, name, &record::args_hash(args), call.ops).await?;
                Some(position)
            }
        };
        self.invoke(call, recorded).await
    }

    /// A call-tool's gate: the run may still call, the plugin (and its
    /// tenant) is granted the tool, the arguments are within their limit
    /// and JSON, the call is within the run's tool calls (its ordinal
    /// taken), and a call that waits is made by a resumable run.
    async fn gate<'n>(&self, name: &'n str, args: &str) -> Result<GatedCall<'n>, HostError> {
        self.ended()?;
        if !self.replaying() && self.stop_requested() {
            return Err(HostError::Cancelled);
        }
        self.check_payload_size("tool arguments", "exceed", args.len())?;
        if !self.inner.manifest.grants(name) {
            return Err(HostError::Denied(format!("tool {name:?} is not granted to this plugin")));
        }
        if let Some(tenant) = &self.inner.plugin_tenant {
            if !self.inner.tools.admits(name, tenant) {
                return Err(HostError::Denied(format!(
                    "tool {name:?} is not granted to tenant {tenant:?} by the operator"
                )));
            }
        }
        let ordinal = {
            let mut s = self.state();
            s.tool_calls += 1;
            s.tool_calls
        };
        let max = self.inner.manifest.limits.tool_calls_max;
        if ordinal > max {
            return Err(self.limit(format!("more than {max} tool calls")));
        }
        // An MCP tool's annotations (approval, re-sending) come with its
        // listing; a call the log answers needs none (replay never touches
        // the network).
        if !self.inner.recording.as_ref().is_some_and(|r| r.next_answered()) {
            self.inner.tools.warm(name).await;
        }
        let args: Value =
            serde_json::from_str(args).map_err(|e| HostError::Invalid(format!("tool arguments are not JSON: {e}")))?;
        // A call that waits (for a person, or a time) suspends the run: only
        // a resumable run can be resumed after it.
        let waits = self.suspends(name, &args)?;
        if waits.is_some() && self.inner.recording.is_none() {
            return Err(HostError::Denied(format!(
                "tool {name:?} waits (for approval or a time), which needs a resumable plugin \
                 (\"durability\": \"resume\" in its manifest)"
            )));
        }
        Ok(GatedCall { name, ordinal, args, waits, ops: self.state().ops })
    }

    /// What the log says of a gated call, one flat plan (no log: unrecorded).
    fn plan(&self, call: &GatedCall<'_>, args_text: &str) -> Plan {
        let Some(rec) = &self.inner.recording else { return Plan::Unrecorded };
        match (rec.next_tool(call.name, &record::args_hash(args_text), call.ops), call.waits) {
            (Next::Answer(logged), _) => Plan::Answer(logged),
            (Next::Refused(message), _) => Plan::Refused(message),
            (Next::Diverged(d), _) => Plan::Diverged(d),
            // A call that waits, in flight at a crash: its decision (or none yet) says.
            (Next::Unknown(logged), Some(_)) => Plan::Decided(logged),
            (Next::Unknown(logged), None) => Plan::Reissue(logged),
            (Next::Live(position), Some(wait)) => Plan::Suspend(position, wait),
            (Next::Live(position), None) => Plan::Live(position),
        }
    }

    /// A waiting call the log holds as started: ask now if it never
    /// suspended (the worker died first), else apply its decision: a
    /// rejection or an elapsed wait answers it, an approval (edited, maybe)
    /// makes it, unless it was in flight already and is not idempotent.
    async fn decided(&self, logged: &crate::db::calls::Call, call: &mut GatedCall<'_>) -> Result<Decision, HostError> {
        let rec = self.recording();
        rec.retake(logged.position).await?;
        {
            let mut s = self.state();
            s.ops = call.ops.max(rec.journaled_op());
        }
        let (name, ordinal) = (call.name, call.ordinal);
        let answered = |answer: Result<String, HostError>| async {
            let ops = self.state().ops;
            rec.complete(logged.position, ops, &answer).await?;
            Ok(Decision::Answered(answer))
        };
        match rec.decision(ordinal as i32).cloned() {
            None => {
                let wait = call.waits.expect("a decided call waits");
                Ok(Decision::Answered(self.suspend(logged.position, ordinal, name, &call.args, wait).await))
            }
            Some((Decided::Approve | Decided::Edit(_), true))
                if !self.inner.tools.get(name).is_some_and(|t| t.idempotent()) =>
            {
                let message = format!(
                    "call {} (tool call {ordinal}, {name:?}) was approved and in flight when the run's \
                     worker was lost; its outcome is unknown and the tool is not idempotent, so it is \
                     not called again",
                    logged.position
                );
                Err(self.abort(FailReason::UnknownOutcome, message))
            }
            Some((Decided::Approve, _)) => {
                rec.start_approved(ordinal as i32).await?;
                Ok(Decision::Invoke)
            }
            Some((Decided::Edit(edited), _)) => {
                rec.start_approved(ordinal as i32).await?;
                call.args = edited;
                Ok(Decision::Invoke)
            }
            Some((Decided::Reject(reason), _)) => answered(Err(HostError::Denied(reason))).await,
            Some((Decided::Elapsed, _)) => answered(Ok(json!({ "waited": true }).to_string())).await,
            // Joined (or timed out): the children as they are now.
            Some((Decided::Joined, _)) => {
                let answer = self.join_answer(ordinal, &call.args).await;
                answered(answer).await
            }
        }
    }

    /// Makes a gated call; a recorded one's outcome is durable before the
    /// agent sees it (its events are journaled: `tool_call_finished` is
    /// written through).
    async fn invoke(&self, call: GatedCall<'_>, recorded: Option<i32>) -> Result<String, HostError> {
        // The call's trace span (a live call only: a replayed one made none).
        let span = crate::telemetry::tool_call(call.name, call.ordinal, &call.args);
        // With the run id, the ordinal is the webhook's Idempotency-Key:
        // 1-based, never repeated within a run (a re-issued call keeps it).
        let tool_call = ToolCall {
            run_id: self.run_id(),
            call_index: call.ordinal as u32,
            name: call.name,
            args: call.args,
            timeout_max: Some(Duration::from_millis(self.inner.manifest.limits.tool_timeout_ms)),
            tenant: self.inner.plugin_tenant.as_deref(),
            may_suspend: recorded.is_some(),
        };
        let answer = match call.name.strip_prefix(AGENT_TOOL_PREFIX) {
            Some(plugin) => self.start_child(plugin, tool_call.call_index, &tool_call.args).await,
            None => self.inner.tools.invoke(tool_call, &span.sink(self), self.cancelled()).await,
        };
        span.end(&answer);
        // A long wait for a shared model limit: the run waits with nothing
        // held, and its resumed attempt makes the call again (it is logged
        // as started and unanswered, and a model call is idempotent).
        if let (Err(HostError::Throttled { limit, wait_ms }), Some(position)) = (&answer, recorded) {
            let args = json!({ "limit": limit, "wait_ms": wait_ms });
            let wait = Duration::from_millis(*wait_ms);
            return self.suspend(position, call.ordinal, call.name, &args, (SuspendKind::Limit, wait)).await;
        }
        if let Some(position) = recorded {
            let ops = self.state().ops;
            self.recording().complete(position, ops, &answer).await?;
        }
        let text = answer?;
        self.check_payload_size("tool answer", "exceeds", text.len())?;
        Ok(text)
    }

    fn recording(&self) -> &Recording {
        self.inner.recording.as_ref().expect("a recorded call needs the run's recording")
    }

    /// The manifest's grants the operator lets this plugin's tenant use
    /// (all of them for a published plugin).
    fn granted(&self) -> Vec<String> {
        let grants = self.inner.manifest.tools.iter();
        match &self.inner.plugin_tenant {
            None => grants.cloned().collect(),
            Some(t) => grants.filter(|g| self.inner.tools.admits(g, t)).cloned().collect(),
        }
    }

    /// `list-tools`: the granted tools this host has, with descriptions and
    /// input schemas (an MCP server down now is left out). A resumable run
    /// records the answer, so a resumed one sees what the first saw.
    pub async fn list_tools(&self) -> Result<Vec<ToolInfo>, HostError> {
        let Some(rec) = &self.inner.recording else {
            self.ended()?;
            return Ok(self.inner.tools.list(&self.granted()).await);
        };
        let to_text = |tools: &[ToolInfo]| {
            let list: Vec<Value> = tools
                .iter()
                .map(|t| json!({ "name": t.name, "description": t.description, "input_schema": t.input_schema }))
                .collect();
            Value::Array(list).to_string()
        };
        // On replay the log answers; the servers are not asked.
        let text = match self.plan_reading(rec, record::LIST_TOOLS)? {
            Planned::Answer(text) => text,
            Planned::Live(at, ops) => {
                let live = to_text(&self.inner.tools.list(&self.granted()).await);
                rec.record_reading(at, record::LIST_TOOLS, ops, live)
            }
        };
        let list: Vec<Value> = serde_json::from_str(&text).unwrap_or_default();
        Ok(list
            .into_iter()
            .map(|t| ToolInfo {
                name: t["name"].as_str().unwrap_or_default().to_string(),
                description: t["description"].as_str().map(str::to_string),
                input_schema: t["input_schema"].clone(),
            })
            .collect())
    }

    /// `take-instructions`: the instructions queued for this turn since the
    /// last take (steering), oldest first, each taken once. A resumable run
    /// records the answer as a reading, so a resumed one takes the same
    /// instructions at the same point; a take that finds some is journaled
    /// (`steer_taken`, after the `steer_received` of any not yet announced).
    pub async fn take_instructions(&self) -> Result<Vec<String>, HostError> {
        let _serial = self.inner.steering.lock().await;
        let (text, position) = match &self.inner.recording {
            None => {
                self.ended()?;
                (self.take_live(None).await?, None)
            }
            Some(rec) => match self.plan_reading(rec, record::TAKE_INSTRUCTIONS)? {
                Planned::Answer(text) => (text, None),
                Planned::Live(at, ops) => {
                    let live = self.take_live(Some(at)).await?;
                    let taken = live != NONE_TAKEN;
                    let text = rec.record_reading(at, record::TAKE_INSTRUCTIONS, ops, live);
                    // Durable before the guest acts on it: the rows are
                    // marked taken at this position already.
                    if taken {
                        rec.flush().await?;
                    }
                    (text, Some(at))
                }
            },
        };
        let taken: Value = serde_json::from_str(&text).unwrap_or_else(|_| json!([]));
        let list = taken.as_array().cloned().unwrap_or_default();
        if list.is_empty() {
            return Ok(Vec::new());
        }
        let contents = list.iter().map(|i| i["content"].as_str().unwrap_or_default().to_string()).collect();
        // Numbered: a replayed take journals nothing the first attempt did.
        let position = position.or_else(|| list.first().and_then(|i| i["position"].as_i64()).map(|p| p as i32));
        let instructions: Vec<Value> =
            list.iter().map(|i| json!({ "steer_id": i["steer_id"], "content": i["content"] })).collect();
        self.append(STEER_TAKEN, json!({ "instructions": instructions, "position": position }), false).await?;
        Ok(contents)
    }

    /// Takes the queued instructions from the database (fenced), journaling
    /// `steer_received` for any not yet announced; the answer as the log
    /// keeps it: `[{steer_id, content, position}]`.
    async fn take_live(&self, position: Option<i32>) -> Result<String, HostError> {
        let rows = crate::db::steer::take(&self.inner.pool, self.inner.run_id, self.inner.token, position)
            .await
            .map_err(|e| {
                tracing::warn!(run_id = %self.inner.run_id, error = %e, "taking instructions failed");
                HostError::Unavailable("the run's instructions could not be read".into())
            })?;
        self.journal_received(rows.iter().filter(|r| r.unannounced)).await?;
        let list: Vec<Value> =
            rows.iter().map(|r| json!({ "steer_id": r.id, "content": r.content, "position": position })).collect();
        Ok(Value::Array(list).to_string())
    }

    async fn journal_received<'a>(
        &self,
        rows: impl Iterator<Item = &'a crate::db::steer::Marked>,
    ) -> Result<(), HostError> {
        for r in rows {
            let payload = json!({ "steer_id": r.id, "content": r.content, "queued_at": r.created_at });
            self.append_unnumbered(STEER_RECEIVED, payload).await?;
        }
        Ok(())
    }

    /// Journals `steer_received` for the instructions queued since the last
    /// announcement (the worker calls it when a steer's NOTIFY names the
    /// run), so clients see an instruction arrive before the guest takes it.
    pub async fn announce_instructions(&self) -> Result<(), HostError> {
        let _serial = self.inner.steering.lock().await;
        self.ended()?;
        let rows = crate::db::steer::announce(&self.inner.pool, self.inner.run_id, self.inner.token)
            .await
            .map_err(|e| HostError::Unavailable(format!("the run's instructions could not be read: {e}")))?;
        self.journal_received(rows.iter()).await
    }

    fn children(&self) -> Result<&Arc<dyn Children>, HostError> {
        self.inner.children.as_ref().ok_or_else(|| HostError::Unavailable("this host starts no sub-agents".into()))
    }

    /// `agent:<plugin>`: starts a child run of `plugin` with `{input,
    /// config?}` (or finds the one this call started before) and answers
    /// `{run_id, conversation_id, plugin}` at once; `await-agents` waits.
    async fn start_child(&self, plugin: &str, call_index: u32, args: &Value) -> Result<String, HostError> {
        let invalid = || {
            HostError::Invalid(format!("{AGENT_TOOL_PREFIX}{plugin} takes {{\"input\": text, \"config\"?: object}}"))
        };
        let input = args.get("input").and_then(Value::as_str).ok_or_else(invalid)?;
        let config = match args.get("config") {
            None | Some(Value::Null) => None,
            Some(c @ Value::Object(_)) => Some(c.clone()),
            Some(_) => return Err(invalid()),
        };
        let start = ChildStart {
            parent: self.run_id(),
            call: call_index as i32,
            owner: &self.inner.owner,
            plugin,
            input,
            config,
            limits: &self.inner.manifest.limits,
        };
        let child = self.children()?.start(&start).await?;
        let payload = json!({ "call_index": call_index, "run_id": child.run_id, "plugin": plugin,
                              "conversation_id": child.conversation_id,
                              "events": format!("/v1/runs/{}/events", child.run_id) });
        self.append(AGENT_STARTED, payload, false).await?;
        Ok(json!({ "run_id": child.run_id, "conversation_id": child.conversation_id, "plugin": plugin }).to_string())
    }

    /// `await-agents`' arguments checked and made whole: `runs` (this
    /// run's children; every child started so far when absent or empty)
    /// and `mode` (`all`, the default, or `any`).
    async fn await_args(&self, args: &Value) -> Result<Value, HostError> {
        let invalid = |why: String| {
            HostError::Invalid(format!(
                "{AWAIT_AGENTS} takes {{\"runs\"?: [run ids], \"mode\"?: \"all\" | \"any\"}}: {why}"
            ))
        };
        let mode = match args.get("mode").and_then(Value::as_str) {
            None => "all",
            Some(m @ ("all" | "any")) => m,
            Some(m) => return Err(invalid(format!("mode {m:?}"))),
        };
        let asked: Vec<RunId> = match args.get("runs") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(runs)) if runs.len() <= AWAIT_RUNS_MAX => runs
                .iter()
                .map(|r| r.as_str().and_then(|r| r.parse().ok()).ok_or_else(|| invalid(format!("{r} is no run id"))))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(invalid(format!("runs is a list of at most {AWAIT_RUNS_MAX} run ids"))),
        };
        let found = self.children()?.read(self.run_id(), &asked).await?;
        if let Some(missing) = asked.iter().find(|r| !found.iter().any(|c| c.run_id == **r)) {
            return Err(HostError::Invalid(format!("run {missing} is not a child of this run")));
        }
        if found.is_empty() {
            return Err(HostError::Invalid("this run has started no child run to await".into()));
        }
        let runs: Vec<String> = found.iter().map(|c| c.run_id.to_string()).collect();
        Ok(json!({ "runs": runs, "mode": mode }))
    }

    /// The answer of an await whose children are joined now (`None`: they
    /// are not; the run waits).
    async fn joined(&self, call: &GatedCall<'_>) -> Result<Option<Result<String, HostError>>, HostError> {
        let runs = Self::awaited(&call.args);
        let children = self.children()?.read(self.run_id(), &runs).await?;
        let joined = match call.args["mode"].as_str() {
            Some("any") => children.iter().any(Child::ended),
            _ => children.iter().all(Child::ended),
        };
        if !joined {
            return Ok(None);
        }
        Ok(Some(self.answer_children(call.ordinal, &call.args, children).await))
    }

    fn awaited(args: &Value) -> Vec<RunId> {
        let runs = args["runs"].as_array().map(Vec::as_slice).unwrap_or_default();
        runs.iter().filter_map(|r| r.as_str()?.parse().ok()).collect()
    }

    /// The answer of an await the join (or its timeout) woke.
    async fn join_answer(&self, ordinal: u64, args: &Value) -> Result<String, HostError> {
        let children = self.children()?.read(self.run_id(), &Self::awaited(args)).await?;
        self.answer_children(ordinal, args, children).await
    }

    /// `{mode, runs: [{run_id, plugin, conversation_id, status, output,
    /// error}]}`, each ended child's `agent_finished` journaled the first
    /// time an await tells of it. A failed child is a value here, not the
    /// parent's failure. Outputs share the run's payload limit.
    async fn answer_children(&self, ordinal: u64, args: &Value, children: Vec<Child>) -> Result<String, HostError> {
        let share = (self.inner.manifest.limits.payload_bytes as usize / (children.len() + 1)).max(1024);
        let mut runs = Vec::with_capacity(children.len());
        for c in children {
            let first = c.ended() && self.state().agents_told.insert(c.run_id);
            if first {
                let payload = json!({ "call_index": ordinal, "run_id": c.run_id, "plugin": c.plugin,
                                      "status": c.status, "error": c.error });
                self.append(AGENT_FINISHED, payload, false).await?;
            }
            let mut view = json!({ "run_id": c.run_id, "plugin": c.plugin, "conversation_id": c.conversation_id,
                                   "status": c.status, "output": c.output, "error": c.error });
            if let Some(out) = c.output.as_deref().filter(|o| o.len() > share) {
                let cut = (0..=share).rev().find(|i| out.is_char_boundary(*i)).unwrap_or(0);
                view["output"] = json!(&out[..cut]);
                view["truncated"] = json!(true);
            }
            runs.push(view);
        }
        Ok(json!({ "mode": args["mode"], "runs": runs }).to_string())
    }

    /// Whether a call of `name` waits, and for what: the durable wait until
    /// its time, or a person's approval (the manifest, the run's config or the
    /// operator's tools file says so) until the approval timeout.
    fn suspends(&self, name: &str, args: &Value) -> Result<Option<(SuspendKind, Duration)>, HostError> {
        if name == AWAIT_AGENTS {
            return Ok(Some((SuspendKind::Children, AWAIT_AGENTS_MAX)));
        }
        if name == WAIT_TOOL {
            return wait_for(args).map(|d| Some((SuspendKind::Wait, d)));
        }
        let needs = self.inner.manifest.needs_approval(name)
            || self.inner.require_approval.iter().any(|t| t == name)
            || self.inner.tools.get(name).is_some_and(|t| t.requires_approval());
        let timeout = Duration::from_millis(self.inner.manifest.limits.approval_timeout_ms);
        Ok(needs.then_some((SuspendKind::Approval, timeout)))
    }

    /// Suspends the run at a recorded call: what was journaled lands, the
    /// journal closes, and the run goes running -> waiting with its event
    /// (fenced); the agent is then dropped (its imports refuse meanwhile)
    /// and the worker's slot released. The run resumes by replay once the
    /// decision (or the time) comes.
    async fn suspend(
        &self,
        position: i32,
        ordinal: u64,
        name: &str,
        args: &Value,
        (kind, wait): (SuspendKind, Duration),
    ) -> Result<String, HostError> {
        let rec = self.inner.recording.as_ref().expect("a suspension needs a recording");
        let journal = self.inner.journal.lock().await.take();
        if let Some(journal) = journal {
            journal.close().await?;
        }
        let s = Suspend { call_index: ordinal as i32, position, kind, tool: name, args, for_secs: wait.as_secs_f64() };
        self.state().suspending = true;
        // Fires when this returns, or is dropped, after `suspended` is set.
        let _settled = self.inner.suspension_settled.clone().drop_guard();
        rec.suspend(&s).await?;
        tracing::info!(run_id = %self.inner.run_id, call_index = ordinal, tool = name, ?kind, "run suspended: waiting");
        self.state().suspended = true;
        self.inner.abort.cancel();
        Err(HostError::Fenced)
    }

    /// Whether the run was suspended (it waits; the worker lets it go).
    pub fn suspended(&self) -> bool {
        self.state().suspended
    }

    /// Resolves at once unless a suspension's write was sent; then when it
    /// has returned. The suspension clears the run's claim, so a heartbeat
    /// may find the claim gone before the run task sees the suspension:
    /// the task waits for this before it takes the claim for lost.
    pub async fn suspension_settled(&self) {
        let suspending = self.state().suspending;
        if suspending {
            self.inner.suspension_settled.cancelled().await
        }
    }

    /// A recorded call answered again: its journaled text is the partial
    /// answer's again, its usage counted again, its appends skipped.
    fn replay_answer(&self, call: &crate::db::calls::Call, name: &str) -> Result<String, HostError> {
        let rec = self.inner.recording.as_ref().expect("replay needs a recording");
        let after = call.ops_after.unwrap_or(call.ops_before);
        self.keep_streamed(&rec.journaled_text(call.ops_before, after));
        self.state().ops = after;
        let answer = record::recorded_answer(call);
        if let (Ok(text), LLM_TOOL) = (&answer, name) {
            if let Ok(value) = serde_json::from_str::<Value>(text) {
                self.add_usage(crate::tools::llm_tokens(&value));
            }
        }
        if let (Ok(text), AWAIT_AGENTS) = (&answer, name) {
            let told = serde_json::from_str::<Value>(text).ok().and_then(|v| v["runs"].as_array().cloned());
            let mut s = self.state();
            for c in told.unwrap_or_default() {
                let ended = c["status"].as_str().and_then(|st| st.parse::<crate::db::RunStatus>().ok());
                if let (Some(run), Some(true)) =
                    (c["run_id"].as_str().and_then(|r| r.parse().ok()), ended.map(|st| st.is_terminal()))
                {
                    s.agents_told.insert(run);
                }
            }
        }
        let text = answer?;
        self.check_payload_size("tool answer", "exceeds", text.len())?;
        Ok(text)
    }

    /// A call in flight when the run's worker was lost. An idempotent tool
    /// is called again (same ordinal, so a webhook gets the same
    /// Idempotency-Key); clients are told to drop the text it had streamed
    /// (`content_rollback`), and its new appends follow what was journaled.
    /// Any other tool is not called twice: the run ends failed.
    async fn reissue(&self, call: &crate::db::calls::Call, name: &str, ordinal: u64) -> Result<(), HostError> {
        let rec = self.inner.recording.as_ref().expect("re-issue needs a recording");
        // A child's start finds the child it started before.
        let idempotent =
            name.starts_with(AGENT_TOOL_PREFIX) || self.inner.tools.get(name).is_some_and(|t| t.idempotent());
        if !idempotent {
            let message = format!(
                "call {} (tool call {ordinal}, {name:?}) was in flight when the run's worker was lost; \
                 its outcome is unknown and the tool is not idempotent, so it is not called again",
                call.position
            );
            return Err(self.abort(FailReason::UnknownOutcome, message));
        }
        // Ours alone from here: a stale process resuming too is fenced out.
        rec.retake(call.position).await?;
        let journaled = rec.journaled_op();
        let cut = rec.journaled_text(call.ops_before, journaled);
        {
            let mut s = self.state();
            s.ops = s.ops.max(journaled);
        }
        if !cut.is_empty() {
            let keep_chars = rec.journaled_text(0, call.ops_before).chars().count();
            let payload = json!({ "keep_chars": keep_chars, "call_index": ordinal, "reason": "resumed" });
            self.append_unnumbered(CONTENT_ROLLBACK, payload).await?;
        }
        tracing::info!(run_id = %self.inner.run_id, position = call.position, tool = name, "re-issuing a call whose outcome is unknown");
        Ok(())
    }

    /// Adds one model call's tokens to the run's usage.
    pub fn add_usage(&self, used: crate::tools::CallUsage) {
        let mut s = self.state();
        s.usage.model_calls += 1;
        s.usage.prompt_tokens += used.prompt_tokens;
        s.usage.completion_tokens += used.completion_tokens;
        s.usage.cached_tokens += used.cached_tokens;
        s.usage.cost_usd += used.cost_usd;
    }

    /// The run's model usage so far; `None` if it made no model call.
    pub fn usage(&self) -> Option<Usage> {
        let u = self.state().usage;
        (u.model_calls > 0).then_some(u)
    }

    /// Whether a stop was requested for this run (live, not recorded).
    pub fn stop_requested(&self) -> bool {
        self.inner.cancel.is_cancelled()
    }

    /// `check-cancel` as an agent calls it: whether a stop was requested. A
    /// resumable run records the answer (and a resumed one replays it).
    pub fn check_cancel(&self) -> bool {
        let Some(rec) = &self.inner.recording else {
            return self.stop_requested();
        };
        // A run that must end (its gate refuses) is told to stop.
        let read = self.read(rec, record::CHECK_CANCEL, || self.stop_requested().to_string());
        read.map_or(true, |answer| answer == "true")
    }

    /// A WASI wall-clock reading (time since the Unix epoch): recorded for a
    /// resumable run, replayed on a resumed one.
    pub fn wall_clock(&self, live: Duration) -> Duration {
        let Some(rec) = &self.inner.recording else {
            return live;
        };
        let read = self.read(rec, record::WALL_CLOCK, || live.as_nanos().to_string());
        read.ok().and_then(|ns| ns.parse::<u64>().ok()).map_or(live, Duration::from_nanos)
    }

    /// A WASI monotonic-clock reading in nanoseconds: recorded, replayed, and
    /// continuing from the replayed value once live.
    pub fn monotonic_clock(&self, live_ns: u64) -> u64 {
        let Some(rec) = &self.inner.recording else {
            return live_ns;
        };
        let read = self.read(rec, record::MONOTONIC_CLOCK, || rec.monotonic_live(live_ns).to_string());
        read.map_or(live_ns, |ns| rec.monotonic_seen(ns.parse::<u64>().unwrap_or(0)))
    }

    /// A reading's gate, the first of the three steps every recorded import
    /// takes (as a call-tool's [`gate`](Self::gate)): once the run must end,
    /// check-cancel and list-tools are refused. The WASI clocks cannot be
    /// refused: a reading of a run that must end is answered as any other.
    /// The host-call budget of a guest's import is counted before, at the
    /// WIT edge (`sandbox::imports`), for readings and call-tool alike (the
    /// clocks are not host calls); a reading takes no ordinal, only the
    /// log's position its plan takes.
    fn gate_reading(&self, import: &str) -> Result<(), HostError> {
        match import {
            record::WALL_CLOCK | record::MONOTONIC_CLOCK => Ok(()),
            _ => self.ended(),
        }
    }

    /// A gated reading's plan from the log ([`Recording::next_reading`], one
    /// flat answer): the recorded answer, or a live reading at its position
    /// (with the journal appends before it). A reading past the
    /// recorded-calls limit, or not the one recorded, is refused, and the run
    /// will end failed with it (a limit, a divergence).
    fn plan_reading(&self, rec: &Recording, import: &'static str) -> Result<Planned, HostError> {
        self.gate_reading(import)?;
        let ops = self.state().ops;
        match rec.next_reading(import, ops) {
            NextReading::Answer(text) => Ok(Planned::Answer(text)),
            NextReading::Live(position) => Ok(Planned::Live(position, ops)),
            NextReading::Refused(m) => Err(self.limit(m)),
            NextReading::Diverged(d) => Err(self.diverged(d)),
        }
    }

    /// A recorded reading made synchronously: gate and plan, then the
    /// invocation, `live()` when the plan says so, its answer buffered for
    /// the next durable write. `Err` when the gate or the plan refused (the
    /// run must end; a live value serves meanwhile).
    fn read(&self, rec: &Recording, import: &'static str, live: impl FnOnce() -> String) -> Result<String, HostError> {
        Ok(match self.plan_reading(rec, import)? {
            Planned::Answer(text) => text,
            Planned::Live(at, ops) => rec.record_reading(at, import, ops, live()),
        })
    }

    /// The seed of the guest's random generators for a resumable run (the
    /// same on every attempt); `None`: the host's own randomness.
    pub fn random_seed(&self) -> Option<[u8; 32]> {
        self.inner.recording.as_ref().map(|r| r.seed())
    }

    /// Resolves once a stop is requested: host work in flight for the run
    /// (a model stream, a webhook call) selects on it and aborts.
    pub async fn cancelled(&self) {
        self.inner.cancel.cancelled().await
    }

    /// Resolves if the journal gives up (the database was gone too long):
    /// the run can no longer be narrated and must end.
    pub async fn journal_gave_up(&self) {
        self.inner.journal_gave_up.cancelled().await
    }

    /// Flushes and closes the journal (every clone then refuses with
    /// `fenced`): the terminal write comes next. Returns the streamed text.
    pub async fn close(&self) -> (String, Result<(), HostError>) {
        let journal = self.inner.journal.lock().await.take();
        let r = match journal {
            Some(j) => j.close().await,
            None => Ok(()),
        };
        (std::mem::take(&mut self.state().streamed), r)
    }
}

/// Tools stream into the run through its host: deltas are refused after a
/// stop (so a model stream ends as soon as the run is cancelled) but are not
/// counted as the agent's events; host events are neither refused nor
/// counted, so a call cut off by a stop is still journaled.
#[async_trait]
impl EventSink for RunHost {
    async fn delta(&self, text: &str) -> Result<(), HostError> {
        if self.stop_requested() {
            return Err(HostError::Cancelled);
        }
        self.append(CONTENT_DELTA, json!({ "delta": text }), false).await
    }

    async fn event(&self, kind: &str, payload: Value) -> Result<(), HostError> {
        self.append(kind, payload, false).await
    }

    fn usage(&self, used: crate::tools::CallUsage) {
        self.add_usage(used)
    }
}
