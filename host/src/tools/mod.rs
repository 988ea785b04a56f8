//! Host tools behind the WIT import `call-tool`: the model (`llm`), the
//! operator's webhook tools, the tools of MCP servers (`<server>.<tool>`)
//! and the allow-listed `http` tool. The host runs them, not the guest, so that
//! credentials stay in the host and timeouts, cancellation and journaling hold
//! whatever the guest does. Grants, per-run limits and the call's ordinal
//! are the run host's business (`run::host`); the registry runs one call it
//! is handed, streaming into an [`EventSink`] (the run host, or a test's).

mod checks;
mod config;
mod http;
pub(crate) mod llm;
mod mcp;
pub mod models;
mod webhook;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::{json, Value};

use crate::db::events::{TOOL_CALL_FINISHED, TOOL_CALL_STARTED};
use crate::db::RunId;
use crate::error::HostError;

pub use checks::{Secrets, TenantScope};
pub use config::{load_tools_file, parse_tools_file_with, Approval, LlmConfig, ToolsConfig, ToolsFile, WebhookConfig};
pub use http::HttpRule;
pub use llm::{valid_tool_name, TOOL_NAME_BYTES_MAX};
pub use mcp::{McpApproval, McpConfig};

/// The tokens an `llm` answer says it used, and its cost (USD, 0 without a price).
pub(crate) fn llm_tokens(answer: &Value) -> CallUsage {
    let usage = llm::usage_of(answer);
    let tokens = |k: &str| usage.get(k).and_then(Value::as_u64).unwrap_or(0);
    CallUsage {
        prompt_tokens: tokens("prompt_tokens"),
        completion_tokens: tokens("completion_tokens"),
        cached_tokens: tokens("cached_tokens"),
        cost_usd: usage.get("cost_usd").and_then(Value::as_f64).unwrap_or(0.0),
    }
}

/// What one model call used, as the run's usage sums it.
#[derive(Debug, Clone, Copy, Default)]
pub struct CallUsage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Of the prompt tokens, those read from the provider's cache.
    pub cached_tokens: u64,
    /// USD, by the tools file's price table.
    pub cost_usd: f64,
}

/// The model tool's name; no webhook may take it.
pub const LLM_TOOL: &str = "llm";
/// The durable wait's name (`{seconds}` or `{until}`): the run host suspends
/// the run until then; the tool itself never runs. No webhook may take it.
pub const WAIT_TOOL: &str = "wait";
/// What a grant of a sub-agent starts with: a manifest granting
/// `agent:<plugin>` lets its agent start child runs of `<plugin>` (the run
/// host starts them; no tool of this registry runs).
pub const AGENT_TOOL_PREFIX: &str = "agent:";
/// The name a guest calls `call-tool` with to await child runs it started:
/// `{runs, mode}` (the run host suspends the run until they are joined);
/// granted with any `agent:<plugin>`.
pub const AWAIT_AGENTS: &str = "await-agents";
/// The name a guest calls `call-tool` with to take the instructions queued
/// for its turn (steering): answered by the run host itself, granted to
/// every plugin (it reads only the run's own input), not a tool call (no
/// ordinal, no `tool_call_*` events), recorded and replayed as a reading.
/// Components of every world version reach it through `call-tool`.
pub const TAKE_INSTRUCTIONS: &str = "take-instructions";
/// The allow-listed HTTP tool's name (present when the tools file has
/// `[[http]]` rules).
pub const HTTP_TOOL: &str = "http";
/// How long fetching an MCP server's listing may hold a call back before it
/// is made (the call then reports what is wrong, within its own timeout).
const WARM_MAX: Duration = Duration::from_secs(2);
/// Bytes of an error message kept in `tool_call_finished`.
const JOURNAL_ERROR_BYTES_MAX: usize = 500;
/// Bytes of an error answer's body quoted back in a tool error.
const BODY_SNIPPET_BYTES: usize = 300;

/// Where a tool's streaming output goes: the run's journal in production, a
/// collecting sink in tests.
#[async_trait]
pub trait EventSink: Send + Sync {
    /// A piece of the answer (`content_delta`).
    async fn delta(&self, text: &str) -> Result<(), HostError>;
    /// A host-written event such as `tool_call_started`.
    async fn event(&self, kind: &str, payload: Value) -> Result<(), HostError>;
    /// Tokens a model call used, added to the run's total.
    fn usage(&self, _used: CallUsage) {}
}

