//! Tools behind `call-tool`, end to end through the HTTP API: the `chat`
//! plugin's loop over the model and webhook tools, against real local HTTP
//! servers (a streaming chat-completions endpoint and a webhook receiver).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::http::TestHost;
use crate::support::*;
use agent_host::agent::AgentRegistry;
use agent_host::db::{plugins, RunId};
use agent_host::hub::Hub;
use agent_host::sandbox::Sandbox;
use agent_host::tools::{LlmConfig, ToolRegistry, WebhookConfig};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// What a local server received: headers of interest and the JSON body.
#[derive(Debug, Clone)]
struct Received {
    authorization: Option<String>,
    idempotency_key: Option<String>,
    body: Value,
}

type Log = Arc<Mutex<Vec<Received>>>;

fn received(headers: &HeaderMap, body: Value) -> Received {
    let h = |k: &str| headers.get(k).map(|v| v.to_str().unwrap().to_string());
    Received { authorization: h("authorization"), idempotency_key: h("idempotency-key"), body }
}

/// Serves `router` on a free local port; returns its base URL.
async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    base
}

/// A webhook receiver: `/ok` answers `{"forecast": "sunny"}`, `/fail` 500,
/// `/hang` never answers (and reports each arrival on `arrived`).
async fn webhook_receiver(log: Log, arrived: mpsc::UnboundedSender<()>) -> String {
    let ok = {
        let log = log.clone();
        move |headers: HeaderMap, Json(body): Json<Value>| async move {
            log.lock().unwrap().push(received(&headers, body));
            Json(json!({ "forecast": "sunny" }))
        }
    };
    let fail = |Json(_): Json<Value>| async { (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "boom") };
    // A careless receiver that echoes the request's credentials in its error.
    let echo_auth = |headers: HeaderMap| async move {
        let auth = headers.get("authorization").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
        (axum::http::StatusCode::UNAUTHORIZED, format!("bad credentials: {auth}"))
    };
    let hang = move |Json(_): Json<Value>| async move {
        let _ = arrived.send(());
        std::future::pending::<()>().await;
    };
    let routes = Router::new().route("/ok", post(ok)).route("/fail", post(fail)).route("/hang", post(hang));
    serve(routes.route("/echo-auth", post(echo_auth))).await
}

fn webhook(name: &str, url: String, timeout_ms: u64) -> WebhookConfig {
    let mut headers = std::collections::BTreeMap::new();
    headers.insert("Authorization".to_string(), "Bearer webhook-secret".to_string());
    WebhookConfig {
        name: name.into(),
        url,
        timeout_ms,
        max_response_bytes: 64 * 1024,
        headers,
        description: None,
        idempotent: false,
        approval: None,
        tenants: None,
        retry: None,
    }
}

fn offered(name: &str) -> Value {
    json!({ "name": name, "description": "looks things up", "parameters": { "type": "object" } })
}

struct Env {
    db: TestDb,
    host: TestHost,
}

impl Env {
    /// A host whose sandbox has `tools`, with `chat` registered under `name`
    /// for each (name, granted tools).
    async fn new(llm: LlmConfig, webhooks: &[WebhookConfig], chats: &[(&str, &[&str])]) -> Env {
        let db = TestDb::new().await;
        let cache = std::env::temp_dir().join(format!("agent-host-cache-{}", std::process::id()));
        let tools = ToolRegistry::from_config(&llm, webhooks).unwrap();
        let sandbox = Sandbox::new(db.pool.clone(), Some(cache)).unwrap();
        for (name, granted) in chats {
            plugins::put(&db.pool, name, &plugin_wasm("chat"), &json!({ "tools": granted })).await.unwrap();
        }
        let agents = AgentRegistry::with_builtins().with_sandbox(sandbox).with_tools(tools);
        let host = TestHost::start(&db, Some(Hub::start(db.url.clone())), agents, fast_config("w")).await;
        Env { db, host }
    }

