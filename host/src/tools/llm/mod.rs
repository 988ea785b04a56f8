//! The `llm` tool: a guest's chat request, checked, sent to an
//! OpenAI-compatible chat-completions endpoint with streaming. Text is
//! journaled as it arrives; tool-call requests go back to the guest, which
//! runs them and asks again. One provider's client (one attempt) is here;
//! the stream's fold in `stream`; the providers, aliases, fallback and
//! retries in `gateway`; the limits every process shares in `limits`; the
//! offline model (no endpoint configured) in `offline`.

pub(crate) mod gateway;
pub(crate) mod limits;
pub(crate) mod offline;
mod responses;
mod stream;

use stream::Reply;

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::{body_snippet, clip, describe, EventSink};
use crate::error::HostError;
use crate::tools::models::Protocol;

/// Text and tool-call arguments one reply may carry.
const REPLY_BYTES_MAX: usize = 1 << 20;
/// The longest Retry-After honoured (a longer one is taken as this).
const RETRY_AFTER_MAX: Duration = Duration::from_secs(600);
/// Bytes of a chunk quoted in a malformed-chunk error.
const CHUNK_SNIPPET_BYTES: usize = 200;

/// The guest's arguments to `llm`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LlmArgs {
    pub messages: Vec<Message>,
    #[serde(default)]
    pub tools: Vec<ToolSpec>,
    pub temperature: Option<f64>,
    pub max_tokens: Option<u64>,
    /// The model to ask: a `[[model]]` alias, `<provider>/<model>`, or a
    /// model of the default provider; unset: `--llm-model`.
    #[serde(default)]
    pub model: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Role {
    System,
    User,
    Assistant,
    Tool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Message {
    pub role: Role,
    /// Absent or null only on an assistant message that calls tools.
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub tool_calls: Vec<RequestedCall>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn text(&self) -> &str {
        self.content.as_deref().unwrap_or("")
    }
}

/// A tool call the model asked for, as the guest hands it back.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RequestedCall {
    pub id: String,
    pub name: String,
    /// JSON text as the model wrote it; a JSON value is accepted too.
    pub arguments: Value,
}

impl RequestedCall {
    fn arguments_text(&self) -> String {
        match &self.arguments {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        }
    }
}

/// A tool the guest offers the model.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ToolSpec {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    /// A JSON schema of the arguments.
    #[serde(default)]
    pub parameters: Option<Value>,
}

impl ToolSpec {
    /// Its arguments' JSON schema; an object of anything when the guest gave none.
    fn schema(&self) -> Value {
        self.parameters.clone().unwrap_or_else(|| json!({ "type": "object", "properties": {} }))
    }
}

/// Checks a guest's arguments; the message says what to fix.
pub(crate) fn parse_args(args: &Value) -> Result<LlmArgs, HostError> {
    let invalid = |m: String| HostError::Invalid(format!("llm arguments: {m}"));
    let parsed = LlmArgs::deserialize(args).map_err(|e| invalid(e.to_string()))?;
    if parsed.messages.is_empty() {
        return Err(invalid("messages must not be empty".into()));
    }
    for (i, m) in parsed.messages.iter().enumerate() {
        if m.role != Role::Assistant && m.content.is_none() {
            return Err(invalid(format!("messages[{i}] needs content")));
        }
        if m.role != Role::Assistant && !m.tool_calls.is_empty() {
            return Err(invalid(format!("messages[{i}]: only assistant messages have tool_calls")));
        }
        match (m.role, &m.tool_call_id) {
            (Role::Tool, None) => return Err(invalid(format!("messages[{i}]: a tool message needs tool_call_id"))),
            (Role::Tool, Some(_)) | (_, None) => {}
            (_, Some(_)) => return Err(invalid(format!("messages[{i}]: only tool messages have tool_call_id"))),
        }
    }
    for (i, t) in parsed.tools.iter().enumerate() {
        if !valid_tool_name(&t.name) {
            return Err(invalid(format!(
                "tools[{i}].name must be 1-{TOOL_NAME_BYTES_MAX} characters of a-z, A-Z, 0-9, _ and -"
            )));
        }
        if t.parameters.as_ref().is_some_and(|p| !p.is_object()) {
            return Err(invalid(format!("tools[{i}].parameters must be a JSON schema object")));
        }
    }
    if parsed.temperature.is_some_and(|t| !(0.0..=2.0).contains(&t)) {
        return Err(invalid("temperature must be 0 to 2".into()));
    }
    if parsed.max_tokens == Some(0) {
        return Err(invalid("max_tokens must be greater than zero".into()));
    }
    if parsed.model.as_deref().is_some_and(|m| m.trim().is_empty() || m.len() > 200) {
        return Err(invalid("model must be 1-200 characters".into()));
    }
    Ok(parsed)
}