/// One call of a tool by a run.
pub struct ToolCall<'a> {
    pub run_id: RunId,
    /// The call's ordinal within the run: with the run id it makes the
    /// webhook's `Idempotency-Key`, so it must never repeat within a run.
    pub call_index: u32,
    pub name: &'a str,
    pub args: Value,
    /// The caller's cap on this call (a plugin's `tool_timeout_ms`), below
    /// the tool's own timeout.
    pub timeout_max: Option<Duration>,
    /// The tenant whose own plugin makes the call (`None`: a published
    /// plugin or a built-in agent, held to no tenant's grants): a tool with
    /// parts of its own per tenant (the `http` tool's rules) admits only
    /// those of this tenant.
    pub tenant: Option<&'a str>,
    /// The run is resumable: a call that would wait long for a shared
    /// limit may answer [`HostError::Throttled`] and the run suspends.
    pub may_suspend: bool,
}

#[async_trait]
pub trait Tool: Send + Sync {
    /// Runs the call; streamed output goes to `sink`. The registry enforces
    /// the timeout and cancellation by dropping this future.
    async fn call(&self, call: &ToolCall<'_>, sink: &dyn EventSink) -> Result<Value, HostError>;
    /// How long one call may take, end to end.
    fn timeout(&self) -> Duration;
    /// Whether calling it twice with the same arguments (and, for a webhook,
    /// the same Idempotency-Key) does no more than calling it once: a
    /// resumed run re-issues such a call when its outcome is unknown.
    fn idempotent(&self) -> bool {
        false
    }
    /// Whether the operator says every call of it waits for a person's
    /// approval (whatever the plugin's manifest says).
    fn requires_approval(&self) -> bool {
        false
    }
    /// What the tool declares of itself (an MCP tool's annotations, and
    /// whether they are trusted), journaled with each call.
    fn annotations(&self) -> Option<Value> {
        None
    }
    /// Its description and input schema, for a guest's `list-tools`.
    fn describe(&self) -> (Option<String>, Value) {
        (None, json!({ "type": "object" }))
    }
}

/// A tool a guest may call, as `list-tools` answers it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolInfo {
    pub name: String,
    pub description: Option<String>,
    /// Its input's JSON schema.
    pub input_schema: Value,
}

/// [`WAIT_TOOL`]: only a name here (the run host suspends the run instead).
struct Wait;

#[async_trait]
impl Tool for Wait {
    async fn call(&self, _call: &ToolCall<'_>, _sink: &dyn EventSink) -> Result<Value, HostError> {
        Err(HostError::ToolFailed("the wait tool needs a resumable run".into()))
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(1)
    }
}

/// The tools of this host, by name.
#[derive(Clone, Default)]
pub struct ToolRegistry {
    tools: HashMap<String, Arc<dyn Tool>>,
    /// MCP servers by name: their tools are `<server>.<tool>`.
    mcp: HashMap<String, Arc<mcp::McpServer>>,
    /// What the tools file took from the environment: cut out of every
    /// answer and error a tool gives.
    secrets: Secrets,
    /// The tenants whose own plugins may use each operator tool (webhooks
    /// and MCP servers, by name); tools not named here (the model, the wait,
    /// a demo's) are every tenant's. The `http` tool is admitted when any of
    /// its rules admits the tenant, and each call is held to those rules.
    scopes: HashMap<String, TenantScope>,
    /// The `http` rules' scopes, for the tool's admission.
    http_scopes: Vec<TenantScope>,
    /// The model providers behind `llm` (none: the offline model), for the
    /// shared limits' database and `/metrics`.
    gateway: Option<Arc<llm::gateway::Gateway>>,
}

impl ToolRegistry {
    /// Always an `llm` tool (the OpenAI-compatible endpoint when
    /// `llm.base_url` is set, else the offline provider), plus `webhooks`.
    pub fn from_config(llm: &LlmConfig, webhooks: &[WebhookConfig]) -> Result<Self, String> {
        let tools = ToolsConfig { webhooks: webhooks.to_vec(), ..Default::default() };
        Self::from_tools(llm, &tools)
    }