    async fn run(&self, plugin: &str, content: &str, config: Value) -> RunId {
        self.host.post_run(plugin, content, config).await
    }

    async fn finish(&self, run: RunId) -> Value {
        self.host.ended(&self.db.pool, run).await
    }

    async fn answer(&self, run: RunId) -> (String, String) {
        sqlx::query_as("SELECT content, status FROM message WHERE run_id = $1 AND role = 'assistant'")
            .bind(run)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// The tool calls the journal shows: (kind, call_index, name, outcome).
    async fn tool_events(&self, run: RunId) -> Vec<(String, u64, String, String)> {
        journal_payloads(&self.db.pool, run)
            .await
            .into_iter()
            .filter(|(_, t, _)| t.starts_with("tool_call_"))
            .map(|(_, t, p)| {
                let outcome = p["outcome"].as_str().unwrap_or("").to_string();
                (t, p["call_index"].as_u64().unwrap(), p["name"].as_str().unwrap().to_string(), outcome)
            })
            .collect()
    }
}

fn ev(kind: &str, i: u64, name: &str, outcome: &str) -> (String, u64, String, String) {
    (kind.into(), i, name.into(), outcome.into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_loops_over_the_offline_model_and_a_webhook_tool() {
    let log = Log::default();
    let (arrived, _) = mpsc::unbounded_channel();
    let base = webhook_receiver(log.clone(), arrived).await;
    let env = Env::new(
        LlmConfig::default(),
        &[webhook("weather", format!("{base}/ok"), 5_000)],
        &[("chat", &["llm", "weather"])],
    )
    .await;
    let run = env.run("chat", "will it rain", json!({ "tools": [offered("weather")] })).await;
    let view = env.finish(run).await;
    assert_eq!(view["status"], "completed", "{view}");

    let want = r#"Offline reply to: will it rain Tool weather said: {"forecast":"sunny"}"#;
    assert_eq!(env.answer(run).await, (want.to_string(), "complete".to_string()));
    assert_eq!(
        env.tool_events(run).await,
        [
            ev("tool_call_started", 1, "llm", ""),
            ev("tool_call_finished", 1, "llm", "ok"),
            ev("tool_call_started", 2, "weather", ""),
            ev("tool_call_finished", 2, "weather", "ok"),
            ev("tool_call_started", 3, "llm", ""),
            ev("tool_call_finished", 3, "llm", "ok"),
        ]
    );
    // The model's words were streamed by the host as they came.
    let streamed = deltas_text(&journal_payloads(&env.db.pool, run).await);
    assert_eq!(streamed, want);
    assert_eq!(view["usage"]["model_calls"], 2, "{view}");
    // The receiver got one call, idempotent by (run, call index), with the
    // operator's credential, which no guest ever saw.
    let got = log.lock().unwrap().clone();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].idempotency_key.as_deref(), Some(format!("{run}:2").as_str()));
    assert_eq!(got[0].authorization.as_deref(), Some("Bearer webhook-secret"));
    assert_eq!(
        got[0].body,
        json!({ "run_id": run.to_string(), "call_id": format!("{run}:2"), "name": "weather",
                "args": { "input": "will it rain" } })
    );
    let journal = journal_payloads(&env.db.pool, run).await;
    assert!(!format!("{journal:?}").contains("webhook-secret"));
    env.host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ungranted_and_failing_tools_are_refused_and_the_model_hears_why() {
    let log = Log::default();
    let (arrived, _) = mpsc::unbounded_channel();
    let base = webhook_receiver(log.clone(), arrived).await;
    let hooks = [
        webhook("weather", format!("{base}/ok"), 5_000),
        webhook("flaky", format!("{base}/fail"), 5_000),
        webhook("leaky", format!("{base}/echo-auth"), 5_000),
    ];
    let chats: &[(&str, &[&str])] =
        &[("chat", &["llm", "flaky"]), ("chat-no-tools", &["llm"]), ("chat-leaky", &["llm", "leaky"])];
    let env = Env::new(LlmConfig::default(), &hooks, chats).await;

    // Offered to the model but not granted to the plugin: denied, never called.
    let run = env.run("chat-no-tools", "hi", json!({ "tools": [offered("weather")] })).await;
    assert_eq!(env.finish(run).await["status"], "completed");
    let (text, _) = env.answer(run).await;
    assert!(text.contains("Tool weather said: error: denied"), "{text}");
    assert!(log.lock().unwrap().is_empty(), "an ungranted tool is never called");

    // Granted, but the receiver answers 500: a tool failure naming the status.
    let run = env.run("chat", "hi", json!({ "tools": [offered("flaky")] })).await;
    assert_eq!(env.finish(run).await["status"], "completed");
    let (text, _) = env.answer(run).await;
    assert!(text.contains("Tool flaky said: error: tool failed") && text.contains("500"), "{text}");
    let events = env.tool_events(run).await;
    assert_eq!(events[3], ev("tool_call_finished", 2, "flaky", "error"));

    // An error body that echoes the operator's credential is redacted before
    // the guest (and the journal) sees it.
    let run = env.run("chat-leaky", "hi", json!({ "tools": [offered("leaky")] })).await;
    assert_eq!(env.finish(run).await["status"], "completed");
    let (text, _) = env.answer(run).await;
    assert!(text.contains("401") && text.contains("<redacted>"), "{text}");
    let journal = format!("{:?}", journal_payloads(&env.db.pool, run).await);
    assert!(!text.contains("webhook-secret") && !journal.contains("webhook-secret"), "{text}");
    env.host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_during_a_webhook_call_aborts_it_at_once() {
    let log = Log::default();
    let (arrived, mut arrivals) = mpsc::unbounded_channel();
    let base = webhook_receiver(log, arrived).await;
    let env = Env::new(
        LlmConfig::default(),
        &[webhook("slow", format!("{base}/hang"), 60_000)],
        &[("chat", &["llm", "slow"])],
    )
    .await;
    let run = env.run("chat", "take your time", json!({ "tools": [offered("slow")] })).await;
    tokio::time::timeout(LONG, arrivals.recv()).await.expect("the webhook was called");
    let asked = Instant::now();
    let (code, _) = env.host.call("POST", &format!("/v1/runs/{run}/cancel"), None).await;
    assert_eq!(code, StatusCode::ACCEPTED);
    let view = env.finish(run).await;
    let took = asked.elapsed();
    assert_eq!(view["status"], "cancelled", "{view}");
    assert!(took < Duration::from_millis(500), "the call was aborted, not waited out: {took:?}");
    assert_eq!(view["error"], Value::Null, "a guest that stops when told is not interrupted: {view}");
    assert_eq!(env.tool_events(run).await[3], ev("tool_call_finished", 2, "slow", "cancelled"));
    env.host.stop().await;
}

/// A streaming chat-completions endpoint: the first request (tools offered,
/// no tool result yet) gets a tool call split across chunks; later ones get
/// text in three pieces with usage. Requests are logged.
async fn chat_completions_server(log: Log) -> String {
    async fn complete(State(log): State<Log>, headers: HeaderMap, Json(body): Json<Value>) -> impl IntoResponse {
        log.lock().unwrap().push(received(&headers, body.clone()));
        let has_result = body["messages"].as_array().unwrap().iter().any(|m| m["role"] == "tool");
        let chunk = |delta: Value, finish: Value| {
            let c = json!({ "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] });
            format!("data: {c}\n\n")
        };
        let mut sse = String::new();
        if !has_result {
            sse += &chunk(
                json!({ "role": "assistant", "tool_calls": [{ "index": 0, "id": "call_a", "type": "function",
                "function": { "name": "weather", "arguments": "{\"ci" } }] }),
                Value::Null,
            );
            sse += &chunk(
                json!({ "tool_calls": [{ "index": 0, "function": { "arguments": "ty\": \"Oslo\"}" } }] }),
                Value::Null,
            );
            sse += &chunk(json!({}), json!("tool_calls"));
        } else {
            for piece in ["It is ", "sunny in ", "Oslo."] {
                sse += &chunk(json!({ "content": piece }), Value::Null);
            }
            sse += &chunk(json!({}), json!("stop"));
        }
        let usage = json!({ "choices": [], "usage": { "prompt_tokens": 10, "completion_tokens": 5 } });
        sse += &format!("data: {usage}\n\ndata: [DONE]\n\n");
        ([("content-type", "text/event-stream")], sse)
    }
    serve(Router::new().route("/v1/chat/completions", post(complete)).with_state(log)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_against_a_streaming_chat_completions_endpoint() {
    let model_log = Log::default();
    let model = chat_completions_server(model_log.clone()).await;
    let hook_log = Log::default();
    let (arrived, _) = mpsc::unbounded_channel();
    let receiver = webhook_receiver(hook_log.clone(), arrived).await;
    let llm = LlmConfig {
        base_url: Some(format!("{model}/v1")),
        api_key: Some("sk-model-secret".into()),
        model: "test-model".into(),
        ..LlmConfig::default()
    };
    let env =
        Env::new(llm, &[webhook("weather", format!("{receiver}/ok"), 5_000)], &[("chat", &["llm", "weather"])]).await;
    let run = env.run("chat", "weather in Oslo?", json!({ "tools": [offered("weather")], "system": "be brief" })).await;
    let view = env.finish(run).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(env.answer(run).await.0, "It is sunny in Oslo.");
    assert_eq!(deltas_text(&journal_payloads(&env.db.pool, run).await), "It is sunny in Oslo.");
    // No cached tokens reported and no price in the tools file: both zero.
    let usage = json!({ "model_calls": 2, "prompt_tokens": 20, "completion_tokens": 10,
                        "cached_tokens": 0, "cost_usd": 0.0 });
    assert_eq!(view["usage"], usage);
    assert_eq!(hook_log.lock().unwrap()[0].body["args"], json!({ "city": "Oslo" }));

    let requests = model_log.lock().unwrap().clone();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].authorization.as_deref(), Some("Bearer sk-model-secret"));
    assert_eq!(requests[0].body["model"], "test-model");
    assert_eq!(requests[0].body["stream"], true);
    assert_eq!(requests[0].body["tools"][0]["function"]["name"], "weather");
    let second = requests[1].body["messages"].as_array().unwrap();
    let roles: Vec<&str> = second.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool"]);
    assert_eq!(second[3]["tool_call_id"], "call_a");
    assert_eq!(second[3]["content"], r#"{"forecast":"sunny"}"#);
    let journal = journal_payloads(&env.db.pool, run).await;
    assert!(!format!("{journal:?}").contains("sk-model-secret"), "credentials never reach the journal");
    env.host.stop().await;
}

/// Issue 40: grants are the operator's to give. A tenant admin's upload
/// whose manifest grants a tool the operator does not grant its tenant (the
/// tools file's `tenants`, none by default) is refused naming it; a tenant
/// plugin stored with such a grant before (the operator narrowed it since)
/// is refused at the call; a published plugin, the operator's own, is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_plugin_may_use_only_the_tools_the_operator_grants_its_tenant() {
    let db = TestDb::new().await;
    let text = r#"
        [[webhook]]
        name = "crm"
        url = "http://127.0.0.1:1/crm"
        tenants = ["acme"]
        [[webhook]]
        name = "ops"
        url = "http://127.0.0.1:1/ops"
    "#;
    let lookup = |_: &str| None;
    let file = agent_host::tools::parse_tools_file_with(text, &lookup).unwrap();
    let tools = ToolRegistry::from_tools(&LlmConfig::default(), &file).unwrap();
    let cache = std::env::temp_dir().join(format!("agent-host-cache-{}", std::process::id()));
    let sandbox = Sandbox::new(db.pool.clone(), Some(cache)).unwrap();
    let agents = AgentRegistry::with_builtins().with_sandbox(sandbox).with_tools(tools);
    let host = TestHost::start(&db, Some(Hub::start(db.url.clone())), agents, fast_config("w")).await;
    let admin = agent_host::db::tokens::create(&db.pool, "ada", "acme", true).await.unwrap();
    let wasm = plugin_wasm("fixtures");
    let upload = |manifest: Value| {
        let (ct, body) = crate::support::http::multipart(&[
            ("name", b"mine".as_slice()),
            ("component", wasm.as_slice()),
            ("manifest", manifest.to_string().as_bytes()),
        ]);
        host.client
            .post(format!("{}/v1/plugins", host.base))
            .bearer_auth(&admin)
            .header("content-type", ct)
            .body(body)
            .send()
    };
    let refused = upload(json!({ "tools": ["llm", "ops", "crm"] })).await.unwrap();
    assert_eq!(refused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body: Value = refused.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap().to_string();
    assert!(message.contains("does not grant tenant \"acme\": ops"), "{message}");
    let accepted = upload(json!({ "tools": ["llm", "crm"] })).await.unwrap();
    assert_eq!(accepted.status(), StatusCode::CREATED);

    // Issue 40: and limits within its tenant's ceilings (the operator's
    // `tenants ceiling`); an operator's published plugin is not held to them.
    let mut conn = db.pool.acquire().await.unwrap();
    let ceilings = [("wall_ms".to_string(), 60_000), ("memory_bytes".to_string(), 32 << 20)].into();
    agent_host::db::tenants::set_ceilings(&mut conn, "acme", &ceilings).await.unwrap();
    let refused = upload(json!({ "tools": ["llm"], "limits": { "wall_ms": 120_000 } })).await.unwrap();
    assert_eq!(refused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body: Value = refused.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap().to_string();
    let want = "limits above tenant \"acme\"'s ceilings: memory_bytes 67108864 > 33554432, wall_ms 120000 > 60000";
    assert!(message.contains(want), "{message}");
    let within = json!({ "limits": { "wall_ms": 60_000, "memory_bytes": 32 << 20 } });
    assert_eq!(upload(within).await.unwrap().status(), StatusCode::CREATED);
    agent_host::db::tenants::set_ceilings(&mut conn, "acme", &Default::default()).await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM tenant_limit").fetch_one(&db.pool).await.unwrap();
    assert_eq!(rows, 0, "a tenant with no settings of its own has no row");

    // Stored before the operator narrowed its grant: refused at the call,
    // though the operator published the very same bytes (a tenant's own
    // name is the tenant's, whatever its digest).
    let actor = agent_host::db::audit::Actor::cli();
    let manifest = json!({ "tools": ["ops"] });
    plugins::put(&db.pool, "published", &wasm, &manifest).await.unwrap();
    plugins::put_as(&db.pool, &actor, Some("acme"), "legacy", &wasm, &manifest).await.unwrap();
    let run = host.post_run("legacy", "go", json!({ "mode": "durable", "tool": "ops", "steps": 1 })).await;
    let view = host.ended(&db.pool, run).await;
    assert_eq!(view["status"], "failed", "{view}");
    assert!(view["error"].as_str().unwrap().contains("not granted to tenant \"acme\" by the operator"), "{view}");
    // The operator's published plugin reaches the tool (which is down here).
    let run = host.post_run("published", "go", json!({ "mode": "durable", "tool": "ops", "steps": 1 })).await;
    let view = host.ended(&db.pool, run).await;
    let error = view["error"].as_str().unwrap_or_default();
    assert!(!error.contains("by the operator") && !error.contains("denied"), "{view}");
    host.stop().await;
}
