//! MCP servers as tool providers: each `[[mcp]]` entry of the tools file is
//! a server the host reaches over the Streamable HTTP transport with the
//! official Rust SDK (`rmcp`), speaking the 2026-07-28 protocol (stateless,
//! `server/discover`) or, with a server that does not, 2025-11-25 with its
//! `initialize` handshake. Its tools are `<server>.<tool>`.
//!
//! The connection is made at the first call that needs it and made again
//! after it breaks, so a server that is down fails only the calls that need
//! it. The tool list is cached, and listed again when the server says it
//! changed (`notifications/tools/list_changed`) or after `list_ttl_ms`.
//! A call is `tools/call`; its answer is the result's `structuredContent`
//! when present, else its text; `isError` is `tool failed` with the text.
//! Dropping a call (its timeout, a stop, a lost claim) makes the SDK send
//! `notifications/cancelled` for it. Tool annotations (read-only,
//! destructive, idempotent) are recorded with each call and trusted only
//! for a server marked `trusted = true`.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use reqwest::header::{HeaderName, HeaderValue};
use rmcp::model::{CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation, ProtocolVersion};
use rmcp::service::{serve_client_with_lifecycle, ClientLifecycleMode, NotificationContext, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{ClientHandler, Peer, RoleClient};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::models::Failed;
use super::{EventSink, Tool, ToolCall};
use crate::error::HostError;

const TIMEOUT_MS_DEFAULT: u64 = 30_000;
const RESPONSE_BYTES_DEFAULT: u64 = 1 << 20;
const LIST_TTL_MS_DEFAULT: u64 = 300_000;
/// Tools one server may list (more are ignored, with a warning).
pub const SERVER_TOOLS_MAX: usize = 1024;
/// How long the connection (and a listing) may take, at most, when no call
/// bounds it.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// Which of a server's calls wait for a person's approval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum McpApproval {
    /// Every call.
    Always,
    /// Calls of tools that may be destructive: those a trusted server
    /// annotates `destructiveHint` (and not `readOnlyHint`), and every tool
    /// of an untrusted server (its annotations are only hints).
    Destructive,
    /// As the manifest and the run say (the default).
    #[default]
    Never,
}

/// One `[[mcp]]` entry of the tools file.
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    /// The server's name: its tools are `<name>.<tool>`.
    pub name: String,
    /// Its Streamable HTTP endpoint (`http://host:port/mcp`).
    pub url: String,
    /// Sent with every request (credentials, `${env:NAME}` for a secret).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// One call, end to end.
    #[serde(default = "timeout_default")]
    pub timeout_ms: u64,
    /// Bytes of one answer.
    #[serde(default = "bytes_default")]
    pub max_response_bytes: u64,
    /// Only these of the server's tools exist here (default: all it lists).
    #[serde(default)]
    pub allowed_tools: Option<Vec<String>>,
    /// Whether the server's tool annotations are believed (idempotent tools
    /// are then re-sent after a crash, read-only ones too).
    #[serde(default)]
    pub trusted: bool,
    /// How long a tool list is used before it is listed again (a server's
    /// `list_changed` notification refreshes it sooner).
    #[serde(default = "ttl_default")]
    pub list_ttl_ms: u64,
    /// Which of the server's calls wait for a person's approval.
    #[serde(default)]
    pub approval: McpApproval,
    /// The tenants whose own plugins may use it (`["*"]`: every tenant);
    /// unset: as `--tenant-tools` says (none by default). Published plugins
    /// (the operator's) may use every tool.
    #[serde(default)]
    pub tenants: Option<Vec<String>>,
    /// Attempts of one call, with backoff and jitter (default: one). A call
    /// that never reached the server (it could not be connected to, or its
    /// tools not listed) is tried again; one that may have reached it (the
    /// connection broke mid-call) only when the tool is idempotent (a
    /// trusted server's `idempotentHint` or `readOnlyHint`); an answer, a
    /// protocol error or the tool's own error never is.
    #[serde(default)]
    pub retry: Option<super::models::RetryConfig>,
}

