//! OpenTelemetry traces of runs, exported over OTLP (HTTP/protobuf) when the
//! operator names an endpoint (`serve --otlp-endpoint`); off by default, and
//! then every hook here is a check of one `OnceLock`.
//!
//! One trace per run. Its id and the id of the run's root span are stored
//! with the run (`migrations/0022_traces.sql`) and come back with every claim,
//! so the processes that claim a run in turn (after a crash, an approval
//! wait, a drain) all add to the same trace:
//!
//! ```text
//! run {plugin}                      the whole run, written by the process that ends it
//! ├── claim                         each claim: from the claim to the agent's start
//! ├── invoke_agent {plugin}         each claimed segment of the turn (GenAI)
//! │   ├── chat {model}              each model call (`llm`), GenAI attributes
//! │   └── execute_tool {tool}       each other tool call
//! └── ...                           the next claim's segment, maybe on another process
//! ```
//!
//! Spans are built here whole (ids, times, attributes) rather than through
//! an SDK tracer: the root span's id is the stored one, and it is written
//! once, when the run ends, by whichever process ends it. A call a resumed
//! run answers from its call log makes no span (it was made, and traced, by
//! the attempt that made it). A process killed mid-segment loses the spans
//! it had not ended (its segment among them); those it ended and exported
//! keep their place in the trace.
//!
//! Spans leave through a bounded queue to one background task that exports
//! them in batches; a full queue drops spans and a failed export is logged
//! and counted (`/metrics`), never a failure of a run.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState};
use opentelemetry::{Array, InstrumentationScope, KeyValue, StringValue, Value as OtelValue};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::db::lifecycle::ClaimedRun;
use crate::error::HostError;
use crate::tools::{CallUsage, EventSink, LLM_TOOL};

/// Ended spans waiting for export at most; past it new spans are dropped (counted).
pub const QUEUE_MAX: usize = 4096;
/// Spans in one export request at most.
pub const BATCH_MAX: usize = 512;
/// How long an ended span waits at most before its batch is sent.
pub const EXPORT_EVERY: Duration = Duration::from_secs(1);
/// One export request's bound (the collector slow or away).
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the shutdown waits for the last batches.
pub const SHUTDOWN_MAX: Duration = Duration::from_secs(5);
/// Bytes of one content attribute (prompt, completion, tool arguments or
/// result) at most; past it the text is cut with a marker.
pub const CONTENT_BYTES_MAX: usize = 64 * 1024;
/// The path OTLP/HTTP receivers take traces at, added to an endpoint that
/// does not end with it.
pub const TRACES_PATH: &str = "/v1/traces";

/// What `serve` turns on.
#[derive(Debug, Clone)]
pub struct TraceConfig {
    /// The OTLP/HTTP traces URL (with [`TRACES_PATH`]).
    pub endpoint: String,
    /// Put prompts, completions, tool arguments and answers on the spans.
    pub content: bool,
    /// The resource's `service.name`.
    pub service_name: String,
}

