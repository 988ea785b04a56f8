//! The agent interface: what a claimed run executes. The sandbox implements it
//! for WebAssembly components; until then (and for tests) built-in agents do.
//!
//! An agent sees only [`RunHost`], whose imports mirror the WIT host interface:
//! `emit_event`, `check_cancel`. Every import is fenced: once the claim is lost,
//! they refuse with [`HostError::Fenced`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::db::{ConversationId, RunId};
pub use crate::run::error::{AgentError, FailReason, HostError};
use crate::db::events::CONTENT_DELTA as DELTA_KIND;
use crate::journal::Journal;

use crate::db::events::RESERVED as RESERVED_KINDS;
/// Bytes of one event payload (the per-call payload limit's default).
pub const EVENT_PAYLOAD_BYTES_MAX: usize = 1 << 20;
/// Length of an event kind.
pub const EVENT_KIND_BYTES_MAX: usize = 64;

/// One turn's input.
#[derive(Debug, Clone)]
pub struct RunInput {
    pub run_id: RunId,
    pub conversation_id: ConversationId,
    pub content: String,
    pub config: Value,
}

#[async_trait]
pub trait Agent: Send + Sync + 'static {
    /// Runs one turn and returns the final assistant text.
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError>;
}

/// The host side of one run: the imports an agent may call. Cheap to clone
/// (a sandboxed guest's store holds a clone); the run task keeps the original
/// and closes the journal after the agent, however the agent ended.
#[derive(Clone)]
pub struct RunHost {
    run_id: RunId,
    /// Fired when a stop is requested (the NOTIFY or the heartbeat saw the flag).
    cancel: CancellationToken,
    inner: Arc<tokio::sync::Mutex<HostInner>>,
    usage: Arc<std::sync::Mutex<Usage>>,
}

/// Model tokens a run used, over all its model calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    pub model_calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

struct HostInner {
    journal: Option<Journal>,
    /// Text streamed so far as `content_delta`: kept as the partial answer if
    /// the turn is cut off.
    streamed: String,
}

impl RunHost {
    pub(crate) fn new(run_id: RunId, journal: Journal, cancel: CancellationToken) -> Self {
        let inner = HostInner { journal: Some(journal), streamed: String::new() };
        RunHost { run_id, cancel, inner: Arc::new(tokio::sync::Mutex::new(inner)), usage: Default::default() }
    }

    pub fn run_id(&self) -> RunId {
        self.run_id
    }

    /// Appends one event to the run's journal (fenced): `content_delta` with a
    /// string `delta` is buffered and merged; anything else is written through.
    pub async fn emit_event(&self, kind: &str, payload: Value) -> Result<(), HostError> {
        if kind.is_empty() || kind.len() > EVENT_KIND_BYTES_MAX {
            return Err(HostError::Invalid(format!("event kind must be 1-{EVENT_KIND_BYTES_MAX} bytes")));
        }
        if RESERVED_KINDS.contains(&kind) {
            return Err(HostError::Invalid(format!("event kind {kind:?} is reserved for the host")));
        }
        if !payload.is_object() {
            return Err(HostError::Invalid("event payload must be a JSON object".into()));
        }
        let size = payload.to_string().len();
        if size > EVENT_PAYLOAD_BYTES_MAX {
            return Err(HostError::Limit(format!("event payload of {size} bytes exceeds {EVENT_PAYLOAD_BYTES_MAX}")));
        }
        if self.check_cancel() {
            return Err(HostError::Cancelled);
        }
        self.append(kind, payload).await
    }

    /// Appends an event the host itself writes (a reserved kind such as
    /// `tool_call_finished`): no reserved-kind check and no cancel check, so a
    /// tool call cut off by a stop is still journaled; fenced like the rest.
    pub(crate) async fn emit_host_event(&self, kind: &str, payload: Value) -> Result<(), HostError> {
        self.append(kind, payload).await
    }

    async fn append(&self, kind: &str, payload: Value) -> Result<(), HostError> {
        let mut inner = self.inner.lock().await;
        let inner = &mut *inner;
        let journal = inner.journal.as_mut().ok_or(HostError::Fenced)?;
        match payload.get("delta").and_then(Value::as_str) {
            Some(delta) if kind == DELTA_KIND => {
                inner.streamed.push_str(delta);
                journal.delta(payload).await
            }
            _ => journal.event(kind, payload).await,
        }
    }