fn timeout_default() -> u64 {
    TIMEOUT_MS_DEFAULT
}

fn bytes_default() -> u64 {
    RESPONSE_BYTES_DEFAULT
}

fn ttl_default() -> u64 {
    LIST_TTL_MS_DEFAULT
}

impl fmt::Debug for McpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpConfig")
            .field("name", &self.name)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("timeout_ms", &self.timeout_ms)
            .field("allowed_tools", &self.allowed_tools)
            .field("trusted", &self.trusted)
            .field("tenants", &self.tenants)
            .field("retry", &self.retry)
            .finish()
    }
}

impl McpConfig {
    pub(crate) fn check(&self) -> Result<(), String> {
        let name_ok = (1..=32).contains(&self.name.len())
            && self.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if !name_ok {
            return Err(format!("name {:?} must be 1-32 characters of a-z, 0-9, _ and -", self.name));
        }
        if [super::LLM_TOOL, super::WAIT_TOOL, super::HTTP_TOOL].contains(&self.name.as_str()) {
            return Err(format!("name {:?} is one of the host's own tools", self.name));
        }
        super::checks::check_http_url(&self.url).map_err(|e| format!("url: {e}"))?;
        super::checks::check_call_limits(self.timeout_ms, self.max_response_bytes)?;
        if self.list_ttl_ms == 0 {
            return Err("list_ttl_ms must be above 0".into());
        }
        if let Some(r) = &self.retry {
            r.check().map_err(|e| format!("retry: {e}"))?;
        }
        self.headers()?;
        Ok(())
    }

    fn headers(&self) -> Result<HashMap<HeaderName, HeaderValue>, String> {
        let mut out = HashMap::new();
        for (name, value) in &self.headers {
            let name =
                HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("header {name:?} is not a valid name"))?;
            if ["content-type", "content-length", "host", "accept", "mcp-session-id", "mcp-protocol-version"]
                .contains(&name.as_str())
            {
                return Err(format!("header {name:?} is set by the host"));
            }
            let mut value =
                HeaderValue::from_str(value).map_err(|_| format!("header {name:?} has an invalid value"))?;
            value.set_sensitive(true);
            out.insert(name, value);
        }
        Ok(out)
    }
}

/// One tool a server lists, as the host keeps it.
#[derive(Debug, Clone)]
pub struct McpTool {
    pub name: String,
    pub description: Option<String>,
    pub input_schema: Value,
    /// The annotations as the server declared them (`{}` when none).
    pub annotations: Value,
}

impl McpTool {
    fn hint(&self, key: &str) -> Option<bool> {
        self.annotations.get(key).and_then(Value::as_bool)
    }
}

/// Marks the tool list stale when the server says it changed.
#[derive(Clone)]
struct Handler {
    changed: Arc<AtomicBool>,
}

impl ClientHandler for Handler {
    fn on_tool_list_changed(
        &self,
        _context: NotificationContext<RoleClient>,
    ) -> impl std::future::Future<Output = ()> + Send + '_ {
        self.changed.store(true, Ordering::SeqCst);
        std::future::ready(())
    }

    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(ClientCapabilities::default(), Implementation::new("agent-host", env!("CARGO_PKG_VERSION")))
    }
}

type Connection = RunningService<RoleClient, Handler>;

/// The least any one message from a server may be (a tool list of many
/// tools, the handshake), whatever the answer cap.
const MESSAGE_BYTES_MIN: u64 = 4 << 20;

/// One configured server: its connection (made when first needed) and its
/// tool list.
pub(crate) struct McpServer {
    config: McpConfig,
    headers: HashMap<HeaderName, HeaderValue>,
    connection: tokio::sync::Mutex<Option<Connection>>,
    listing: Mutex<Option<(Instant, Arc<Vec<McpTool>>)>>,
    changed: Arc<AtomicBool>,
    /// The protocol version of the last connection made.
    protocol: Mutex<Option<String>>,
    /// Counts the connections made: a call that saw its connection break
    /// resets only that one, never a healthy newer one.
    generation: AtomicU64,
}