    /// The `llm` tool and everything the tools file configures: webhooks,
    /// MCP servers (connected when first needed) and the `http` tool.
    pub fn from_tools(llm: &LlmConfig, file: &ToolsConfig) -> Result<Self, String> {
        let webhooks = &file.webhooks;
        llm.check()?;
        let mut registry = ToolRegistry::default();
        let model: Arc<dyn Tool> = match llm::gateway::Gateway::build(llm, &file.models, http_client()?)? {
            Some(gateway) => {
                let gateway = Arc::new(gateway);
                registry.gateway = Some(gateway.clone());
                gateway
            }
            None => Arc::new(llm::offline::Offline::new(llm.timeout)),
        };
        registry.insert(LLM_TOOL, model);
        registry.insert(WAIT_TOOL, Arc::new(Wait));
        let client = http_client()?;
        for w in webhooks {
            let headers = w.check().map_err(|e| format!("webhook {:?}: {e}", w.name))?;
            if registry.tools.contains_key(&w.name) {
                return Err(format!("webhook {:?}: the name is taken", w.name));
            }
            registry.insert(&w.name, Arc::new(webhook::Webhook::new(w, headers, client.clone())));
            registry.scopes.insert(w.name.clone(), TenantScope::of(&w.tenants, file.tenants_default_all));
        }
        if !file.mcp.is_empty() {
            // The MCP client's TLS takes the process's provider (ring, as the
            // rest of the host); an error means one is installed already.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        for m in &file.mcp {
            let server = mcp::McpServer::new(m).map_err(|e| format!("mcp {:?}: {e}", m.name))?;
            if registry.tools.contains_key(&m.name) || registry.mcp.contains_key(&m.name) {
                return Err(format!("mcp {:?}: the name is taken", m.name));
            }
            registry.mcp.insert(m.name.clone(), server);
            registry.scopes.insert(m.name.clone(), TenantScope::of(&m.tenants, file.tenants_default_all));
        }
        if !file.http.is_empty() {
            if registry.tools.contains_key(HTTP_TOOL) {
                return Err(format!("the name {HTTP_TOOL:?} is the host's http tool"));
            }
            registry.insert(HTTP_TOOL, Arc::new(http::Http::new(&file.http, &file.secrets, file.tenants_default_all)?));
            registry.http_scopes =
                file.http.iter().map(|r| TenantScope::of(&r.tenants, file.tenants_default_all)).collect();
        }
        registry.secrets = file.secrets.clone();
        // The model's API key is a secret too: cut from whatever a guest,
        // the journal or a log would see.
        if let Some(key) = llm.api_key.as_deref().filter(|k| k.len() >= checks::SECRET_BYTES_MIN) {
            registry.secrets.add_value(key);
        }
        Ok(registry)
    }

    /// The database the shared model limits live in: until it is given
    /// (tests without one) they are not enforced.
    pub fn attach_database(&self, pool: sqlx::PgPool) {
        if let Some(g) = &self.gateway {
            g.limits.attach(pool);
        }
    }

    /// The model calls' figures (attempts, shared-limit waits, pauses) for `/metrics`.
    pub fn model_metrics(&self, e: &mut crate::metrics::Exposition) {
        if let Some(g) = &self.gateway {
            g.limits.stats.write(e);
        }
    }

    /// Whether a plugin of `tenant` (one of its own, not a published one)
    /// may use the tool a manifest grants as `grant`: a webhook or an MCP
    /// server (`<server>.<tool>` or `<server>.*`) whose `tenants` admit it,
    /// the `http` tool when a rule admits it, and the host's own tools.
    pub fn admits(&self, grant: &str, tenant: &str) -> bool {
        if grant == HTTP_TOOL && self.tools.contains_key(HTTP_TOOL) {
            return self.http_scopes.iter().any(|s| s.admits(tenant));
        }
        let key = match self.scopes.contains_key(grant) {
            true => grant,
            false => grant.split_once('.').map_or(grant, |(server, _)| server),
        };
        self.scopes.get(key).is_none_or(|s| s.admits(tenant))
    }

    pub fn insert(&mut self, name: &str, tool: Arc<dyn Tool>) {
        self.tools.insert(name.to_string(), tool);
    }