/// The traces URL for an endpoint given as a base (`http://collector:4318`)
/// or whole (`.../v1/traces`); an error names what is wrong with it.
pub fn traces_url(endpoint: &str) -> Result<String, String> {
    let url = url::Url::parse(endpoint).map_err(|e| format!("{endpoint:?} is not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{endpoint:?} must be an http:// or https:// URL with a host"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(format!("{endpoint:?} must have no query or fragment"));
    }
    let base = endpoint.trim_end_matches('/');
    Ok(match base.ends_with(TRACES_PATH) {
        true => base.to_string(),
        false => format!("{base}{TRACES_PATH}"),
    })
}

/// Counts for `/metrics`.
#[derive(Debug, Default)]
pub struct TraceStats {
    pub exported: AtomicU64,
    pub dropped: AtomicU64,
    pub export_failures: AtomicU64,
}

/// The process's exporter, once `serve` installs one.
struct Tracer {
    queue: mpsc::Sender<SpanData>,
    content: bool,
    stats: Arc<TraceStats>,
    scope: InstrumentationScope,
    stop: CancellationToken,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

static TRACER: OnceLock<Tracer> = OnceLock::new();

/// Builds the OTLP exporter and starts the export task (once per process;
/// a second call is refused). Needs a Tokio runtime.
pub fn install(config: &TraceConfig) -> anyhow::Result<()> {
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    // The exporter's reqwest (0.13, the MCP client's) takes the process's
    // rustls provider: ring, as everywhere in the host.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(config.endpoint.clone())
        .with_timeout(EXPORT_TIMEOUT)
        .build()?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(config.service_name.clone())
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    exporter.set_resource(&resource);
    let (queue, rx) = mpsc::channel(QUEUE_MAX);
    let stats = Arc::new(TraceStats::default());
    let stop = CancellationToken::new();
    let task = tokio::spawn(export_loop(exporter, rx, stop.clone(), stats.clone()));
    let tracer = Tracer {
        queue,
        content: config.content,
        stats,
        scope: InstrumentationScope::builder("agent-host").with_version(env!("CARGO_PKG_VERSION")).build(),
        stop,
        task: Mutex::new(Some(task)),
    };
    TRACER.set(tracer).map_err(|_| anyhow::anyhow!("traces are already installed in this process"))?;
    tracing::info!(endpoint = %config.endpoint, content = config.content, "exporting traces over OTLP");
    Ok(())
}

/// Sends what is queued and stops the export task (at most [`SHUTDOWN_MAX`]).
pub async fn shutdown() {
    let Some(t) = TRACER.get() else { return };
    t.stop.cancel();
    let task = t.task.lock().unwrap().take();
    if let Some(task) = task {
        if tokio::time::timeout(SHUTDOWN_MAX, task).await.is_err() {
            tracing::warn!("the last spans were not exported within {SHUTDOWN_MAX:?}");
        }
    }
}

/// The export counters, when traces are on.
pub fn stats() -> Option<Arc<TraceStats>> {
    TRACER.get().map(|t| t.stats.clone())
}

/// The trace counters for `/metrics` (nothing when traces are off).
pub fn metrics(e: &mut crate::metrics::Exposition) {
    let Some(s) = stats() else { return };
    e.counter("agent_host_trace_spans_exported_total", "Spans exported over OTLP.", s.exported.load(Ordering::Relaxed));
    e.counter(
        "agent_host_trace_spans_dropped_total",
        "Spans dropped: the export queue was full or their export failed.",
        s.dropped.load(Ordering::Relaxed),
    );
    e.counter(
        "agent_host_trace_export_failures_total",
        "OTLP export requests that failed (logged; runs are unaffected).",
        s.export_failures.load(Ordering::Relaxed),
    );
}

async fn export_loop(
    exporter: opentelemetry_otlp::SpanExporter,
    mut rx: mpsc::Receiver<SpanData>,
    stop: CancellationToken,
    stats: Arc<TraceStats>,
) {
    let mut batch = Vec::with_capacity(BATCH_MAX);
    let mut tick = tokio::time::interval(EXPORT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => {
                while let Ok(span) = rx.try_recv() {
                    batch.push(span);
                    if batch.len() == BATCH_MAX {
                        export(&exporter, &mut batch, &stats).await;
                    }
                }
                export(&exporter, &mut batch, &stats).await;
                return;
            }
            span = rx.recv() => match span {
                Some(span) => {
                    batch.push(span);
                    if batch.len() == BATCH_MAX {
                        export(&exporter, &mut batch, &stats).await;
                    }
                }
                None => {
                    export(&exporter, &mut batch, &stats).await;
                    return;
                }
            },
            _ = tick.tick() => export(&exporter, &mut batch, &stats).await,
        }
    }
}

async fn export(exporter: &opentelemetry_otlp::SpanExporter, batch: &mut Vec<SpanData>, stats: &TraceStats) {
    if batch.is_empty() {
        return;
    }
    let spans = std::mem::replace(batch, Vec::with_capacity(BATCH_MAX));
    let n = spans.len() as u64;
    let failed = match tokio::time::timeout(EXPORT_TIMEOUT, exporter.export(spans)).await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some(format!("no answer within {EXPORT_TIMEOUT:?}")),
    };
    match failed {
        None => {
            stats.exported.fetch_add(n, Ordering::Relaxed);
        }
        Some(why) => {
            stats.export_failures.fetch_add(1, Ordering::Relaxed);
            stats.dropped.fetch_add(n, Ordering::Relaxed);
            tracing::warn!(spans = n, error = %why, "exporting spans over OTLP failed; they are dropped");
        }
    }
}