impl McpServer {
    pub fn new(config: &McpConfig) -> Result<Arc<McpServer>, String> {
        config.check()?;
        Ok(Arc::new(McpServer {
            headers: config.headers()?,
            config: config.clone(),
            connection: tokio::sync::Mutex::new(None),
            listing: Mutex::new(None),
            changed: Arc::new(AtomicBool::new(false)),
            protocol: Mutex::new(None),
            generation: AtomicU64::new(0),
        }))
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    fn failed(&self, what: &str, e: impl fmt::Display) -> HostError {
        HostError::ToolFailed(format!("MCP server {:?}: {what}: {e}", self.config.name))
    }

    /// A peer on a live connection (the one there is, or a new one) and
    /// that connection's generation, for [`McpServer::reset`].
    async fn peer(&self) -> Result<(Peer<RoleClient>, u64), HostError> {
        let mut connection = self.connection.lock().await;
        if let Some(c) = connection.as_ref() {
            if !c.is_closed() && !c.is_transport_closed() {
                return Ok((c.peer().clone(), self.generation.load(Ordering::SeqCst)));
            }
        }
        *connection = None;
        // The transport's cap bounds every message (the handshake and the
        // tool list too), so it is not the answer cap: that one is checked
        // on each call's result.
        let max = self.config.max_response_bytes.max(MESSAGE_BYTES_MIN);
        let max = usize::try_from(max).unwrap_or(usize::MAX);
        let config = StreamableHttpClientTransportConfig::with_uri(self.config.url.as_str())
            .custom_headers(self.headers.clone())
            .max_json_response_size(max)
            .max_sse_event_size(max)
            .reinit_on_expired_session(true);
        // Like the webhooks, never through an HTTP(S)_PROXY of the
        // environment: the operator's URL is the destination.
        let client = reqwest_mcp::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(0)
            .redirect(reqwest_mcp::redirect::Policy::none())
            .build()
            .map_err(|e| self.failed("unreachable", e))?;
        let transport = StreamableHttpClientTransport::with_client(client, config);
        let handler = Handler { changed: self.changed.clone() };
        let lifecycle = ClientLifecycleMode::Auto {
            preferred_versions: vec![ProtocolVersion::V_2026_07_28],
            legacy_version: Some(ProtocolVersion::V_2025_11_25),
        };
        let connect = serve_client_with_lifecycle(handler, transport, lifecycle);
        let c = tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| self.failed("unreachable", format!("no connection within {} s", CONNECT_TIMEOUT.as_secs())))?
            .map_err(|e| self.failed("unreachable", e))?;
        let version = c.peer_info().map(|i| i.protocol_version.to_string()).unwrap_or_default();
        tracing::info!(server = %self.config.name, protocol = %version, "connected to an MCP server");
        *self.protocol.lock().unwrap() = Some(version);
        let peer = c.peer().clone();
        *connection = Some(c);
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        // A new connection may be a new server: list again.
        self.changed.store(true, Ordering::SeqCst);
        Ok((peer, generation))
    }

    /// Forgets a broken connection, so the next call makes a new one; only
    /// if it is still connection `generation` (another call may already have
    /// made a healthy new one).
    async fn reset(&self, generation: u64) {
        let mut connection = self.connection.lock().await;
        if self.generation.load(Ordering::SeqCst) != generation {
            return;
        }
        if let Some(c) = connection.take() {
            let _ = tokio::time::timeout(Duration::from_secs(1), c.cancel()).await;
        }
    }

    /// The protocol version the last connection speaks (`2026-07-28`, or
    /// `2025-11-25` with a server that only knows the initialize handshake).
    pub fn protocol(&self) -> Option<String> {
        self.protocol.lock().unwrap().clone()
    }

    /// Whether `tool` is one the operator lets this server offer.
    pub fn allows(&self, tool: &str) -> bool {
        self.config.allowed_tools.as_ref().is_none_or(|a| a.iter().any(|t| t == tool))
    }

    /// The listing as cached (whatever its age), if any.
    pub fn cached(&self) -> Option<Arc<Vec<McpTool>>> {
        self.listing.lock().unwrap().as_ref().map(|(_, l)| l.clone())
    }