/// What `llm` answers the guest.
#[derive(Debug, Serialize)]
pub(crate) struct Answer {
    pub content: String,
    pub tool_calls: Vec<AnswerCall>,
    pub finish_reason: String,
    pub usage: Option<Usage>,
    pub model: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct AnswerCall {
    pub id: String,
    pub name: String,
    /// JSON text as the model wrote it (it may not even be JSON).
    pub arguments: String,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub(crate) struct Usage {
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    /// Of `prompt_tokens`, those the provider read from its cache (its
    /// `prompt_tokens_details.cached_tokens`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cached_tokens: u64,
    /// The call's cost in USD by the tools file's `[[price]]` of its
    /// provider model (none: no price given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    /// As the provider sends it; folded into `cached_tokens`.
    #[serde(default, skip_serializing)]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Usage {
    pub fn new(prompt_tokens: u64, completion_tokens: u64) -> Self {
        Usage { prompt_tokens, completion_tokens, ..Default::default() }
    }

    /// The provider's report with its cached tokens where the host keeps them.
    pub fn normalised(mut self) -> Self {
        if let Some(cached) = self.prompt_tokens_details.take().and_then(|d| d.cached_tokens) {
            self.cached_tokens = cached.min(self.prompt_tokens);
        }
        self
    }
}

impl Answer {
    pub fn into_json(self) -> Value {
        serde_json::to_value(self).expect("an answer of strings and numbers serializes")
    }
}

/// The token usage of an `llm` answer, for the journal: just the counts, or null.
pub(crate) fn usage_of(answer: &Value) -> Value {
    match answer.get("usage").map(Usage::deserialize) {
        Some(Ok(u)) => json!(u),
        _ => Value::Null,
    }
}

/// One OpenAI-compatible chat-completions endpoint (OpenAI, vLLM, Ollama,
/// llama.cpp's server): a provider of the tools file, or the one the
/// `--llm-base-url` flag makes.
pub(crate) struct OpenAi {
    client: reqwest::Client,
    url: String,
    api_key: Option<String>,
    idle_timeout: Duration,
    protocol: Protocol,
}

/// A stream folded into one reply, by the protocol that sends it.
enum Fold {
    Chat(Reply),
    Responses(responses::Fold),
}

impl Fold {
    fn apply(&mut self, data: &str) -> Result<Option<String>, HostError> {
        match self {
            Fold::Chat(r) => r.apply(data),
            Fold::Responses(f) => f.apply(data),
        }
    }

    /// The stream said its reply is whole.
    fn done(&self) -> bool {
        match self {
            Fold::Chat(r) => r.done,
            Fold::Responses(f) => f.done,
        }
    }

    /// At the stream's end without `done`: whether the reply is whole
    /// anyway (some chat servers end with a finish reason and no `[DONE]`).
    fn whole_at_end(&self) -> bool {
        match self {
            Fold::Chat(r) => r.finish_reason.is_some(),
            Fold::Responses(f) => f.done,
        }
    }

    fn finish(self, model: &str) -> Result<Answer, HostError> {
        match self {
            Fold::Chat(r) => r.finish(model),
            Fold::Responses(f) => f.finish(model),
        }
    }
}

/// Why one attempt got no stream, and whether another may.
#[derive(Debug, Clone)]
pub(crate) struct AttemptError {
    /// A failure before the first token that another attempt may not meet:
    /// a connection error, a timeout, 408, 429 or 5xx. Other 4xx never retry.
    pub retryable: bool,
    pub status: Option<u16>,
    /// The provider's `Retry-After` (or `retry-after-ms`), bounded.
    pub retry_after: Option<Duration>,
    /// What failed; the attempts count goes after it.
    head: String,
    /// What the endpoint said, after the count.
    detail: String,
}

impl AttemptError {
    /// The guest's error after `attempts` attempts.
    pub fn message(&self, attempts: u32) -> String {
        let tries = if attempts <= 1 { String::new() } else { format!(" (after {attempts} attempts)") };
        format!("{}{tries}{}", self.head, self.detail)
    }
}

/// A `Retry-After` of seconds (or OpenAI's `retry-after-ms`), at most
/// [`RETRY_AFTER_MAX`]; an HTTP date is not read.
fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let header =
        |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<f64>().ok());
    let d = match header("retry-after-ms") {
        Some(ms) if ms.is_finite() && ms >= 0.0 => Duration::from_secs_f64(ms / 1000.0),
        _ => match header("retry-after") {
            Some(s) if s.is_finite() && s >= 0.0 => Duration::from_secs_f64(s.min(RETRY_AFTER_MAX.as_secs_f64())),
            _ => return None,
        },
    };
    Some(d.min(RETRY_AFTER_MAX))
}

