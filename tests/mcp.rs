//! MCP servers as tool providers, against two third-party servers on
//! loopback installed from the registries by scripts/test: the `mcp` Python
//! SDK's FastMCP server (tests/mcp/py_server.py) and
//! @modelcontextprotocol/server-everything (npm) in Streamable HTTP mode.
//! Listing, calls, error results, a slow tool cut by its timeout and by a
//! stop (the server sees the cancellation), a server that goes away and
//! comes back, `chat` offering granted MCP tools to the offline model, and
//! an ungranted MCP tool refused.

use std::sync::Arc;
use std::time::Duration;

use crate::support::http::TestHost;
use crate::support::mcp_servers::McpServerProcess;
use crate::support::tools::{tools_file, Sink};
use crate::support::*;
use agent_host::agent::{Agent, AgentError, AgentRegistry, RunHost, RunInput};
use agent_host::db::{plugins, RunId};
use agent_host::error::HostError;
use agent_host::hub::Hub;
use agent_host::run::manifest::Manifest;
use agent_host::sandbox::Sandbox;
use agent_host::tools::{LlmConfig, McpApproval, McpConfig, ToolCall, ToolRegistry, ToolsConfig};
use async_trait::async_trait;
use serde_json::{json, Value};

fn mcp(name: &str, url: &str, timeout_ms: u64, trusted: bool) -> McpConfig {
    let text = format!(
        "[[mcp]]\nname = \"{name}\"\nurl = \"{url}\"\ntimeout_ms = {timeout_ms}\ntrusted = {trusted}\n\
         headers = {{ X-Test = \"yes\" }}\n"
    );
    tools_file(&text, &[]).mcp.into_iter().next().unwrap()
}

fn registry(servers: Vec<McpConfig>) -> ToolRegistry {
    let file = ToolsConfig { mcp: servers, ..Default::default() };
    ToolRegistry::from_tools(&LlmConfig::default(), &file).unwrap()
}