    /// The tool called `name`: one of the host's own, or `<server>.<tool>`
    /// of an MCP server that the operator lets it offer.
    pub fn get(&self, name: &str) -> Option<Arc<dyn Tool>> {
        if let Some(tool) = self.tools.get(name) {
            return Some(tool.clone());
        }
        let (server, tool) = name.split_once('.')?;
        let server = self.mcp.get(server)?;
        if tool.is_empty() || !server.allows(tool) {
            return None;
        }
        Some(Arc::new(mcp::McpToolRef { server: server.clone(), tool: tool.to_string() }))
    }

    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tools.keys().cloned().collect();
        names.sort();
        names
    }

    /// The tools `grants` name (exact names, and `<server>.*` for all of an
    /// MCP server's), with descriptions and input schemas, sorted by name.
    /// An MCP server that cannot be listed now is left out (and logged):
    /// its tools are offered again once it answers.
    pub async fn list(&self, grants: &[String]) -> Vec<ToolInfo> {
        self.list_reporting(grants).await.0
    }

    /// What a plugin of `tenant` may be granted and call here (`GET
    /// /v1/tools`): the host's own tools and each admitted MCP server's, as
    /// [`ToolRegistry::list`] answers a guest granted all of them; and the
    /// MCP servers that cannot be listed now (their tools are missing until
    /// they answer).
    pub async fn available(&self, tenant: &str) -> (Vec<ToolInfo>, Vec<String>) {
        let mut grants: Vec<String> = self.tools.keys().filter(|n| self.admits(n, tenant)).cloned().collect();
        grants.extend(self.mcp.keys().filter(|s| self.admits(s, tenant)).map(|s| format!("{s}.*")));
        let (tools, mut down) = self.list_reporting(&grants).await;
        down.sort();
        (tools, down)
    }

    /// What kind of tool `name` is: `model`, `wait`, `http`, `webhook`,
    /// `mcp` (`<server>.<tool>`) or `host` (one a test or a demo inserted).
    pub fn kind_of(&self, name: &str) -> &'static str {
        match name {
            LLM_TOOL => "model",
            WAIT_TOOL => "wait",
            HTTP_TOOL if self.tools.contains_key(HTTP_TOOL) => "http",
            _ if self.scopes.contains_key(name) && self.tools.contains_key(name) => "webhook",
            _ if !self.tools.contains_key(name) => "mcp",
            _ => "host",
        }
    }

    /// [`ToolRegistry::list`], and the MCP servers it could not list.
    async fn list_reporting(&self, grants: &[String]) -> (Vec<ToolInfo>, Vec<String>) {
        let mut out: Vec<ToolInfo> = Vec::new();
        let mut listed: HashMap<String, Option<Arc<Vec<mcp::McpTool>>>> = HashMap::new();
        for grant in grants {
            if let Some(tool) = self.tools.get(grant) {
                let (description, input_schema) = tool.describe();
                out.push(ToolInfo { name: grant.clone(), description, input_schema });
                continue;
            }
            let Some((server_name, pattern)) = grant.split_once('.') else { continue };
            let Some(server) = self.mcp.get(server_name) else { continue };
            if !listed.contains_key(server_name) {
                let tools = match server.tools().await {
                    Ok(tools) => Some(tools),
                    Err(e) => {
                        tracing::warn!(server = server_name, error = %self.secrets.redact(&e.to_string()), "an MCP server's tools cannot be listed now");
                        None
                    }
                };
                listed.insert(server_name.to_string(), tools);
            }
            let Some(Some(tools)) = listed.get(server_name) else { continue };
            for t in tools.iter().filter(|t| pattern == "*" || t.name == pattern) {
                out.push(ToolInfo {
                    name: format!("{server_name}.{}", t.name),
                    description: t.description.clone(),
                    input_schema: t.input_schema.clone(),
                });
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out.dedup_by(|a, b| a.name == b.name);
        let down = listed.into_iter().filter(|(_, tools)| tools.is_none()).map(|(server, _)| server).collect();
        (out, down)
    }

    /// The protocol version spoken with MCP server `server`, once connected.
    pub fn mcp_protocol(&self, server: &str) -> Option<String> {
        self.mcp.get(server)?.protocol()
    }

    /// Makes sure what `name`'s tool declares of itself is at hand (an MCP
    /// server's listing, for its annotations) before a decision that
    /// depends on it (re-sending after a crash, approval). A server that
    /// cannot be listed now leaves the tool as declaring nothing.
    pub async fn warm(&self, name: &str) {
        let Some((server, _)) = name.split_once('.') else { return };
        if let Some(server) = self.mcp.get(server) {
            if server.cached().is_none() {
                // Bounded: a server that does not answer is the call's to report.
                let _ = tokio::time::timeout(WARM_MAX, server.tools()).await;
            }
        }
    }

    /// `e` with every secret cut out of its message.
    fn redact_error(&self, e: HostError) -> HostError {
        if self.secrets.is_empty() {
            return e;
        }
        match e {
            HostError::Denied(m) => HostError::Denied(self.secrets.redact(&m)),
            HostError::Invalid(m) => HostError::Invalid(self.secrets.redact(&m)),
            HostError::Limit(m) => HostError::Limit(self.secrets.redact(&m)),
            HostError::ToolFailed(m) => HostError::ToolFailed(self.secrets.redact(&m)),
            HostError::Unavailable(m) => HostError::Unavailable(self.secrets.redact(&m)),
            other => other,
        }
    }

    /// Runs one call and returns the tool's JSON answer as text. Journals
    /// `tool_call_started` and `tool_call_finished` (outcome, duration and
    /// sizes, never the arguments or the answer); enforces the tool's timeout;
    /// drops the call and answers `Cancelled` when `cancelled` resolves. An
    /// unknown name is `Denied` before anything is journaled.
    pub async fn invoke(
        &self,
        call: ToolCall<'_>,
        sink: &dyn EventSink,
        cancelled: impl Future<Output = ()>,
    ) -> Result<String, HostError> {
        let tool = self
            .get(call.name)
            .ok_or_else(|| HostError::Denied(format!("no tool named {:?} on this host", call.name)))?;
        sink.event(TOOL_CALL_STARTED, json!({ "call_index": call.call_index, "name": call.name })).await?;
        let started = Instant::now();
        let limit = call.timeout_max.map_or(tool.timeout(), |max| max.min(tool.timeout()));
        let ended: Result<Value, (&str, HostError)> = tokio::select! {
            biased;
            () = cancelled => Err(("cancelled", HostError::Cancelled)),
            r = tokio::time::timeout(limit, tool.call(&call, sink)) => match r {
                Ok(Ok(answer)) => Ok(answer),
                Ok(Err(HostError::Cancelled)) => Err(("cancelled", HostError::Cancelled)),
                Ok(Err(e)) => Err(("error", self.redact_error(e))),
                Err(_) => {
                    let why = format!("tool {:?} did not answer within {} ms", call.name, limit.as_millis());
                    Err(("timeout", HostError::ToolFailed(why)))
                }
            },
        };
        let mut finished = json!({
            "call_index": call.call_index,
            "name": call.name,
            "duration_ms": u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        });
        if let Some(annotations) = tool.annotations() {
            finished["annotations"] = annotations;
        }
        let answer = match ended {
            Ok(answer) => {
                if call.name == LLM_TOOL {
                    // The run's token usage lives in the journal, call by call.
                    sink.usage(llm_tokens(&answer));
                    finished["usage"] = llm::usage_of(&answer);
                }
                // Secrets are cut out of the answer's strings, never out of
                // its JSON text: the answer stays valid JSON.
                let text = self.secrets.redact_value(answer).to_string();
                finished["outcome"] = json!("ok");
                finished["result_bytes"] = json!(text.len());
                Ok(text)
            }
            Err((outcome, e)) => {
                finished["outcome"] = json!(outcome);
                finished["result_bytes"] = json!(0);
                finished["error"] = json!(clip(&e.to_string(), JOURNAL_ERROR_BYTES_MAX));
                Err(e)
            }
        };
        sink.event(TOOL_CALL_FINISHED, finished).await?;
        answer
    }
}

/// Calls go only where configured: no redirects followed, no proxy from the
/// environment.
fn http_client() -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))
}