/// Bytes of a tool's name the model is offered.
pub const TOOL_NAME_BYTES_MAX: usize = 64;

/// A tool name a model can be offered: 1-[`TOOL_NAME_BYTES_MAX`] of a-z,
/// A-Z, 0-9, `_` and `-`.
pub fn valid_tool_name(name: &str) -> bool {
    (1..=TOOL_NAME_BYTES_MAX).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn failed(message: impl Into<String>) -> HostError {
    HostError::ToolFailed(message.into())
}

impl OpenAi {
    pub fn new(
        base_url: &str,
        api_key: Option<String>,
        idle_timeout: Duration,
        client: reqwest::Client,
        protocol: Protocol,
    ) -> Self {
        let path = match protocol {
            Protocol::ChatCompletions => "chat/completions",
            Protocol::Responses => "responses",
        };
        let url = format!("{}/{path}", base_url.trim_end_matches('/'));
        OpenAi { client, url, api_key, idle_timeout, protocol }
    }

    fn request_body(&self, args: &LlmArgs, model: &str) -> Value {
        match self.protocol {
            Protocol::ChatCompletions => self.chat_body(args, model),
            Protocol::Responses => responses::body(args, model),
        }
    }

    fn chat_body(&self, args: &LlmArgs, model: &str) -> Value {
        let messages: Vec<Value> = args
            .messages
            .iter()
            .map(|m| match m.role {
                Role::System => json!({ "role": "system", "content": m.text() }),
                Role::User => json!({ "role": "user", "content": m.text() }),
                Role::Tool => json!({ "role": "tool", "tool_call_id": m.tool_call_id, "content": m.text() }),
                Role::Assistant if m.tool_calls.is_empty() => json!({ "role": "assistant", "content": m.text() }),
                Role::Assistant => {
                    let calls: Vec<Value> = m
                        .tool_calls
                        .iter()
                        .map(|c| {
                            json!({
                                "id": c.id,
                                "type": "function",
                                "function": { "name": c.name, "arguments": c.arguments_text() },
                            })
                        })
                        .collect();
                    // OpenAI wants null, not "", beside tool calls.
                    let content = m.content.as_deref().filter(|c| !c.is_empty());
                    json!({ "role": "assistant", "content": content, "tool_calls": calls })
                }
            })
            .collect();
        let mut body = json!({
            "model": model,
            "messages": messages,
            "stream": true,
            "stream_options": { "include_usage": true },
        });
        if !args.tools.is_empty() {
            let tools: Vec<Value> = args
                .tools
                .iter()
                .map(|t| {
                    let mut function = json!({ "name": t.name, "parameters": t.schema() });
                    if let Some(d) = &t.description {
                        function["description"] = json!(d);
                    }
                    json!({ "type": "function", "function": function })
                })
                .collect();
            body["tools"] = json!(tools);
        }
        if let Some(t) = args.temperature {
            body["temperature"] = json!(t);
        }
        if let Some(n) = args.max_tokens {
            body["max_tokens"] = json!(n);
        }
        body
    }

    /// One attempt: the answer's head, or why there is no stream. Retryable
    /// only what cannot have produced a token: no connection, no answer
    /// within the idle timeout, 408, 429 and 5xx.
    async fn open(&self, body: &Value) -> Result<reqwest::Response, AttemptError> {
        let mut request = self.client.post(&self.url).json(body);
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let fail = |retryable: bool, status: Option<u16>, head: String, detail: String| AttemptError {
            retryable,
            status,
            retry_after: None,
            head,
            detail,
        };
        match tokio::time::timeout(self.idle_timeout, request.send()).await {
            Ok(Ok(resp)) if resp.status().is_success() => Ok(resp),
            Ok(Ok(resp)) => {
                let status = resp.status();
                let retryable = matches!(status.as_u16(), 408 | 429) || status.is_server_error();
                let after = retry_after(resp.headers());
                let snippet = body_snippet(resp, &[self.api_key.as_deref().unwrap_or_default()]).await;
                let mut e =
                    fail(retryable, Some(status.as_u16()), format!("model endpoint answered {status}"), snippet);
                e.retry_after = after;
                Err(e)
            }
            Ok(Err(e)) if e.is_connect() => {
                Err(fail(true, None, "cannot connect to the model endpoint".into(), format!(": {}", describe(e))))
            }
            Ok(Err(e)) if e.is_timeout() => {
                Err(fail(true, None, "the model request timed out".into(), format!(": {}", describe(e))))
            }
            Ok(Err(e)) => Err(fail(false, None, format!("model request failed: {}", describe(e)), String::new())),
            Err(_) => Err(fail(
                true,
                None,
                format!("model endpoint sent no answer within {} ms", self.idle_timeout.as_millis()),
                String::new(),
            )),
        }
    }

    /// Reads the stream to its end, sending text to `sink` as it arrives.
    async fn read(&self, resp: reqwest::Response, sink: &dyn EventSink, model: &str) -> Result<Answer, HostError> {
        let content_type = resp.headers().get(reqwest::header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
        if content_type.is_some_and(|t| t.starts_with("application/json")) {
            let snippet = body_snippet(resp, &[self.api_key.as_deref().unwrap_or_default()]).await;
            return Err(failed(format!(
                "model endpoint answered JSON, not a stream (does it support stream: true?){snippet}"
            )));
        }
        let mut stream = resp.bytes_stream();
        let mut sse = crate::stream::decode::SseDecoder::default();
        let mut events = Vec::new();
        let mut reply = match self.protocol {
            Protocol::ChatCompletions => Fold::Chat(Reply::default()),
            Protocol::Responses => Fold::Responses(responses::Fold::default()),
        };
        loop {
            let next = tokio::time::timeout(self.idle_timeout, stream.next()).await.map_err(|_| {
                failed(format!("model stream stalled: nothing for {} ms", self.idle_timeout.as_millis()))
            })?;
            let ended = match next {
                Some(Ok(bytes)) => {
                    sse.feed(&bytes, &mut events).map_err(failed)?;
                    false
                }
                Some(Err(e)) => return Err(failed(format!("model stream broke: {}", describe(e)))),
                None => {
                    events.extend(sse.finish().map_err(failed)?);
                    true
                }
            };
            for data in events.drain(..) {
                if let Some(text) = reply.apply(&data)? {
                    sink.delta(&text).await?;
                }
                if reply.done() {
                    return reply.finish(model);
                }
            }
            if ended {
                if !reply.whole_at_end() {
                    return Err(failed("model stream ended before the reply was complete (dropped mid-stream)"));
                }
                return reply.finish(model);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use axum::body::Body;
    use axum::extract::State;
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use axum::{Json, Router};
    use futures::stream::{self, BoxStream};
    use tokio::sync::mpsc;

    use super::super::test_support::{call, serve, Collect};
    use super::super::{LlmConfig, ToolRegistry, LLM_TOOL};
    use super::*;

    type Piece = Result<String, std::io::Error>;
    /// What the server answers to its n-th request (0-based).
    type Script = Box<dyn Fn(usize) -> Response + Send + Sync>;

    struct Server {
        requests: AtomicUsize,
        bodies: Mutex<Vec<Value>>,
        auth: Mutex<Vec<Option<String>>>,
        script: Script,
    }

    async fn completions(State(s): State<Arc<Server>>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
        let n = s.requests.fetch_add(1, Ordering::SeqCst);
        s.bodies.lock().unwrap().push(body);
        s.auth.lock().unwrap().push(headers.get("authorization").map(|v| v.to_str().unwrap().to_string()));
        (s.script)(n)
    }

    /// A chat-completions server on loopback; returns it and a registry whose `llm` tool points at it.
    async fn start(script: Script, idle: Duration) -> (Arc<Server>, ToolRegistry) {
        let server = Arc::new(Server {
            requests: AtomicUsize::new(0),
            bodies: Mutex::default(),
            auth: Mutex::default(),
            script,
        });
        let router = Router::new().route("/v1/chat/completions", post(completions)).with_state(server.clone());
        let addr = serve(router).await;
        let config = LlmConfig {
            base_url: Some(format!("http://{addr}/v1/")),
            api_key: Some("sk-test".into()),
            model: "test-model".into(),
            timeout: Duration::from_secs(20),
            idle_timeout: idle,
        };
        (server, ToolRegistry::from_config(&config, &[]).unwrap())
    }

    fn sse(body: BoxStream<'static, Piece>) -> Response {
        Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(body)).unwrap()
    }

    fn pieces(pieces: &[&str]) -> BoxStream<'static, Piece> {
        stream::iter(pieces.iter().map(|p| Ok(p.to_string())).collect::<Vec<_>>()).boxed()
    }

    fn status(code: StatusCode, body: &str) -> Response {
        Response::builder().status(code).body(Body::from(body.to_string())).unwrap()
    }

    fn text_chunk(text: &str) -> String {
        format!(
            "data: {}\n\n",
            json!({
                "model": "served-model",
                "choices": [{ "index": 0, "delta": { "content": text }, "finish_reason": null }],
            })
        )
    }

    const STOP: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n";
    const USAGE: &str =
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":3,\"total_tokens\":15}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    fn ask() -> Value {
        json!({ "messages": [{ "role": "user", "content": "hi" }] })
    }

    async fn invoke(r: &ToolRegistry, sink: &Collect, args: Value) -> Result<Value, HostError> {
        let answer = r.invoke(call(LLM_TOOL, args), sink, std::future::pending()).await?;
        Ok(serde_json::from_str(&answer).unwrap())
    }

    #[tokio::test]
    async fn a_streamed_reply_reaches_the_sink_piece_by_piece() {
        let (tx, rx) = mpsc::unbounded_channel::<String>();
        let rx = Mutex::new(Some(rx));
        let script: Script = Box::new(move |_| {
            let rx = rx.lock().unwrap().take().expect("one request");
            sse(tokio_stream_of(rx))
        });
        let (server, r) = start(script, Duration::from_secs(10)).await;
        let (seen_tx, mut seen) = mpsc::unbounded_channel();
        let sink = Collect { deltas_to: Some(seen_tx), ..Default::default() };
        let words = ["Hello", ", ", "wor", "ld", "!"];
        // The server sends a piece only once the previous one reached the sink.
        let drive = async {
            for w in words {
                tx.send(text_chunk(w)).unwrap();
                assert_eq!(seen.recv().await.unwrap(), w);
            }
            for rest in [STOP, USAGE, DONE] {
                tx.send(rest.to_string()).unwrap();
            }
        };
        let (answer, ()) = tokio::join!(invoke(&r, &sink, ask()), drive);
        let answer = answer.unwrap();
        assert_eq!(sink.deltas(), words);
        assert_eq!(
            answer,
            json!({
                "content": "Hello, world!",
                "tool_calls": [],
                "finish_reason": "stop",
                "usage": { "prompt_tokens": 12, "completion_tokens": 3 },
                "model": "served-model",
            })
        );
        assert_eq!(sink.finished()["usage"], json!({ "prompt_tokens": 12, "completion_tokens": 3 }));
        let body = &server.bodies.lock().unwrap()[0];
        assert_eq!(body["model"], "test-model");
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"], json!({ "include_usage": true }));
        assert_eq!(body["messages"], json!([{ "role": "user", "content": "hi" }]));
        assert!(body.get("tools").is_none());
        assert_eq!(server.auth.lock().unwrap()[0].as_deref(), Some("Bearer sk-test"));
    }

    /// The receiving end of a channel as a body stream.
    fn tokio_stream_of(rx: mpsc::UnboundedReceiver<String>) -> BoxStream<'static, Piece> {
        stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|s| (Ok(s), rx)) }).boxed()
    }

    /// A tool-call reply with a comment, CRLF and LF line ends, and a non-ASCII argument.
    const TOOL_CALL_REPLY: &str = concat!(
        ": keepalive comment\r\n\r\n",
        r#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":"#,
        r#"[{"index":0,"id":"call_abc","type":"function","function":{"name":"weather","arguments":""}}]}}]}"#,
        "\r\n\r\n",
        r#"data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"ci"}}]}}]}"#,
        "\n\n",
        r#"data: {"choices":[{"index":0,"delta":{"tool_calls":"#,
        r#"[{"index":0,"function":{"arguments":"ty\": \"Lyön\"}"}}]}}]}"#,
        "\n\n",
        r#"data: {"choices":[{"index":0,"delta":{"tool_calls":"#,
        r#"[{"index":1,"id":"call_def","function":{"name":"time","arguments":"{}"}}]}}]}"#,
        "\n\n",
        r#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
        "\n\n",
        "data: [DONE]\n\n",
    );

    #[test]
    fn the_decoder_finds_the_same_events_however_the_body_is_cut() {
        let whole = {
            let mut d = crate::stream::decode::SseDecoder::default();
            let mut out = Vec::new();
            d.feed(TOOL_CALL_REPLY.as_bytes(), &mut out).unwrap();
            assert_eq!(d.finish().unwrap(), None);
            out
        };
        assert_eq!(whole.len(), 6);
        assert_eq!(whole[5], "[DONE]");
        for size in 1..=9 {
            let mut d = crate::stream::decode::SseDecoder::default();
            let mut out = Vec::new();
            for piece in TOOL_CALL_REPLY.as_bytes().chunks(size) {
                d.feed(piece, &mut out).unwrap();
            }
            assert_eq!(out, whole, "cut every {size} bytes");
        }
        // A last event with no blank line after it still counts.
        let mut d = crate::stream::decode::SseDecoder::default();
        let mut out = Vec::new();
        d.feed(b"data: a\ndata: b\n\ndata: [DONE]", &mut out).unwrap();
        assert_eq!(out, ["a\nb"]);
        assert_eq!(d.finish().unwrap().as_deref(), Some("[DONE]"));
    }

    #[tokio::test]
    async fn a_tool_call_split_across_chunks_is_put_together() {
        // Sent in 7-byte pieces: cut mid-line and mid-field; the decoder test covers every cut.
        let script: Script = Box::new(|_| {
            let cut: Vec<Result<Vec<u8>, std::io::Error>> =
                TOOL_CALL_REPLY.as_bytes().chunks(7).map(|c| Ok(c.to_vec())).collect();
            Response::builder().body(Body::from_stream(stream::iter(cut))).unwrap()
        });
        let (server, r) = start(script, Duration::from_secs(10)).await;
        let sink = Collect::default();
        let args = json!({
            "messages": [
                { "role": "system", "content": "be brief" },
                { "role": "user", "content": "weather in Lyon?" },
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{ "id": "c0", "name": "weather", "arguments": "{}" }],
                },
                { "role": "tool", "tool_call_id": "c0", "content": "sunny" },
            ],
            "tools": [
                { "name": "weather", "description": "Weather now", "parameters": { "type": "object" } },
                { "name": "time" },
            ],
            "temperature": 0.5,
            "max_tokens": 100,
        });
        let answer = invoke(&r, &sink, args).await.unwrap();
        assert!(sink.deltas().is_empty());
        assert_eq!(answer["content"], "");
        assert_eq!(answer["finish_reason"], "tool_calls");
        assert_eq!(answer["usage"], Value::Null);
        assert_eq!(answer["model"], "test-model");
        assert_eq!(
            answer["tool_calls"],
            json!([
                { "id": "call_abc", "name": "weather", "arguments": "{\"city\": \"Lyön\"}" },
                { "id": "call_def", "name": "time", "arguments": "{}" },
            ])
        );
        let sent = &server.bodies.lock().unwrap()[0];
        assert_eq!(
            sent["messages"],
            json!([
                { "role": "system", "content": "be brief" },
                { "role": "user", "content": "weather in Lyon?" },
                {
                    "role": "assistant",
                    "content": null,
                    "tool_calls": [{
                        "id": "c0",
                        "type": "function",
                        "function": { "name": "weather", "arguments": "{}" },
                    }],
                },
                { "role": "tool", "tool_call_id": "c0", "content": "sunny" },
            ])
        );
        assert_eq!(
            sent["tools"],
            json!([
                {
                    "type": "function",
                    "function": { "name": "weather", "description": "Weather now", "parameters": { "type": "object" } },
                },
                {
                    "type": "function",
                    "function": { "name": "time", "parameters": { "type": "object", "properties": {} } },
                },
            ])
        );
        assert_eq!(sent["temperature"], 0.5);
        assert_eq!(sent["max_tokens"], 100);
    }

    #[tokio::test]
    async fn a_malformed_chunk_is_a_tool_failure() {
        let script: Script = Box::new(|_| sse(pieces(&[&text_chunk("ok "), "data: {\"choices\": [oops\n\n", DONE])));
        let (_, r) = start(script, Duration::from_secs(10)).await;
        let sink = Collect::default();
        let e = invoke(&r, &sink, ask()).await.unwrap_err();
        let HostError::ToolFailed(m) = e else { panic!("{e:?}") };
        assert!(m.starts_with("model stream sent a malformed chunk") && m.ends_with("{\"choices\": [oops"), "{m}");
        assert_eq!(sink.deltas(), ["ok "]);
        assert_eq!(sink.finished()["outcome"], "error");
    }

    #[tokio::test]
    async fn an_error_inside_the_stream_is_a_tool_failure() {
        let script: Script =
            Box::new(|_| sse(pieces(&["data: {\"error\":{\"message\":\"model overloaded\",\"code\":503}}\n\n"])));
        let (_, r) = start(script, Duration::from_secs(10)).await;
        let e = invoke(&r, &Collect::default(), ask()).await.unwrap_err();
        assert_eq!(e, HostError::ToolFailed("model stream reported an error: model overloaded".into()));
    }

    #[tokio::test]
    async fn a_stalled_stream_ends_at_the_idle_timeout() {
        let script: Script = Box::new(|_| sse(pieces(&[&text_chunk("thinking")]).chain(stream::pending()).boxed()));
        let (_, r) = start(script, Duration::from_millis(300)).await;
        let sink = Collect::default();
        let e = invoke(&r, &sink, ask()).await.unwrap_err();
        assert_eq!(e, HostError::ToolFailed("model stream stalled: nothing for 300 ms".into()));
        assert_eq!(sink.deltas(), ["thinking"]);
    }

    #[tokio::test]
    async fn a_stream_dropped_mid_reply_is_a_tool_failure() {
        let script: Script = Box::new(|_| sse(pieces(&[&text_chunk("half "), &text_chunk("a rep")])));
        let (server, r) = start(script, Duration::from_secs(10)).await;
        let sink = Collect::default();
        let e = invoke(&r, &sink, ask()).await.unwrap_err();
        assert_eq!(
            e,
            HostError::ToolFailed("model stream ended before the reply was complete (dropped mid-stream)".into())
        );
        assert_eq!(sink.deltas(), ["half ", "a rep"]);
        assert_eq!(server.requests.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_finish_reason_without_done_is_a_complete_reply() {
        let script: Script = Box::new(|_| {
            sse(pieces(&[&text_chunk("short"), "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}]}"]))
        });
        let (_, r) = start(script, Duration::from_secs(10)).await;
        let answer = invoke(&r, &Collect::default(), ask()).await.unwrap();
        assert_eq!(answer["content"], "short");
        assert_eq!(answer["finish_reason"], "length");
    }

    #[tokio::test]
    async fn a_json_answer_instead_of_a_stream_says_so() {
        let script: Script = Box::new(|_| Json(json!({ "choices": [] })).into_response());
        let (_, r) = start(script, Duration::from_secs(10)).await;
        let e = invoke(&r, &Collect::default(), ask()).await.unwrap_err();
        let want = "model endpoint answered JSON, not a stream (does it support stream: true?): {\"choices\":[]}";
        assert_eq!(e, HostError::ToolFailed(want.into()));
    }

    #[tokio::test]
    async fn a_500_before_any_token_is_retried() {
        let script: Script = Box::new(|n| match n {
            0 => status(StatusCode::INTERNAL_SERVER_ERROR, "busy"),
            _ => sse(pieces(&[&text_chunk("second try"), STOP, DONE])),
        });
        let (server, r) = start(script, Duration::from_secs(10)).await;
        let sink = Collect::default();
        let answer = invoke(&r, &sink, ask()).await.unwrap();
        assert_eq!(answer["content"], "second try");
        assert_eq!(sink.deltas(), ["second try"]);
        assert_eq!(server.requests.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_failure_after_the_first_token_is_not_retried() {
        let (seen_tx, seen) = mpsc::unbounded_channel::<String>();
        let seen = Mutex::new(Some(seen));
        // The upstream dies once the first token has reached the sink.
        let script: Script = Box::new(move |n| match n {
            0 => {
                let mut seen = seen.lock().unwrap().take().unwrap();
                let die = stream::once(async move {
                    seen.recv().await;
                    Err(std::io::Error::other("upstream died"))
                });
                sse(pieces(&[&text_chunk("first")]).chain(die).boxed())
            }
            _ => sse(pieces(&[&text_chunk("should never be asked"), STOP, DONE])),
        });
        let (server, r) = start(script, Duration::from_secs(10)).await;
        let sink = Collect { deltas_to: Some(seen_tx), ..Default::default() };
        let e = invoke(&r, &sink, ask()).await.unwrap_err();
        let HostError::ToolFailed(m) = e else { panic!("{e:?}") };
        assert!(m.starts_with("model stream broke"), "{m}");
        assert_eq!(sink.deltas(), ["first"]);
        assert_eq!(server.requests.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn persistent_5xx_and_4xx_name_the_status() {
        let script: Script = Box::new(|n| match n {
            0..=2 => status(StatusCode::SERVICE_UNAVAILABLE, "try later"),
            _ => status(StatusCode::UNAUTHORIZED, "{\"error\":{\"message\":\"bad key\"}}"),
        });
        let (server, r) = start(script, Duration::from_secs(10)).await;
        let e = invoke(&r, &Collect::default(), ask()).await.unwrap_err();
        assert_eq!(
            e,
            HostError::ToolFailed(
                "model endpoint answered 503 Service Unavailable (after 3 attempts): try later".into()
            )
        );
        assert_eq!(server.requests.load(Ordering::SeqCst), 3);
        let e = invoke(&r, &Collect::default(), ask()).await.unwrap_err();
        assert_eq!(
            e,
            HostError::ToolFailed(
                "model endpoint answered 401 Unauthorized: {\"error\":{\"message\":\"bad key\"}}".into()
            )
        );
        assert_eq!(server.requests.load(Ordering::SeqCst), 4, "a 4xx is not retried");
    }

    #[tokio::test]
    async fn an_endpoint_that_refuses_connections_is_a_tool_failure() {
        let addr = super::super::tests::closed_address();
        let config = LlmConfig {
            base_url: Some(format!("http://{addr}/v1")),
            api_key: None,
            model: "m".into(),
            timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(1),
        };
        let r = ToolRegistry::from_config(&config, &[]).unwrap();
        let e = invoke(&r, &Collect::default(), ask()).await.unwrap_err();
        let HostError::ToolFailed(m) = e else { panic!("{e:?}") };
        assert!(m.starts_with("cannot connect to the model endpoint (after 3 attempts)"), "{m}");
        assert!(!m.contains(&addr.to_string()), "no URL in guest-visible errors: {m}");
    }

    #[tokio::test]
    async fn a_reply_over_the_size_cap_is_a_tool_failure() {
        let big = "x".repeat(64 << 10);
        let script: Script = Box::new(move |_| {
            let chunk = text_chunk(&big);
            sse(stream::iter((0..20).map(move |_| Ok(chunk.clone()))).boxed())
        });
        let (_, r) = start(script, Duration::from_secs(10)).await;
        let sink = Collect::default();
        let e = invoke(&r, &sink, ask()).await.unwrap_err();
        assert_eq!(e, HostError::ToolFailed(format!("model reply exceeds {REPLY_BYTES_MAX} bytes")));
        assert_eq!(sink.deltas().len(), 16);
    }

    #[test]
    fn malformed_arguments_are_invalid_with_a_reason() {
        let hi = json!([{ "role": "user", "content": "x" }]);
        for (args, why) in [
            (json!({}), "missing field `messages`"),
            (json!({ "messages": [] }), "messages must not be empty"),
            (json!({ "messages": [{ "role": "robot", "content": "x" }] }), "unknown variant `robot`"),
            (json!({ "messages": [{ "role": "user" }] }), "messages[0] needs content"),
            (json!({ "messages": [{ "role": "tool", "content": "x" }] }), "needs tool_call_id"),
            (json!({ "messages": [{ "role": "user", "content": "x", "tool_call_id": "a" }] }), "only tool messages"),
            (json!({ "messages": hi, "tools": [{ "name": "a b" }] }), "tools[0].name"),
            (json!({ "messages": hi, "tools": [{ "name": "a", "parameters": 3 }] }), "tools[0].parameters"),
            (json!({ "messages": hi, "temperature": 9 }), "temperature must be 0 to 2"),
            (json!({ "messages": hi, "max_tokens": 0 }), "max_tokens must be greater than zero"),
            (json!({ "messages": hi, "stream": true }), "unknown field `stream`"),
        ] {
            match parse_args(&args) {
                Err(HostError::Invalid(m)) => {
                    assert!(m.starts_with("llm arguments: ") && m.contains(why), "{args}: {m}")
                }
                other => panic!("{args}: {other:?}"),
            }
        }
    }
}