    /// The server's tools (those the operator allows): cached, listed again
    /// after a change notification or the TTL.
    pub async fn tools(&self) -> Result<Arc<Vec<McpTool>>, HostError> {
        let ttl = Duration::from_millis(self.config.list_ttl_ms);
        if !self.changed.load(Ordering::SeqCst) {
            if let Some((at, list)) = self.listing.lock().unwrap().as_ref() {
                if at.elapsed() < ttl {
                    return Ok(list.clone());
                }
            }
        }
        let list = tokio::time::timeout(CONNECT_TIMEOUT, self.list())
            .await
            .map_err(|_| self.failed("tools/list", "no answer in time"))??;
        Ok(list)
    }

    async fn list(&self) -> Result<Arc<Vec<McpTool>>, HostError> {
        let (peer, generation) = self.peer().await?;
        self.changed.store(false, Ordering::SeqCst);
        let listed = match peer.list_all_tools().await {
            Ok(listed) => listed,
            Err(e) => {
                self.reset(generation).await;
                return Err(self.failed("tools/list", e));
            }
        };
        if listed.len() > SERVER_TOOLS_MAX {
            tracing::warn!(server = %self.config.name, listed = listed.len(), "an MCP server lists more tools than kept");
        }
        let tools: Vec<McpTool> = listed
            .into_iter()
            .take(SERVER_TOOLS_MAX)
            .filter(|t| self.allows(&t.name))
            .filter(|t| {
                let ok = valid_mcp_tool_name(&t.name);
                if !ok {
                    tracing::warn!(server = %self.config.name, tool = %t.name.escape_debug(), "an MCP tool's name is not 1-128 characters of A-Z, a-z, 0-9, _, - and .; it is not offered");
                }
                ok
            })
            .map(|t| McpTool {
                name: t.name.to_string(),
                description: t.description.as_ref().map(|d| d.to_string()),
                input_schema: Value::Object((*t.input_schema).clone()),
                annotations: t.annotations.as_ref().and_then(|a| serde_json::to_value(a).ok()).unwrap_or(json!({})),
            })
            .collect();
        let tools = Arc::new(tools);
        *self.listing.lock().unwrap() = Some((Instant::now(), tools.clone()));
        Ok(tools)
    }

    /// One `tools/call`, one attempt: a failure says whether another may
    /// be made (see [`McpConfig::retry`]); `idempotent`: the tool's.
    async fn call(&self, tool: &str, args: &Value, idempotent: bool) -> Result<Value, Failed> {
        let once = |error: HostError| Failed { error, status: None, after: None, retryable: false };
        // Not sent yet: whatever fails before the call may pass.
        let unsent = |error: HostError| Failed { error, status: None, after: None, retryable: true };
        let arguments = match args {
            Value::Object(m) => m.clone(),
            Value::Null => Map::new(),
            _ => return Err(once(HostError::Invalid("an MCP tool's arguments are a JSON object".into()))),
        };
        let listed = self.tools().await.map_err(unsent)?;
        if !listed.iter().any(|t| t.name == tool) {
            let e = HostError::Denied(format!("MCP server {:?} lists no tool {tool:?}", self.config.name));
            return Err(once(e));
        }
        let (peer, generation) = self.peer().await.map_err(unsent)?;
        let params = CallToolRequestParams::new(tool.to_string()).with_arguments(arguments);
        let result = match peer.call_tool(params).await {
            Ok(result) => result,
            Err(rmcp::ServiceError::McpError(e)) => {
                return Err(once(self.failed(&format!("tools/call {tool:?}"), e.message)))
            }
            Err(e) => {
                // The connection broke mid-call: the server may have acted.
                self.reset(generation).await;
                let error = self.failed(&format!("tools/call {tool:?}"), e);
                return Err(Failed { error, status: None, after: None, retryable: idempotent });
            }
        };
        self.answer(tool, result).map_err(once)
    }