/// `s` cut to at most `max` bytes on a character boundary, marked when cut.
fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// A request error with its causes, without the URL (which may carry a
/// secret, and guests see these messages).
fn describe(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The body of an answer, or `None` when it is longer than `cap` (the rest
/// is never read).
async fn read_capped(mut resp: reqwest::Response, cap: usize) -> Result<Option<Vec<u8>>, reqwest::Error> {
    if resp.content_length().is_some_and(|n| n > cap as u64) {
        return Ok(None);
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        if body.len() + chunk.len() > cap {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body))
}

/// The start of an error answer's body, for a message a person can act on.
/// Guests and the journal see it, so the caller's `secrets` (a key, header
/// values) are cut out, in case the endpoint echoes the request.
async fn body_snippet(mut resp: reqwest::Response, secrets: &[&str]) -> String {
    let mut body = Vec::new();
    let read = async {
        while body.len() < BODY_SNIPPET_BYTES {
            match resp.chunk().await {
                Ok(Some(chunk)) => body.extend_from_slice(&chunk),
                _ => break,
            }
        }
    };
    // An error body that trickles must not hold the error back.
    let _ = tokio::time::timeout(Duration::from_secs(2), read).await;
    let mut text = String::from_utf8_lossy(&body).into_owned();
    for secret in secrets.iter().filter(|s| s.len() >= 4) {
        text = text.replace(secret, "<redacted>");
    }
    match text.trim() {
        "" => String::new(),
        t => format!(": {}", clip(t, BODY_SNIPPET_BYTES)),
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use std::net::SocketAddr;
    use std::sync::Mutex;

    use tokio::sync::mpsc;

    use super::*;

    /// Collects what a tool streams; `deltas_to` also reports each delta as
    /// it arrives, so a test can pace a server on it.
    #[derive(Default)]
    pub struct Collect {
        pub deltas: Mutex<Vec<String>>,
        pub events: Mutex<Vec<(String, Value)>>,
        pub deltas_to: Option<mpsc::UnboundedSender<String>>,
    }

    impl Collect {
        pub fn deltas(&self) -> Vec<String> {
            self.deltas.lock().unwrap().clone()
        }

        pub fn events(&self) -> Vec<(String, Value)> {
            self.events.lock().unwrap().clone()
        }

        /// The payload of the one `tool_call_finished` event.
        pub fn finished(&self) -> Value {
            let events = self.events();
            let mut finished = events.iter().filter(|(k, _)| k == "tool_call_finished");
            let (_, payload) = finished.next().expect("a tool_call_finished event");
            assert!(finished.next().is_none(), "one tool_call_finished event: {events:?}");
            payload.clone()
        }
    }

    #[async_trait]
    impl EventSink for Collect {
        async fn delta(&self, text: &str) -> Result<(), HostError> {
            self.deltas.lock().unwrap().push(text.to_string());
            if let Some(tx) = &self.deltas_to {
                let _ = tx.send(text.to_string());
            }
            Ok(())
        }

        async fn event(&self, kind: &str, payload: Value) -> Result<(), HostError> {
            self.events.lock().unwrap().push((kind.to_string(), payload));
            Ok(())
        }
    }

    /// Serves `router` on a fresh loopback port for the rest of the test.
    pub async fn serve(router: axum::Router) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        addr
    }

    pub fn call(name: &str, args: Value) -> ToolCall<'_> {
        ToolCall {
            run_id: RunId::new(),
            call_index: 7,
            name,
            args,
            timeout_max: None,
            tenant: None,
            may_suspend: false,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    /// An address nothing listens on (bound, then released).
    pub(crate) fn closed_address() -> std::net::SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    }

    use std::sync::atomic::{AtomicBool, Ordering};

    use tokio::sync::Notify;

    use super::test_support::{call, Collect};
    use super::*;

    /// What a test sees of a [`Parrot`] call: that it started, and that it was dropped.
    #[derive(Default)]
    struct Probe {
        started: Notify,
        dropped: AtomicBool,
    }

    /// Alive while a call runs.
    struct Started<'a>(&'a Probe);

    impl Drop for Started<'_> {
        fn drop(&mut self) {
            self.0.dropped.store(true, Ordering::SeqCst);
        }
    }

    /// Answers its arguments back, fails when asked to, or never answers.
    struct Parrot(Arc<Probe>);

    #[async_trait]
    impl Tool for Parrot {
        async fn call(&self, call: &ToolCall<'_>, _sink: &dyn EventSink) -> Result<Value, HostError> {
            let _started = Started(&self.0);
            self.0.started.notify_one();
            match call.args.get("fail").and_then(Value::as_str) {
                Some(why) => Err(HostError::ToolFailed(why.to_string())),
                None if call.args.get("hang").is_some() => std::future::pending().await,
                None => Ok(json!({ "said": call.args })),
            }
        }

        fn timeout(&self) -> Duration {
            Duration::from_millis(100)
        }
    }

    fn registry() -> (ToolRegistry, Arc<Probe>) {
        let probe = Arc::new(Probe::default());
        let mut r = ToolRegistry::default();
        r.insert("parrot", Arc::new(Parrot(probe.clone())));
        (r, probe)
    }

    #[tokio::test]
    async fn an_unknown_tool_is_denied_before_anything_is_journaled() {
        let (r, _) = registry();
        let sink = Collect::default();
        let e = r.invoke(call("nope", json!({})), &sink, std::future::pending()).await.unwrap_err();
        assert_eq!(e, HostError::Denied("no tool named \"nope\" on this host".into()));
        assert!(sink.events().is_empty());
    }

    /// One call of the parrot with `args`, never cancelled: its answer and what it journaled.
    async fn parrot(args: Value) -> (Result<String, HostError>, Collect) {
        let (r, _) = registry();
        let sink = Collect::default();
        (r.invoke(call("parrot", args), &sink, std::future::pending()).await, sink)
    }

    #[tokio::test]
    async fn a_call_is_journaled_started_and_finished_without_its_payloads() {
        let secret = "x".repeat(2000);
        let (answer, sink) = parrot(json!({ "text": secret })).await;
        let answer = answer.unwrap();
        assert_eq!(serde_json::from_str::<Value>(&answer).unwrap(), json!({ "said": { "text": secret } }));
        let events = sink.events();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0], ("tool_call_started".to_string(), json!({ "call_index": 7, "name": "parrot" })));
        let finished = sink.finished();
        assert_eq!(finished["outcome"], "ok");
        assert_eq!(finished["call_index"], 7);
        assert_eq!(finished["name"], "parrot");
        assert_eq!(finished["result_bytes"], answer.len());
        assert!(finished["duration_ms"].is_u64());
        assert!(events.iter().all(|(_, p)| !p.to_string().contains("xxxx")), "no payloads in the journal: {events:?}");
    }

    #[tokio::test]
    async fn a_failure_is_journaled_with_a_bounded_error() {
        let why = "é".repeat(1000);
        let (answer, sink) = parrot(json!({ "fail": why })).await;
        let e = answer.unwrap_err();
        assert_eq!(e, HostError::ToolFailed(why));
        let finished = sink.finished();
        assert_eq!(finished["outcome"], "error");
        let error = finished["error"].as_str().unwrap();
        assert!(error.starts_with("tool failed: éé") && error.ends_with('…') && error.len() <= 504, "{error}");
    }

    #[tokio::test]
    async fn a_call_past_its_timeout_is_dropped() {
        let (r, probe) = registry();
        let sink = Collect::default();
        let e = r.invoke(call("parrot", json!({ "hang": true })), &sink, std::future::pending()).await.unwrap_err();
        assert_eq!(e, HostError::ToolFailed("tool \"parrot\" did not answer within 100 ms".into()));
        assert_eq!(sink.finished()["outcome"], "timeout");
        assert!(probe.dropped.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn a_cancel_drops_the_call_in_flight_and_is_journaled() {
        let (r, probe) = registry();
        let sink = Collect::default();
        let cancelled = probe.started.notified();
        let e = r.invoke(call("parrot", json!({ "hang": true })), &sink, cancelled).await.unwrap_err();
        assert_eq!(e, HostError::Cancelled);
        assert!(probe.dropped.load(Ordering::SeqCst));
        let finished = sink.finished();
        assert_eq!(finished["outcome"], "cancelled");
        assert_eq!(finished["error"], "cancelled: a stop was requested");
    }

    #[tokio::test]
    async fn a_cancel_already_requested_wins_over_a_ready_answer() {
        let (r, _) = registry();
        let sink = Collect::default();
        let e = r.invoke(call("parrot", json!({})), &sink, std::future::ready(())).await.unwrap_err();
        assert_eq!(e, HostError::Cancelled);
        assert_eq!(sink.finished()["outcome"], "cancelled");
    }

    /// Issue 40: the operator's tools are the operator's to give. A tenant's
    /// own plugin may use a webhook, an MCP server or an `http` rule only
    /// when its `tenants` admit the tenant (or the host's default does);
    /// the host's own tools are every tenant's.
    #[test]
    fn operator_tools_admit_only_the_tenants_they_name() {
        let text = r#"
            [[webhook]]
            name = "crm"
            url = "http://127.0.0.1:1/crm"
            tenants = ["acme"]
            [[webhook]]
            name = "ops"
            url = "http://127.0.0.1:1/ops"
            [[mcp]]
            name = "py"
            url = "http://127.0.0.1:1/mcp"
            tenants = ["*"]
            [[http]]
            url = "https://api.example"
            tenants = ["acme"]
        "#;
        let lookup = |_: &str| None;
        let llm = LlmConfig { model: "m".into(), ..LlmConfig::default() };
        let mut file = parse_tools_file_with(text, &lookup).unwrap();
        let r = ToolRegistry::from_tools(&llm, &file).unwrap();
        for (grant, tenant, admitted) in [
            ("crm", "acme", true),
            ("crm", "evil", false),
            ("ops", "acme", false),
            ("py.echo", "evil", true),
            ("py.*", "evil", true),
            ("http", "acme", true),
            ("http", "evil", false),
            (LLM_TOOL, "evil", true),
            (WAIT_TOOL, "evil", true),
        ] {
            assert_eq!(r.admits(grant, tenant), admitted, "{grant} for {tenant}");
        }
        file.tenants_default_all = true;
        let r = ToolRegistry::from_tools(&llm, &file).unwrap();
        assert!(r.admits("ops", "evil"), "--tenant-tools all");
        assert!(!r.admits("crm", "evil"), "a named list still holds");
    }

    /// Issue 40: the model's API key is redacted like every other secret.
    #[test]
    fn the_model_api_key_is_a_secret() {
        let llm = LlmConfig {
            base_url: Some("http://127.0.0.1:1/v1".into()),
            api_key: Some("sk-the-model-key-123".into()),
            model: "m".into(),
            timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(1),
        };
        let r = ToolRegistry::from_tools(&llm, &ToolsConfig::default()).unwrap();
        let said = r.secrets.redact("the upstream said: bad key sk-the-model-key-123");
        assert_eq!(said, "the upstream said: bad key <redacted>");
    }

    #[test]
    fn from_config_always_has_llm_and_refuses_clashes() {
        let llm = LlmConfig {
            base_url: None,
            api_key: None,
            model: "m".into(),
            timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(1),
        };
        let hook = |name: &str| WebhookConfig {
            name: name.into(),
            url: "http://127.0.0.1:1/".into(),
            timeout_ms: 1000,
            max_response_bytes: 1000,
            headers: Default::default(),
            description: None,
            idempotent: false,
            approval: None,
            tenants: None,
            retry: None,
        };
        let r = ToolRegistry::from_config(&llm, &[hook("a"), hook("b")]).unwrap();
        assert_eq!(r.names(), ["a", "b", "llm", "wait"]);
        let e = ToolRegistry::from_config(&llm, &[hook("a"), hook("a")]).err().unwrap();
        assert!(e.contains("taken"), "{e}");
        let e = ToolRegistry::from_config(&llm, &[hook("llm")]).err().unwrap();
        assert!(e.contains("model tool"), "{e}");
        let e = ToolRegistry::from_config(&llm, &[hook("wait")]).err().unwrap();
        assert!(e.contains("durable wait"), "{e}");
        let https = LlmConfig { base_url: Some("https://api.example.com/v1".into()), ..llm.clone() };
        assert_eq!(ToolRegistry::from_config(&https, &[]).unwrap().names(), ["llm", "wait"]);
        let http = LlmConfig { base_url: Some("http://127.0.0.1:1/v1".into()), ..llm };
        assert_eq!(ToolRegistry::from_config(&http, &[]).unwrap().names(), ["llm", "wait"]);
    }
}
