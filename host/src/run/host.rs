//! The host side of one run: every import a run can make (emit an event,
//! call a tool, check for a stop), with the plugin's grants and limits, the
//! tool-call ordinal, journaling and model usage. Built-in agents call it
//! directly; a Wasm guest's imports are translated to it by the sandbox, so
//! both get the same checks, refusals and journal.
//!
//! Every import is fenced: once the claim is lost, they refuse with
//! [`HostError::Fenced`]. A limit refusal is also recorded as the run's
//! failure ([`RunHost::limit_failure`]): the run ends failed with reason
//! `limit` whatever the agent does next.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::db::events::{CONTENT_DELTA, RESERVED};
use crate::db::RunId;
use crate::error::HostError;
use crate::run::journal::Journal;
use crate::run::manifest::Manifest;
use crate::tools::{EventSink, ToolCall, ToolRegistry};

/// Length of an event kind.
pub const EVENT_KIND_BYTES_MAX: usize = 64;
/// Bytes of streamed text a run keeps as its partial answer (the journal has
/// all of it); past this the partial answer is cut.
pub const STREAMED_BYTES_MAX: usize = 1 << 20;

/// Model tokens a run used, over all its model calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    pub model_calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
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
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Text streamed so far as `content_delta`, up to [`STREAMED_BYTES_MAX`]:
    /// kept as the partial answer if the turn is cut off.
    streamed: String,
    /// Events the agent emitted (host-written ones are not counted).
    events: u64,
    /// Tool calls made: the next call's ordinal is this plus one.
    tool_calls: u64,
    usage: Usage,
    /// The limit the run hit, if any: it ends failed with it.
    limit_hit: Option<String>,
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
        self.state().limit_hit.get_or_insert_with(|| reason.clone());
        HostError::Limit(reason)
    }

    /// The limit this run hit, if any (the run must end failed with it).
    pub fn limit_failure(&self) -> Option<String> {
        self.state().limit_hit.clone()
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
        self.check_payload_size("event payload", "exceeds", crate::run::text::json_bytes(&payload))?;
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
        if self.check_cancel() {
            return Err(HostError::Cancelled);
        }
        self.append(kind, payload).await
    }

    /// Streams a piece of the answer (`content_delta`).
    pub async fn emit_delta(&self, delta: &str) -> Result<(), HostError> {
        self.emit_event(CONTENT_DELTA, json!({ "delta": delta })).await
    }

    async fn append(&self, kind: &str, payload: Value) -> Result<(), HostError> {
        let mut journal = self.inner.journal.lock().await;
        let journal = journal.as_mut().ok_or(HostError::Fenced)?;
        match payload.get("delta").and_then(Value::as_str) {
            Some(delta) if kind == CONTENT_DELTA => {
                self.keep_streamed(delta);
                journal.delta(payload).await
            }
            _ => journal.event(kind, payload).await,
        }
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
        if self.check_cancel() {
            return Err(HostError::Cancelled);
        }
        self.check_payload_size("tool arguments", "exceed", args.len())?;
        let limits = &self.inner.manifest.limits;
        if !self.inner.manifest.grants(name) {
            return Err(HostError::Denied(format!("tool {name:?} is not granted to this plugin")));
        }
        let ordinal = {
            let mut s = self.state();
            s.tool_calls += 1;
            s.tool_calls
        };
        if ordinal > limits.tool_calls_max {
            return Err(self.limit(format!("more than {} tool calls", limits.tool_calls_max)));
        }
        let args: Value =
            serde_json::from_str(args).map_err(|e| HostError::Invalid(format!("tool arguments are not JSON: {e}")))?;
        // With the run id, the ordinal is the webhook's Idempotency-Key:
        // 1-based, never repeated within a run.
        let call = ToolCall {
            run_id: self.run_id(),
            call_index: ordinal as u32,
            name,
            args,
            timeout_max: Some(Duration::from_millis(limits.tool_timeout_ms)),
        };
        let text = self.inner.tools.invoke(call, self, self.cancelled()).await?;
        self.check_payload_size("tool answer", "exceeds", text.len())?;
        Ok(text)
    }

    /// Adds one model call's tokens to the run's usage.
    pub fn add_usage(&self, prompt_tokens: u64, completion_tokens: u64) {
        let mut s = self.state();
        s.usage.model_calls += 1;
        s.usage.prompt_tokens += prompt_tokens;
        s.usage.completion_tokens += completion_tokens;
    }

    /// The run's model usage so far; `None` if it made no model call.
    pub fn usage(&self) -> Option<Usage> {
        let u = self.state().usage;
        (u.model_calls > 0).then_some(u)
    }

    /// Whether a stop was requested for this run.
    pub fn check_cancel(&self) -> bool {
        self.inner.cancel.is_cancelled()
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
        if self.check_cancel() {
            return Err(HostError::Cancelled);
        }
        self.append(CONTENT_DELTA, json!({ "delta": text })).await
    }

    async fn event(&self, kind: &str, payload: Value) -> Result<(), HostError> {
        self.append(kind, payload).await
    }

    fn usage(&self, prompt_tokens: u64, completion_tokens: u64) {
        self.add_usage(prompt_tokens, completion_tokens)
    }
}