tokio::task_local! {
    /// The claimed run whose task this is (see [`RunTrace::scope`]).
    static RUN: RunTrace;
}

/// One claim of a run, as traced: cheap to clone; empty when traces are off.
#[derive(Clone, Default)]
pub struct RunTrace(Option<Arc<Claimed>>);

struct Claimed {
    tracer: &'static Tracer,
    trace_id: TraceId,
    root: SpanId,
    segment: SpanId,
    /// On every span: the run, its conversation, its tenant.
    common: Vec<KeyValue>,
    plugin: String,
    worker_id: String,
    attempt: i32,
    /// The run's enqueue (by the database's clock, as far as the claim said).
    created: SystemTime,
    claimed: SystemTime,
    /// The claim span is written once: when the agent starts, or with the segment.
    claim_written: AtomicBool,
}

impl RunTrace {
    /// The trace of a run just claimed by `worker_id`.
    pub fn claimed(row: &ClaimedRun, worker_id: &str) -> RunTrace {
        let Some(tracer) = TRACER.get() else { return RunTrace(None) };
        let run = row.id.0;
        // A run from before the stored trace derives one from its id, the
        // same in every process.
        let trace_id = TraceId::from_bytes(*row.trace_id.unwrap_or(run).as_bytes());
        let root = match row.trace_span_id.filter(|s| *s != 0) {
            Some(s) => SpanId::from_bytes(s.to_be_bytes()),
            None => SpanId::from_bytes(run.as_bytes()[8..].try_into().expect("8 bytes")),
        };
        let now = SystemTime::now();
        let common = vec![
            KeyValue::new("agent_host.run_id", run.to_string()),
            KeyValue::new("gen_ai.conversation.id", row.conversation_id.0.to_string()),
            KeyValue::new("agent_host.tenant", row.tenant_id.clone()),
        ];
        RunTrace(Some(Arc::new(Claimed {
            tracer,
            trace_id,
            root,
            segment: span_id(),
            common,
            plugin: row.plugin.clone(),
            worker_id: worker_id.to_string(),
            attempt: row.attempt,
            created: now.checked_sub(Duration::from_secs_f64(row.waited_s.max(0.0))).unwrap_or(now),
            claimed: now,
            claim_written: AtomicBool::new(false),
        })))
    }
}

/// A run's task with its trace in scope: the hooks below find it there.
pub trait WithRunTrace: std::future::Future + Sized {
    fn with_run_trace(self, trace: RunTrace) -> tokio::task::futures::TaskLocalFuture<RunTrace, Self> {
        RUN.scope(trace, self)
    }
}

impl<F: std::future::Future> WithRunTrace for F {}

/// The run in scope, if it is traced.
fn current() -> Option<Arc<Claimed>> {
    RUN.try_with(|t| t.0.clone()).ok().flatten()
}

impl Claimed {
    fn span(&self, name: impl Into<Cow<'static, str>>, kind: SpanKind, parent: SpanId, id: SpanId) -> Span<'_> {
        Span {
            claimed: self,
            name: name.into(),
            kind,
            parent,
            id,
            start: SystemTime::now(),
            attributes: self.common.clone(),
        }
    }

    fn claim_span(&self, end: SystemTime) {
        if self.claim_written.swap(true, Ordering::Relaxed) {
            return;
        }
        let mut span = self.span("claim", SpanKind::Internal, self.root, span_id());
        span.start = self.claimed;
        span.attributes.extend([
            KeyValue::new("agent_host.worker_id", self.worker_id.clone()),
            KeyValue::new("agent_host.attempt", i64::from(self.attempt)),
        ]);
        span.end_at(end, Status::Unset);
    }
}

/// A span being built; sent when ended.
struct Span<'a> {
    claimed: &'a Claimed,
    name: Cow<'static, str>,
    kind: SpanKind,
    parent: SpanId,
    id: SpanId,
    start: SystemTime,
    attributes: Vec<KeyValue>,
}