async fn call(r: &ToolRegistry, name: &str, args: Value) -> (Result<Value, HostError>, Value) {
    let sink = Sink::default();
    let c = ToolCall {
        run_id: RunId::new(),
        call_index: 1,
        name,
        args,
        timeout_max: None,
        tenant: None,
        may_suspend: false,
    };
    let answer = r.invoke(c, &sink, std::future::pending()).await;
    (answer.map(|a| serde_json::from_str(&a).unwrap()), sink.finished())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_servers_list_and_call_their_tools() {
    let py = McpServerProcess::python(None, None).await;
    let everything = McpServerProcess::everything().await;
    let r = registry(vec![mcp("py", &py.url(), 10_000, true), mcp("ev", &everything.url(), 10_000, false)]);

    // Listing: descriptions and schemas as the servers declare them.
    let grants: Vec<String> = ["py.*", "ev.echo", "llm"].iter().map(|s| s.to_string()).collect();
    let listed = r.list(&grants).await;
    let names: Vec<&str> = listed.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        ["ev.echo", "llm", "py.add_late", "py.echo", "py.fail", "py.ping", "py.slow", "py.weather"],
        "{listed:?}"
    );
    let echo = listed.iter().find(|t| t.name == "py.echo").unwrap();
    assert_eq!(echo.description.as_deref(), Some("Answers its input back"));
    assert_eq!(echo.input_schema["properties"]["input"]["type"], "string", "{:?}", echo.input_schema);
    // Each server speaks the protocol it offers: the Python SDK the
    // stateless 2026-07-28, server-everything 2025-11-25 with initialize.
    assert_eq!(r.mcp_protocol("py").as_deref(), Some("2026-07-28"));
    assert_eq!(r.mcp_protocol("ev").as_deref(), Some("2025-11-25"));
    let ev_echo = listed.iter().find(|t| t.name == "ev.echo").unwrap();
    assert_eq!(ev_echo.input_schema["properties"]["message"]["type"], "string");

    // Text content answers as a string; structured content as itself.
    let (answer, finished) = call(&r, "py.echo", json!({ "input": "hi" })).await;
    assert_eq!(answer.unwrap(), json!("echo: hi"));
    assert_eq!(finished["outcome"], "ok");
    assert_eq!(
        finished["annotations"],
        json!({ "server": "py", "trusted": true, "declared": { "readOnlyHint": true } })
    );
    let (answer, _) = call(&r, "py.weather", json!({ "city": "Lyon" })).await;
    assert_eq!(answer.unwrap(), json!({ "city": "Lyon", "sky": "clear", "celsius": 21 }));
    let (answer, finished) = call(&r, "ev.echo", json!({ "message": "bonjour" })).await;
    assert_eq!(answer.unwrap(), json!("Echo: bonjour"));
    assert_eq!(finished["annotations"]["trusted"], false);
    let (answer, _) = call(&r, "ev.get-structured-content", json!({ "location": "New York" })).await;
    let answer = answer.unwrap();
    assert!(answer.get("temperature").is_some(), "{answer}");

    // A tool error result is a failed call with its text.
    let (answer, finished) = call(&r, "py.fail", json!({ "why": "the sky fell" })).await;
    let Err(HostError::ToolFailed(m)) = answer else { panic!("{answer:?}") };
    assert!(m.starts_with("py.fail: ") && m.contains("it failed because the sky fell"), "{m:?}");
    assert_eq!(finished["outcome"], "error");

    // Names the servers do not list, and arguments that are not an object.
    let (answer, _) = call(&r, "py.nope", json!({})).await;
    assert_eq!(answer.unwrap_err(), HostError::Denied("MCP server \"py\" lists no tool \"nope\"".into()));
    let (answer, _) = call(&r, "py.echo", json!([1])).await;
    assert!(matches!(answer, Err(HostError::Invalid(_))), "{answer:?}");
    assert!(r.get("nobody.echo").is_none());

    // Trusted annotations feed re-sending after a crash; untrusted ones do not.
    assert!(r.get("py.echo").unwrap().idempotent(), "read-only on a trusted server");
    assert!(r.get("py.weather").unwrap().idempotent(), "idempotent on a trusted server");
    assert!(!r.get("py.slow").unwrap().idempotent());
    assert!(!r.get("ev.echo").unwrap().idempotent(), "the everything server is not trusted");

    // And the approval rule `approval = "destructive"`: a trusted server's
    // read-only tool runs at once; one not declared harmless waits; every
    // tool of an untrusted server waits.
    let mut py_cfg = mcp("py", &py.url(), 10_000, true);
    py_cfg.approval = McpApproval::Destructive;
    let mut ev_cfg = mcp("ev", &everything.url(), 10_000, false);
    ev_cfg.approval = McpApproval::Destructive;
    let r = registry(vec![py_cfg, ev_cfg]);
    r.list(&["py.*".to_string(), "ev.*".to_string()]).await;
    assert!(!r.get("py.echo").unwrap().requires_approval());
    assert!(r.get("py.slow").unwrap().requires_approval());
    assert!(r.get("py.weather").unwrap().requires_approval(), "not declared non-destructive");
    assert!(r.get("ev.echo").unwrap().requires_approval(), "untrusted: its read-only hint is not believed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_list_is_listed_again_after_its_ttl() {
    let py = McpServerProcess::python(None, None).await;
    let mut config = mcp("py", &py.url(), 10_000, false);
    config.list_ttl_ms = 300;
    let r = registry(vec![config]);
    let grants = ["py.*".to_string()];
    assert!(!r.list(&grants).await.iter().any(|t| t.name == "py.late"));
    let (answer, _) = call(&r, "py.late", json!({})).await;
    assert_eq!(answer.unwrap_err(), HostError::Denied("MCP server \"py\" lists no tool \"late\"".into()));
    assert_eq!(call(&r, "py.add_late", json!({})).await.0.unwrap(), json!("added"));
    // Cached until the TTL runs out, then listed again: the new tool appears.
    let r2 = &r;
    let grants = &grants;
    wait_for("the new tool to be listed", Duration::from_secs(10), || async move {
        r2.list(grants).await.iter().any(|t| t.name == "py.late")
    })
    .await;
    assert_eq!(call(&r, "py.late", json!({ "input": "x" })).await.0.unwrap(), json!("late: x"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_tool_is_cut_by_its_timeout_and_the_server_sees_the_cancellation() {
    let py = McpServerProcess::python(None, None).await;
    let r = registry(vec![mcp("py", &py.url(), 1_500, false)]);
    let (answer, finished) = call(&r, "py.slow", json!({ "seconds": 30 })).await;
    assert_eq!(answer.unwrap_err(), HostError::ToolFailed("tool \"py.slow\" did not answer within 1500 ms".into()));
    assert_eq!(finished["outcome"], "timeout");
    py.wait_note("cancelled 30.0", Duration::from_secs(10)).await;
    assert!(!py.notes().contains(&"finished 30.0".to_string()));
    // The connection is still good for the next call.
    assert_eq!(call(&r, "py.echo", json!({ "input": "after" })).await.0.unwrap(), json!("echo: after"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_goes_away_fails_only_its_calls_and_is_used_again_when_back() {
    let mut py = McpServerProcess::python(None, None).await;
    let everything = McpServerProcess::everything().await;
    let port = py.port;
    let events = py.events.clone();
    let r = registry(vec![mcp("py", &py.url(), 5_000, false), mcp("ev", &everything.url(), 5_000, false)]);
    assert_eq!(call(&r, "py.echo", json!({ "input": "one" })).await.0.unwrap(), json!("echo: one"));

    py.kill().await;
    let (answer, finished) = call(&r, "py.echo", json!({ "input": "two" })).await;
    let Err(HostError::ToolFailed(m)) = answer else { panic!("{answer:?}") };
    assert!(m.starts_with("MCP server \"py\""), "{m}");
    assert_eq!(finished["outcome"], "error");
    // The other server and the host's own tools are untouched.
    assert_eq!(call(&r, "ev.echo", json!({ "message": "still" })).await.0.unwrap(), json!("Echo: still"));
    let model = call(&r, "llm", json!({ "messages": [{ "role": "user", "content": "hi" }] })).await.0.unwrap();
    assert_eq!(model["content"], "Offline reply to: hi");
    // Listing does not fail: the absent server's tools come from its cached list.
    let listed = r.list(&["py.echo".to_string(), "ev.echo".to_string()]).await;
    assert_eq!(listed.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["ev.echo", "py.echo"]);

    // Back on the same address: the next call connects again.
    let _py = McpServerProcess::python(Some(port), Some(events)).await;
    assert_eq!(call(&r, "py.echo", json!({ "input": "three" })).await.0.unwrap(), json!("echo: three"));
}

/// A built-in agent that makes the calls its config names, in order, and
/// answers what each gave, with what `list-tools` said first.
struct Caller;

#[async_trait]
impl Agent for Caller {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        let listed: Vec<String> = host.list_tools().await?.into_iter().map(|t| t.name).collect();
        let mut answers = Vec::new();
        for c in input.config["calls"].as_array().cloned().unwrap_or_default() {
            let name = c["name"].as_str().unwrap_or_default();
            match host.call_tool(name, &c["args"].to_string()).await {
                Ok(a) => answers.push(json!({ "ok": serde_json::from_str::<Value>(&a).unwrap() })),
                Err(HostError::Cancelled) => return Err(HostError::Cancelled.into()),
                Err(e) => answers.push(json!({ "error": e.to_string() })),
            }
        }
        Ok(json!({ "listed": listed, "answers": answers }).to_string())
    }
}

struct Env {
    db: TestDb,
    host: TestHost,
}

impl Env {
    async fn new(servers: Vec<McpConfig>, chat_grants: &[&str]) -> Env {
        let db = TestDb::new().await;
        let cache = std::env::temp_dir().join(format!("agent-host-cache-{}", std::process::id()));
        let sandbox = Sandbox::new(db.pool.clone(), Some(cache)).unwrap();
        plugins::put(&db.pool, "chat", &plugin_wasm("chat"), &json!({ "tools": chat_grants })).await.unwrap();
        for example in ["chat-python", "chat-js"] {
            plugins::put(&db.pool, example, &example_wasm(example), &json!({ "tools": chat_grants })).await.unwrap();
        }
        let mut agents = AgentRegistry::with_builtins().with_sandbox(sandbox).with_tools(registry(servers));
        let granted = Manifest::parse(&json!({ "tools": ["py.echo", "py.slow"] })).unwrap();
        agents.insert_with_manifest("caller", Arc::new(Caller), granted);
        let limited = json!({ "tools": ["py.echo"], "limits": { "tool_calls_max": 2 } });
        agents.insert_with_manifest("limited", Arc::new(Caller), Manifest::parse(&limited).unwrap());
        let host = TestHost::start(&db, Some(Hub::start(db.url.clone())), agents, fast_config("w")).await;
        Env { db, host }
    }

    async fn run(&self, plugin: &str, content: &str, config: Value) -> RunId {
        self.host.post_run(plugin, content, config).await
    }

    async fn finish(&self, run: RunId) -> Value {
        self.host.ended(&self.db.pool, run).await
    }

    async fn answer(&self, run: RunId) -> String {
        sqlx::query_scalar("SELECT content FROM message WHERE run_id = $1 AND role = 'assistant'")
            .bind(run)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// (kind, name, outcome) of the run's tool-call events.
    async fn tool_events(&self, run: RunId) -> Vec<(String, String, String)> {
        journal_payloads(&self.db.pool, run)
            .await
            .into_iter()
            .filter(|(_, t, _)| t.starts_with("tool_call_"))
            .map(|(_, t, p)| (t, p["name"].as_str().unwrap().to_string(), p["outcome"].as_str().unwrap_or("").into()))
            .collect()
    }
}

fn ev(kind: &str, name: &str, outcome: &str) -> (String, String, String) {
    (kind.into(), name.into(), outcome.into())
}

/// Each SDK's `model_tools` (Rust, Python, JavaScript): `"tools": "granted"`
/// offers the model every granted tool but itself, an MCP server's under a
/// name a model takes, and the model's call of that name reaches the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_offers_the_granted_mcp_tools_to_the_model_and_completes_a_turn_that_used_one() {
    let py = McpServerProcess::python(None, None).await;
    let env = Env::new(vec![mcp("py", &py.url(), 10_000, false)], &["llm", "py.echo"]).await;
    for chat in ["chat", "chat-python", "chat-js"] {
        let run = env.run(chat, &format!("hello from {chat}"), json!({ "tools": "granted" })).await;
        let view = env.finish(run).await;
        assert_eq!(view["status"], "completed", "{chat}: {view}");
        // The offline model called the one tool it was offered (as `py_echo`:
        // a model's tool names have no dots), and quoted its answer.
        assert_eq!(
            env.answer(run).await,
            format!("Offline reply to: hello from {chat} Tool py_echo said: echo: hello from {chat}"),
        );
        assert_eq!(
            env.tool_events(run).await,
            [
                ev("tool_call_started", "llm", ""),
                ev("tool_call_finished", "llm", "ok"),
                ev("tool_call_started", "py.echo", ""),
                ev("tool_call_finished", "py.echo", "ok"),
                ev("tool_call_started", "llm", ""),
                ev("tool_call_finished", "llm", "ok"),
            ],
            "{chat}"
        );
    }
    assert_eq!(py.notes(), ["echo hello from chat", "echo hello from chat-python", "echo hello from chat-js"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ungranted_mcp_tool_is_denied_and_a_stop_cancels_the_call_on_the_server() {
    let py = McpServerProcess::python(None, None).await;
    let env = Env::new(vec![mcp("py", &py.url(), 60_000, false)], &["llm"]).await;

    // Granted py.echo and py.slow: list-tools says so; py.weather is refused
    // before the server sees anything.
    let calls = json!([
        { "name": "py.weather", "args": { "city": "Lyon" } },
        { "name": "py.echo", "args": { "input": "granted" } },
    ]);
    let run = env.run("caller", "go", json!({ "calls": calls })).await;
    assert_eq!(env.finish(run).await["status"], "completed");
    let answer: Value = serde_json::from_str(&env.answer(run).await).unwrap();
    assert_eq!(answer["listed"], json!(["py.echo", "py.slow"]));
    assert_eq!(
        answer["answers"],
        json!([
            { "error": "denied: tool \"py.weather\" is not granted to this plugin" },
            { "ok": "echo: granted" },
        ])
    );
    assert_eq!(env.tool_events(run).await.iter().filter(|e| e.1 == "py.weather").count(), 0);

    // A stop while the slow tool runs: the run ends cancelled and the server
    // sees the cancellation of its request.
    let run = env.run("caller", "go", json!({ "calls": [{ "name": "py.slow", "args": { "seconds": 45 } }] })).await;
    py.wait_note("started 45.0", LONG).await;
    let (code, v) = env.host.call("POST", &format!("/v1/runs/{run}/cancel"), None).await;
    assert!(code.is_success(), "{code} {v}");
    let view = env.finish(run).await;
    assert_eq!(view["status"], "cancelled", "{view}");
    py.wait_note("cancelled 45.0", Duration::from_secs(10)).await;
    assert_eq!(
        env.tool_events(run).await,
        [ev("tool_call_started", "py.slow", ""), ev("tool_call_finished", "py.slow", "cancelled")]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_goes_away_mid_run_fails_the_calls_that_need_it_and_the_next_run_uses_it_again() {
    let mut py = McpServerProcess::python(None, None).await;
    let (port, events) = (py.port, py.events.clone());
    let env = Env::new(vec![mcp("py", &py.url(), 10_000, false)], &["llm"]).await;
    let calls = json!([
        { "name": "py.slow", "args": { "seconds": 45 } },
        { "name": "py.echo", "args": { "input": "while down" } },
    ]);
    let run = env.run("caller", "go", json!({ "calls": calls })).await;
    py.wait_note("started 45.0", LONG).await;
    py.kill().await;
    // The run is not stuck on the server: both calls fail, and it completes.
    let view = env.finish(run).await;
    assert_eq!(view["status"], "completed", "{view}");
    let answer: Value = serde_json::from_str(&env.answer(run).await).unwrap();
    let answers = answer["answers"].as_array().unwrap();
    assert_eq!(answers.len(), 2, "{answer}");
    for a in answers {
        let e = a["error"].as_str().unwrap_or_default();
        assert!(e.starts_with("tool failed: "), "{answer}");
    }
    // Back on the same address: the next run's call reaches it.
    let _py = McpServerProcess::python(Some(port), Some(events)).await;
    let run = env.run("caller", "go", json!({ "calls": [{ "name": "py.echo", "args": { "input": "back" } }] })).await;
    assert_eq!(env.finish(run).await["status"], "completed");
    let answer: Value = serde_json::from_str(&env.answer(run).await).unwrap();
    assert_eq!(answer["answers"], json!([{ "ok": "echo: back" }]));
}

/// A resumed run replays its listing and its MCP call from the call log:
/// the server (still up) is asked nothing more after the crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_run_replays_its_mcp_listing_and_call_without_asking_the_server() {
    use crate::support::durable::{start_following, Env as Durable, ModelLog};
    // Request 1 asks for py.ping; 2 (after its result) stalls; 3 answers.
    fn script(n: usize, _has_result: bool) -> (Vec<&'static str>, Option<&'static str>, bool) {
        match n {
            1 => (vec!["Pinging. "], Some("py_ping"), false),
            2 => (vec!["Thinking ", "cut"], None, true),
            _ => (vec!["Pinged."], None, false),
        }
    }
    let py = McpServerProcess::python(None, None).await;
    let models = ModelLog::default();
    let llm = format!("{}/v1", crate::support::durable::scripted_model(models.clone(), script).await);
    let env = Durable::new("chat", "chat", &["llm", "py.*"], true, &["--llm-base-url", &llm]).await;
    // The env's tools file, with the server added.
    let at = env.args.iter().position(|a| a == "--tools-file").unwrap();
    let tools_file = std::path::PathBuf::from(&env.args[at + 1]);
    let mut text = std::fs::read_to_string(&tools_file).unwrap();
    text.push_str(&format!("\n[[mcp]]\nname = \"py\"\nurl = \"{}\"\n", py.url()));
    std::fs::write(&tools_file, text).unwrap();

    let a = env.spawn("A");
    let hosts = Arc::new(std::sync::Mutex::new(vec![a.addr.clone()]));
    let run = env.post(&a, "chat", "ping it", json!({ "tools": "granted" })).await;
    let client = start_following(&env, &hosts, run);
    let pool = env.db.pool.clone();
    wait_for("the second model answer to stall", LONG, || {
        let pool = pool.clone();
        async move { deltas_text(&journal_payloads(&pool, run).await).contains("cut") }
    })
    .await;
    a.signal(nix::sys::signal::Signal::SIGKILL);
    let requests_before = py.log().matches("POST /mcp").count();
    assert!(requests_before > 0, "the server's log shows no requests: {}", py.log());
    let b = env.spawn("B");
    hosts.lock().unwrap().push(b.addr.clone());
    client.await.unwrap();

    let view = env.view(&b, run).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["attempt"], 2, "{view}");
    assert_eq!(env.assistant(run).await, "Pinged.");
    // One ping, by attempt 1; attempt 2 sent the server no request at all.
    assert_eq!(py.notes(), ["ping"]);
    assert_eq!(py.log().matches("POST /mcp").count(), requests_before, "{}", py.log());
    assert_eq!(models.lock().unwrap().len(), 3);
}

/// An answer past the server's `max_response_bytes` is `tool failed`, named;
/// a smaller one of the same tool answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_past_max_response_bytes_is_refused_with_its_reason() {
    let py = McpServerProcess::python(None, None).await;
    let text = format!("[[mcp]]\nname = \"py\"\nurl = \"{}\"\nmax_response_bytes = 200\n", py.url());
    let r = registry(tools_file(&text, &[]).mcp);
    let (answer, _) = call(&r, "py.echo", json!({ "input": "short" })).await;
    assert_eq!(answer.unwrap(), json!("echo: short"));
    let (answer, finished) = call(&r, "py.echo", json!({ "input": "x".repeat(1000) })).await;
    match answer {
        Err(HostError::ToolFailed(m)) => assert!(m.contains("py") && m.contains("200"), "{m}"),
        other => panic!("not tool failed: {other:?}"),
    }
    assert_eq!(finished["outcome"], "error", "{finished}");
}

/// A run's calls past its manifest's `tool_calls_max` fail it with the limit
/// named; the calls within it reached the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_past_the_run_s_tool_calls_max_fail_the_run() {
    let py = McpServerProcess::python(None, None).await;
    let env = Env::new(vec![mcp("py", &py.url(), 10_000, false)], &["llm"]).await;
    let calls: Vec<Value> =
        (0..3).map(|i| json!({ "name": "py.echo", "args": { "input": format!("n{i}") } })).collect();
    let run = env.run("limited", "go", json!({ "calls": calls })).await;
    let view = env.finish(run).await;
    assert_eq!(view["status"], "failed", "{view}");
    assert!(view.to_string().contains("more than 2 tool calls"), "{view}");
    assert_eq!(py.notes(), ["echo n0", "echo n1"]);
}

/// What the host sent a server, JSON-RPC message by message.
type Wire = Arc<std::sync::Mutex<Vec<Value>>>;

/// A pass-through in front of a server that keeps every JSON body the host
/// sends it: its URL and what it saw.
async fn wire_tap(upstream: String) -> (String, Wire) {
    use axum::body::{Body, Bytes};
    use axum::extract::State;
    use axum::http::{HeaderMap, Method};
    use axum::response::Response;
    async fn forward(
        State((upstream, wire)): State<(String, Wire)>,
        method: Method,
        headers: HeaderMap,
        body: Bytes,
    ) -> Response {
        if let Ok(v) = serde_json::from_slice::<Value>(&body) {
            wire.lock().unwrap().push(v);
        }
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let mut req = client.request(method, &upstream).body(body);
        for (k, v) in headers.iter().filter(|(k, _)| *k != "host" && *k != "content-length") {
            req = req.header(k, v);
        }
        let resp = req.send().await.unwrap();
        let mut out = Response::builder().status(resp.status());
        for (k, v) in resp.headers().iter().filter(|(k, _)| *k != "content-length" && *k != "transfer-encoding") {
            out = out.header(k, v);
        }
        out.body(Body::from_stream(resp.bytes_stream())).unwrap()
    }
    let wire = Wire::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/mcp", listener.local_addr().unwrap());
    let router = axum::Router::new().route("/mcp", axum::routing::any(forward)).with_state((upstream, wire.clone()));
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (url, wire)
}

/// Under 2025-11-25 (server-everything), a stop during a call sends the
/// server `notifications/cancelled` naming that call's request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_sends_notifications_cancelled_under_2025_11_25() {
    let everything = McpServerProcess::everything().await;
    let (url, wire) = wire_tap(everything.url()).await;
    let r = registry(vec![mcp("ev", &url, 60_000, false)]);
    let sink = Sink::default();
    let args = json!({ "duration": 30, "steps": 30 });
    let c = ToolCall {
        run_id: RunId::new(),
        call_index: 1,
        name: "ev.trigger-long-running-operation",
        args,
        timeout_max: None,
        tenant: None,
        may_suspend: false,
    };
    let call_id = || {
        let wire = wire.lock().unwrap();
        wire.iter().find(|m| m["method"] == "tools/call").map(|m| m["id"].clone())
    };
    // The stop comes once the server has the call.
    let stop = async {
        wait_for("the tools/call to reach the server", LONG, || async { call_id().is_some() }).await;
    };
    let answer = r.invoke(c, &sink, stop).await;
    assert_eq!(answer.unwrap_err(), HostError::Cancelled);
    assert_eq!(r.mcp_protocol("ev").as_deref(), Some("2025-11-25"));
    let id = call_id().unwrap();
    wait_for("notifications/cancelled for the call", Duration::from_secs(10), || async {
        let wire = wire.lock().unwrap();
        wire.iter().any(|m| m["method"] == "notifications/cancelled" && m["params"]["requestId"] == id)
    })
    .await;
    assert_eq!(sink.finished()["outcome"], "cancelled");
}

/// Issue 46: an MCP server's retry policy tries a call that never reached
/// the server again (it could not be connected to), journaling each retried
/// attempt as `tool_attempt`, then fails with the last error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_servers_retry_policy_tries_an_unsent_call_again() {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gone = closed.local_addr().unwrap();
    drop(closed);
    let text = format!(
        "[[mcp]]\nname = \"down\"\nurl = \"http://{gone}/mcp\"\nretry = {{ attempts = 3, backoff_ms = 1, backoff_max_ms = 2 }}\n"
    );
    let r = registry(tools_file(&text, &[]).mcp);
    let sink = Sink::default();
    let c = ToolCall {
        run_id: RunId::new(),
        call_index: 4,
        name: "down.echo",
        args: json!({}),
        timeout_max: None,
        tenant: None,
        may_suspend: false,
    };
    let e = r.invoke(c, &sink, std::future::pending()).await.unwrap_err();
    assert!(e.to_string().contains("MCP server \"down\""), "{e}");
    let attempts: Vec<Value> =
        sink.0.lock().unwrap().iter().filter(|(k, _)| k == "tool_attempt").map(|(_, p)| p.clone()).collect();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(attempts[1]["attempt"], 2);
    assert_eq!(attempts[0]["name"], "down.echo");
}