    /// Streams a piece of the answer (`content_delta`).
    pub async fn emit_delta(&self, delta: &str) -> Result<(), HostError> {
        self.emit_event(DELTA_KIND, json!({ "delta": delta })).await
    }

    /// Adds one model call's tokens to the run's usage.
    pub fn add_usage(&self, prompt_tokens: u64, completion_tokens: u64) {
        let mut u = self.usage.lock().unwrap();
        u.model_calls += 1;
        u.prompt_tokens += prompt_tokens;
        u.completion_tokens += completion_tokens;
    }

    /// The run's model usage so far; `None` if it made no model call.
    pub fn usage(&self) -> Option<Usage> {
        let u = *self.usage.lock().unwrap();
        (u.model_calls > 0).then_some(u)
    }

    /// Whether a stop was requested for this run.
    pub fn check_cancel(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Resolves once a stop is requested: host work in flight for the run
    /// (a model stream, a webhook call) selects on it and aborts.
    pub async fn cancelled(&self) {
        self.cancel.cancelled().await
    }

    /// Flushes and closes the journal (every clone then refuses with
    /// `fenced`): the terminal write comes next. Returns the streamed text.
    pub(crate) async fn close(&self) -> (String, Result<(), HostError>) {
        let mut inner = self.inner.lock().await;
        let r = match inner.journal.take() {
            Some(j) => j.close().await,
            None => Ok(()),
        };
        (std::mem::take(&mut inner.streamed), r)
    }
}

/// Agents by plugin name: built-in agents, and the sandbox that runs
/// registered WebAssembly plugins by digest.
#[derive(Clone, Default)]
pub struct AgentRegistry {
    agents: HashMap<String, Arc<dyn Agent>>,
    sandbox: Option<Arc<crate::sandbox::Sandbox>>,
}

impl AgentRegistry {
    /// The built-in agents: `noop`, `echo` and `sleep`.
    pub fn with_builtins() -> Self {
        let mut r = AgentRegistry::default();
        r.insert("noop", Arc::new(Noop));
        r.insert("echo", Arc::new(Echo));
        r.insert("sleep", Arc::new(Sleep));
        r
    }

    /// Runs registered WebAssembly plugins with `sandbox`.
    pub fn with_sandbox(mut self, sandbox: Arc<crate::sandbox::Sandbox>) -> Self {
        self.sandbox = Some(sandbox);
        self
    }

    pub fn sandbox(&self) -> Option<&Arc<crate::sandbox::Sandbox>> {
        self.sandbox.as_ref()
    }

    pub fn insert(&mut self, name: &str, agent: Arc<dyn Agent>) {
        self.agents.insert(name.to_string(), agent);
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn Agent>> {
        self.agents.get(name).cloned()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.agents.contains_key(name)
    }

    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.agents.keys().cloned().collect();
        names.sort();
        names
    }
}

/// Returns at once with an empty answer: the queue's own cost, nothing else.
pub struct Noop;

#[async_trait]
impl Agent for Noop {
    async fn run(&self, _host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        Ok(String::new())
    }
}

/// Streams the user's message back word by word, then returns it.
pub struct Echo;

#[async_trait]
impl Agent for Echo {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        for word in input.content.split_inclusive(' ') {
            host.emit_delta(word).await?;
        }
        Ok(input.content)
    }
}

/// A long turn for demos and tests: `config.steps` deltas (default 10), one
/// every `config.step_ms` (default 100), stopping at once when cancelled.
pub struct Sleep;

#[async_trait]
impl Agent for Sleep {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        let steps = input.config.get("steps").and_then(Value::as_u64).unwrap_or(10).min(100_000);
        let step_ms = input.config.get("step_ms").and_then(Value::as_u64).unwrap_or(100).min(3_600_000);
        let mut text = String::new();
        for i in 0..steps {
            tokio::select! {
                _ = host.cancelled() => return Err(HostError::Cancelled.into()),
                _ = tokio::time::sleep(Duration::from_millis(step_ms)) => {}
            }
            let piece = format!("step {i}. ");
            host.emit_delta(&piece).await?;
            text.push_str(&piece);
        }
        Ok(text)
    }
}