impl Span<'_> {
    fn end_at(self, end: SystemTime, status: Status) {
        let tracer = self.claimed.tracer;
        let data = SpanData {
            span_context: SpanContext::new(
                self.claimed.trace_id,
                self.id,
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            parent_span_id: self.parent,
            parent_span_is_remote: false,
            span_kind: self.kind,
            name: self.name,
            start_time: self.start,
            end_time: end.max(self.start),
            attributes: self.attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status,
            instrumentation_scope: tracer.scope.clone(),
        };
        if tracer.queue.try_send(data).is_err() {
            tracer.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A fresh span id (never the invalid all-zero one).
fn span_id() -> SpanId {
    loop {
        let id: [u8; 8] = rand::random();
        if id != [0; 8] {
            return SpanId::from_bytes(id);
        }
    }
}

/// `s` cut to [`CONTENT_BYTES_MAX`] on a character boundary, marked when cut.
fn content(s: &str) -> String {
    crate::text::cut(s, CONTENT_BYTES_MAX).into_owned()
}

/// The claimed run's agent starts: the claim span ends.
pub fn agent_started() {
    if let Some(c) = current() {
        c.claim_span(SystemTime::now());
    }
}

/// The claimed segment ended (`outcome`: how the run task ended, e.g.
/// `finalized`, `suspended`, `lost`, `handed_back`): its `invoke_agent` span.
pub fn segment_ended(outcome: &str) {
    let Some(c) = current() else { return };
    let now = SystemTime::now();
    c.claim_span(now);
    let mut span = c.span(format!("invoke_agent {}", c.plugin), SpanKind::Internal, c.root, c.segment);
    span.start = c.claimed;
    span.attributes.extend([
        KeyValue::new("gen_ai.operation.name", "invoke_agent"),
        KeyValue::new("gen_ai.agent.name", c.plugin.clone()),
        KeyValue::new("agent_host.worker_id", c.worker_id.clone()),
        KeyValue::new("agent_host.attempt", i64::from(c.attempt)),
        KeyValue::new("agent_host.segment.outcome", outcome.to_string()),
        KeyValue::new("openinference.span.kind", "AGENT"),
    ]);
    span.end_at(now, Status::Unset);
}

/// The run ended (its terminal write committed, by this process): the
/// run's root span, from its enqueue to now.
pub fn run_ended(status: &str, error: Option<&str>, usage: Option<(u64, u64, u64)>) {
    let Some(c) = current() else { return };
    let mut span = c.span(format!("run {}", c.plugin), SpanKind::Internal, SpanId::INVALID, c.root);
    span.start = c.created;
    span.attributes.extend([
        KeyValue::new("gen_ai.agent.name", c.plugin.clone()),
        KeyValue::new("agent_host.run.status", status.to_string()),
        KeyValue::new("agent_host.attempts", i64::from(c.attempt)),
        KeyValue::new("openinference.span.kind", "CHAIN"),
    ]);
    if let Some((calls, input, output)) = usage {
        span.attributes.extend([
            KeyValue::new("agent_host.usage.model_calls", calls as i64),
            KeyValue::new("gen_ai.usage.input_tokens", input as i64),
            KeyValue::new("gen_ai.usage.output_tokens", output as i64),
        ]);
    }
    let status = match (status, error) {
        ("completed", _) => Status::Ok,
        (_, Some(e)) => Status::error(e.to_string()),
        (s, None) => Status::error(s.to_string()),
    };
    span.end_at(SystemTime::now(), status);
}

/// One live tool call of the run in scope (a model call for `llm`): its
/// span starts here and is sent by [`CallSpan::end`]. Inert when the run
/// is not traced.
pub fn tool_call(name: &str, ordinal: u64, args: &Value) -> CallSpan {
    let Some(c) = current() else { return CallSpan(None) };
    let model = name == LLM_TOOL;
    let arguments = c.tracer.content.then(|| match model {
        true => args.get("messages").map(Value::to_string).unwrap_or_default(),
        false => args.to_string(),
    });
    CallSpan(Some(Box::new(Call {
        name: name.to_string(),
        ordinal,
        model,
        requested: args.get("model").and_then(Value::as_str).map(str::to_string),
        arguments,
        start: SystemTime::now(),
        attempt: Mutex::new(None),
        claimed: c,
    })))
}

/// A live call's span (see [`tool_call`]).
pub struct CallSpan(Option<Box<Call>>);

struct Call {
    claimed: Arc<Claimed>,
    name: String,
    ordinal: u64,
    model: bool,
    /// The model the guest named (`None`: the host's default).
    requested: Option<String>,
    /// The prompt or the arguments, when content is on.
    arguments: Option<String>,
    start: SystemTime,
    /// The last model attempt's (provider, model), from its `model_attempt` event.
    attempt: Mutex<Option<(String, String)>>,
}

impl CallSpan {
    /// `sink` as the tool sees it, with the model's attempts noted for the span.
    pub fn sink<'a>(&'a self, sink: &'a dyn EventSink) -> SpanSink<'a> {
        SpanSink { call: self.0.as_deref(), sink }
    }

    /// The call answered (or failed): its span, `chat {model}` or `execute_tool {tool}`.
    pub fn end(self, answer: &Result<String, HostError>) {
        let Some(call) = self.0 else { return };
        let c = &call.claimed;
        let end = SystemTime::now();
        let status = match answer {
            Ok(_) => Status::Unset,
            Err(e) => Status::error(e.to_string()),
        };
        let with_content = c.tracer.content;
        let mut attributes = Vec::new();
        let name = if call.model {
            let parsed = answer.as_ref().ok().and_then(|t| serde_json::from_str::<Value>(t).ok());
            let attempt = call.attempt.lock().unwrap().take();
            // The model asked for: the attempt's (an alias resolved), else
            // the guest's, else the one that answered (the host's default).
            let answered = parsed.as_ref().and_then(|a| a.get("model")).and_then(Value::as_str).map(str::to_string);
            let requested = attempt.as_ref().map(|a| a.1.clone()).or(call.requested.clone()).or(answered);
            attributes.extend([
                KeyValue::new("gen_ai.operation.name", "chat"),
                KeyValue::new("gen_ai.system", "openai"),
                KeyValue::new("gen_ai.provider.name", "openai"),
                KeyValue::new("openinference.span.kind", "LLM"),
            ]);
            if let Some(m) = &requested {
                attributes.push(KeyValue::new("gen_ai.request.model", m.clone()));
            }
            if let Some((provider, _)) = &attempt {
                attributes.push(KeyValue::new("agent_host.provider", provider.clone()));
            }
            if let Some(a) = &parsed {
                if let Some(m) = a.get("model").and_then(Value::as_str) {
                    attributes.push(KeyValue::new("gen_ai.response.model", m.to_string()));
                    attributes.push(KeyValue::new("llm.model_name", m.to_string()));
                }
                if let Some(f) = a.get("finish_reason").and_then(Value::as_str) {
                    let reasons = OtelValue::Array(Array::String(vec![StringValue::from(f.to_string())]));
                    attributes.push(KeyValue::new("gen_ai.response.finish_reasons", reasons));
                }
                let used = crate::tools::llm_tokens(a);
                if a.get("usage").is_some_and(|u| !u.is_null()) {
                    attributes.extend(usage_attributes(&used));
                }
                if with_content {
                    let output = serde_json::json!([{
                        "role": "assistant",
                        "content": a.get("content").cloned().unwrap_or(Value::Null),
                        "tool_calls": a.get("tool_calls").cloned().unwrap_or(Value::Null),
                        "finish_reason": a.get("finish_reason").cloned().unwrap_or(Value::Null),
                    }])
                    .to_string();
                    attributes.push(KeyValue::new("gen_ai.output.messages", content(&output)));
                    attributes.push(KeyValue::new("output.value", content(&output)));
                }
            }
            if let Some(prompt) = &call.arguments {
                attributes.push(KeyValue::new("gen_ai.input.messages", content(prompt)));
                attributes.push(KeyValue::new("input.value", content(prompt)));
            }
            match requested {
                Some(m) => format!("chat {m}"),
                None => "chat".to_string(),
            }
        } else {
            attributes.extend([
                KeyValue::new("gen_ai.operation.name", "execute_tool"),
                KeyValue::new("gen_ai.tool.name", call.name.clone()),
                KeyValue::new("openinference.span.kind", "TOOL"),
            ]);
            if let Some(args) = &call.arguments {
                attributes.push(KeyValue::new("gen_ai.tool.call.arguments", content(args)));
                attributes.push(KeyValue::new("input.value", content(args)));
            }
            if let (true, Ok(result)) = (with_content, answer) {
                attributes.push(KeyValue::new("gen_ai.tool.call.result", content(result)));
                attributes.push(KeyValue::new("output.value", content(result)));
            }
            format!("execute_tool {}", call.name)
        };
        attributes.push(KeyValue::new("agent_host.tool.call_index", call.ordinal as i64));
        if let Err(e) = answer {
            attributes.push(KeyValue::new("error.type", e.kind()));
        }
        let kind = if call.model { SpanKind::Client } else { SpanKind::Internal };
        let mut span = c.span(name, kind, c.segment, span_id());
        span.start = call.start;
        span.attributes.extend(attributes);
        span.end_at(end, status);
    }
}

fn usage_attributes(used: &CallUsage) -> [KeyValue; 5] {
    [
        KeyValue::new("gen_ai.usage.input_tokens", used.prompt_tokens as i64),
        KeyValue::new("gen_ai.usage.output_tokens", used.completion_tokens as i64),
        KeyValue::new("llm.token_count.prompt", used.prompt_tokens as i64),
        KeyValue::new("llm.token_count.completion", used.completion_tokens as i64),
        KeyValue::new("llm.token_count.total", (used.prompt_tokens + used.completion_tokens) as i64),
    ]
}

/// The run host as a tool's sink, noting the model's attempts for the
/// call's span; everything is passed on unchanged.
pub struct SpanSink<'a> {
    call: Option<&'a Call>,
    sink: &'a dyn EventSink,
}

#[async_trait]
impl EventSink for SpanSink<'_> {
    async fn delta(&self, text: &str) -> Result<(), HostError> {
        self.sink.delta(text).await
    }

    async fn event(&self, kind: &str, payload: Value) -> Result<(), HostError> {
        if let (Some(call), crate::db::events::MODEL_ATTEMPT) = (self.call, kind) {
            let field = |k: &str| payload.get(k).and_then(Value::as_str).map(str::to_string);
            if let (Some(provider), Some(model)) = (field("provider"), field("model")) {
                *call.attempt.lock().unwrap() = Some((provider, model));
            }
        }
        self.sink.event(kind, payload).await
    }

    fn usage(&self, used: CallUsage) {
        self.sink.usage(used)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_is_a_base_or_the_traces_url() {
        assert_eq!(traces_url("http://127.0.0.1:6006").unwrap(), "http://127.0.0.1:6006/v1/traces");
        assert_eq!(traces_url("http://c:4318/").unwrap(), "http://c:4318/v1/traces");
        assert_eq!(traces_url("https://c/otel/v1/traces").unwrap(), "https://c/otel/v1/traces");
        assert!(traces_url("c:4318").is_err());
        assert!(traces_url("ftp://c").is_err());
        assert!(traces_url("http://c/?a=b").is_err());
        assert!(traces_url("not a url").is_err());
    }

    #[test]
    fn hooks_without_traces_do_nothing() {
        agent_started();
        segment_ended("finalized");
        run_ended("completed", None, None);
        let call = tool_call("llm", 1, &serde_json::json!({}));
        call.end(&Ok("{}".into()));
    }
}