    /// A `tools/call` result as the tool's answer (or its error).
    fn answer(&self, tool: &str, result: rmcp::model::CallToolResult) -> Result<Value, HostError> {
        let text: Vec<String> = result
            .content
            .iter()
            .filter_map(|c| serde_json::to_value(c).ok())
            .filter_map(|c| c.get("text").and_then(Value::as_str).map(str::to_string))
            .collect();
        let text = text.join("\n");
        if result.is_error == Some(true) {
            return Err(HostError::ToolFailed(format!("{}.{tool}: {text}", self.config.name)));
        }
        let answer = match result.structured_content {
            Some(structured) => structured,
            None if text.is_empty() && !result.content.is_empty() => {
                serde_json::to_value(&result.content).unwrap_or(Value::Null)
            }
            None => Value::String(text),
        };
        let bytes = crate::text::json_bytes(&answer);
        if bytes as u64 > self.config.max_response_bytes {
            return Err(self.failed(
                &format!("tools/call {tool:?}"),
                format!("the answer of {bytes} bytes exceeds max_response_bytes ({})", self.config.max_response_bytes),
            ));
        }
        Ok(answer)
    }
}

/// A tool name as MCP allows it (1-128 characters of A-Z, a-z, 0-9, `_`,
/// `-` and `.`); a server's tool named otherwise is not offered.
pub(crate) fn valid_mcp_tool_name(name: &str) -> bool {
    (1..=128).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
}

/// One of a server's tools, as the registry hands it out.
pub(crate) struct McpToolRef {
    pub server: Arc<McpServer>,
    pub tool: String,
}

impl McpToolRef {
    fn listed(&self) -> Option<McpTool> {
        self.server.cached()?.iter().find(|t| t.name == self.tool).cloned()
    }

    /// An annotation, believed only for a trusted server.
    fn trusted_hint(&self, key: &str) -> Option<bool> {
        self.server.config.trusted.then(|| self.listed()?.hint(key)).flatten()
    }
}

#[async_trait]
impl Tool for McpToolRef {
    /// Attempts as the server's `retry` says, each retried one journaled
    /// (`tool_attempt`); the registry's timeout bounds them all.
    async fn call(&self, call: &ToolCall<'_>, sink: &dyn EventSink) -> Result<Value, HostError> {
        let idempotent = self.idempotent();
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.server.call(&self.tool, &call.args, idempotent).await {
                Ok(answer) => return Ok(answer),
                Err(failed) => {
                    super::models::RetryConfig::again(self.server.config.retry.as_ref(), attempt, call, sink, failed)
                        .await?
                }
            }
        }
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.server.config.timeout_ms)
    }

    /// A trusted server's read-only or idempotent tool may be sent again
    /// after a crash.
    fn idempotent(&self) -> bool {
        self.trusted_hint("readOnlyHint") == Some(true) || self.trusted_hint("idempotentHint") == Some(true)
    }

    fn requires_approval(&self) -> bool {
        match self.server.config.approval {
            McpApproval::Always => true,
            McpApproval::Never => false,
            // Per MCP, a tool is destructive unless it says otherwise.
            McpApproval::Destructive => {
                self.trusted_hint("readOnlyHint") != Some(true) && self.trusted_hint("destructiveHint") != Some(false)
            }
        }
    }

    fn annotations(&self) -> Option<Value> {
        let annotations = self.listed().map_or(json!({}), |t| t.annotations);
        Some(json!({ "server": self.server.name(), "trusted": self.server.config.trusted, "declared": annotations }))
    }

    fn describe(&self) -> (Option<String>, Value) {
        match self.listed() {
            Some(t) => (t.description, t.input_schema),
            None => (None, json!({ "type": "object" })),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tool_names_outside_mcp_s_charset_or_length_are_not_offered() {
        for ok in ["echo", "get-sum_2", "a.b", &"x".repeat(128)] {
            assert!(super::valid_mcp_tool_name(ok), "{ok}");
        }
        for bad in ["", "has space", "naïve", "a/b", &"x".repeat(129)] {
            assert!(!super::valid_mcp_tool_name(bad), "{bad}");
        }
    }
}
