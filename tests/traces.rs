//! Traces (issue 46 item 5), received by a collector nobody here wrote:
//! Arize Phoenix (`arize-phoenix`, PyPI, installed by scripts/test into
//! AGENT_HOST_TEST_PHOENIX_VENV) takes the host's OTLP/HTTP export, and the
//! spans are read back from Phoenix's REST API. A resumable chat run makes a
//! model call and a tool call, its host is SIGKILLed inside the tool call,
//! and another host resumes it: one trace, continued by the second process,
//! with the GenAI attributes on the model calls and the run on every span.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use nix::sys::signal::Signal;
use serde_json::{json, Value};

use crate::support::durable::*;
use crate::support::mcp_servers::free_port;
use crate::support::process::HostProcess;
use crate::support::*;

/// What the scripted model says it is.
const SERVED_MODEL: &str = "served-model-7";

/// One `phoenix serve` on free loopback ports with a private working
/// directory; killed (by its pid) when dropped.
struct Phoenix {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Phoenix {
    async fn start() -> Phoenix {
        let venv = std::env::var("AGENT_HOST_TEST_PHOENIX_VENV").unwrap_or_else(|_| {
            panic!(
                "AGENT_HOST_TEST_PHOENIX_VENV is not set: run scripts/test, which installs \
                 tests/phoenix/requirements.txt into a cache and names it"
            )
        });
        let (port, grpc) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(format!("agent-host-phoenix-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = std::fs::File::create(dir.join("log")).unwrap();
        let child = Command::new(PathBuf::from(venv).join("bin/phoenix"))
            .arg("serve")
            .current_dir(&dir)
            .env("PHOENIX_HOST", "127.0.0.1")
            .env("PHOENIX_PORT", port.to_string())
            .env("PHOENIX_GRPC_PORT", grpc.to_string())
            .env("PHOENIX_WORKING_DIR", &dir)
            .env("PHOENIX_TELEMETRY_ENABLED", "false")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting phoenix");
        let mut phoenix = Phoenix { child, port, dir };
        let http = reqwest::Client::new();
        let url = format!("{}/healthz", phoenix.base());
        let mut exited = None;
        let ready = poll_until(Duration::from_secs(120), || {
            exited = phoenix.child.try_wait().unwrap();
            let (http, url, gone) = (&http, &url, exited.is_some());
            async move { gone || http.get(url).send().await.is_ok_and(|r| r.status().is_success()) }
        })
        .await;
        assert!(ready && exited.is_none(), "phoenix did not become ready ({exited:?}); its log:\n{}", phoenix.log());
        phoenix
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// The spans Phoenix holds of one trace (hex id), from its REST API.
    async fn spans(&self, trace_id: &str) -> Vec<Value> {
        let url = format!("{}/v1/projects/default/spans", self.base());
        let query = [("trace_id", trace_id), ("limit", "1000")];
        let Ok(res) = reqwest::Client::new().get(url).query(&query).send().await else { return Vec::new() };
        // Before the first span the default project may not exist yet (404).
        if !res.status().is_success() {
            return Vec::new();
        }
        let body: Value = res.json().await.unwrap();
        body["data"].as_array().cloned().unwrap_or_default()
    }

    /// Polls until `done` holds of the trace's spans (bounded); returns them.
    async fn wait_spans(&self, trace_id: &str, what: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let seen = Mutex::new(Vec::new());
        let arrived = poll_until(LONG, || async {
            let spans = self.spans(trace_id).await;
            let ok = done(&spans);
            *seen.lock().unwrap() = spans;
            ok
        })
        .await;
        let spans = seen.into_inner().unwrap();
        assert!(arrived, "Phoenix never had {what}; it has {}:\n{}", names(&spans).join(", "), self.log());
        spans
    }
}

impl Drop for Phoenix {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn names(spans: &[Value]) -> Vec<String> {
    spans.iter().map(|s| s["name"].as_str().unwrap_or("?").to_string()).collect()
}

fn named<'a>(spans: &'a [Value], name: &str) -> Vec<&'a Value> {
    spans.iter().filter(|s| s["name"] == name).collect()
}

/// An attribute of a span, whether Phoenix answers attributes flat
/// (`{"gen_ai.system": ..}`) or nested (`{"gen_ai": {"system": ..}}`).
fn attr(span: &Value, key: &str) -> Value {
    let attributes = &span["attributes"];
    if let Some(v) = attributes.get(key) {
        return v.clone();
    }
    key.split('.').fold(attributes, |v, k| v.get(k).unwrap_or(&Value::Null)).clone()
}

/// A streaming chat-completions endpoint that names its model and reports
/// usage: without a tool result in the conversation it asks for the `slow`
/// tool (11 prompt tokens, 7 completion); with one it answers (23, 5).
async fn model(log: ModelLog) -> String {
    async fn complete(State(log): State<ModelLog>, Json(body): Json<Value>) -> impl IntoResponse {
        log.lock().unwrap().push(body.clone());
        let has_result = body["messages"].as_array().unwrap().iter().any(|m| m["role"] == "tool");
        let chunk = |delta: Value, finish: Value| {
            let c =
                json!({ "model": SERVED_MODEL, "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] });
            format!("data: {c}\n\n")
        };
        let usage = |prompt: u64, completion: u64| {
            let c = json!({ "model": SERVED_MODEL, "choices": [],
                            "usage": { "prompt_tokens": prompt, "completion_tokens": completion } });
            format!("data: {c}\n\n")
        };
        let mut sse = String::new();
        if has_result {
            sse += &chunk(json!({ "content": "The slow tool answered." }), Value::Null);
            sse += &chunk(json!({}), json!("stop"));
            sse += &usage(23, 5);
        } else {
            sse += &chunk(json!({ "content": "Let me check. " }), Value::Null);
            sse += &chunk(
                json!({ "tool_calls": [{ "index": 0, "id": "call_1", "type": "function",
                        "function": { "name": "slow", "arguments": "{\"q\": 1}" } }] }),
                Value::Null,
            );
            sse += &chunk(json!({}), json!("tool_calls"));
            sse += &usage(11, 7);
        }
        sse += "data: [DONE]\n\n";
        ([("content-type", "text/event-stream")], sse)
    }
    serve(Router::new().route("/v1/chat/completions", post(complete)).with_state(log)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_resumed_after_sigkill_is_one_trace_in_phoenix() {
    let phoenix = Phoenix::start().await;
    let models = ModelLog::default();
    let llm = format!("{}/v1", model(models.clone()).await);
    let otlp = phoenix.base();
    let extra = ["--llm-base-url", &llm, "--llm-model", "test-model", "--otlp-endpoint", &otlp];
    let env = Env::new("chat", "chat", &["llm", "slow"], true, &extra).await;
    let a = env.spawn("A");
    let hosts = Arc::new(Mutex::new(vec![a.addr.clone()]));
    let offered = json!([{ "name": "slow", "description": "slow", "parameters": { "type": "object" } }]);
    let run = env.post(&a, "chat", "use the slow tool", json!({ "tools": offered })).await;
    let client = start_following(&env, &hosts, run);
    let trace_id: uuid::Uuid = scalar(&env.db, "SELECT trace_id FROM agent_run WHERE id = $1", run).await;
    let trace_id = trace_id.simple().to_string();
    let root_id: i64 = scalar(&env.db, "SELECT trace_span_id FROM agent_run WHERE id = $1", run).await;
    let root_id = hex::encode(root_id.to_be_bytes());

    // A made the first model call and is inside the tool call; its ended
    // spans reach Phoenix before it dies.
    env.wait_arrived("slow").await;
    phoenix.wait_spans(&trace_id, "A's model call", |s| !named(s, "chat test-model").is_empty()).await;
    a.signal(Signal::SIGKILL);
    // B resumes it, with content on.
    let mut args: Vec<&str> = env.args.iter().map(String::as_str).collect();
    args.push("--otlp-content");
    let b = HostProcess::spawn(&env.db.url, "B", &args);
    hosts.lock().unwrap().push(b.addr.clone());
    let followed = client.await.unwrap();
    assert_eq!(env.view(&b, run).await["status"], "completed");
    assert_eq!(count(&followed.events, "run_resumed"), 1);
    assert_eq!(models.lock().unwrap().len(), 2, "the first model call was replayed, not made again");

    let root = "run chat";
    let spans = phoenix
        .wait_spans(&trace_id, "the whole trace", |s| {
            !named(s, root).is_empty()
                && named(s, "chat test-model").len() == 2
                && !named(s, "execute_tool slow").is_empty()
        })
        .await;
    let all = names(&spans);
    eprintln!("the trace in Phoenix: {all:?}");

    // One trace: every span of the run carries its id, across both processes.
    for s in &spans {
        assert_eq!(s["context"]["trace_id"], trace_id.as_str(), "{s}");
        assert_eq!(attr(s, "agent_host.run_id"), json!(run.to_string()), "{s}");
        assert_eq!(attr(s, "agent_host.tenant"), "acme", "{s}");
        assert!(attr(s, "gen_ai.conversation.id").as_str().is_some_and(|c| !c.is_empty()), "{s}");
    }
    // The root: the stored span id, written once by the process that ended the run.
    let roots = named(&spans, root);
    assert_eq!(roots.len(), 1, "{all:?}");
    assert_eq!(roots[0]["context"]["span_id"], root_id.as_str());
    assert!(roots[0]["parent_id"].is_null(), "{}", roots[0]);
    assert_eq!(attr(roots[0], "agent_host.run.status"), "completed");
    assert_eq!(attr(roots[0], "agent_host.attempts"), 2);
    // A claim per process, each a child of the root.
    let claims = named(&spans, "claim");
    let mut workers: Vec<String> =
        claims.iter().map(|c| attr(c, "agent_host.worker_id").as_str().unwrap().to_string()).collect();
    workers.sort();
    assert_eq!(workers, ["A", "B"], "{all:?}");
    assert!(claims.iter().all(|c| c["parent_id"] == root_id.as_str()));
    // B's segment (A's died with A), under the root.
    let segments = named(&spans, "invoke_agent chat");
    assert_eq!(segments.len(), 1, "{all:?}");
    let segment = segments[0];
    assert_eq!(attr(segment, "agent_host.worker_id"), "B");
    assert_eq!(attr(segment, "gen_ai.operation.name"), "invoke_agent");
    assert_eq!(segment["parent_id"], root_id.as_str());
    let segment_id = segment["context"]["span_id"].as_str().unwrap();

    // Two model calls, one per process, with the GenAI attributes; the one
    // B replayed from its log made no span.
    let chats = named(&spans, "chat test-model");
    assert_eq!(chats.len(), 2, "{all:?}");
    let by_finish = |reason: &str| {
        *chats
            .iter()
            .find(|c| attr(c, "gen_ai.response.finish_reasons") == json!([reason]))
            .unwrap_or_else(|| panic!("no chat span finished with {reason:?}: {chats:?}"))
    };
    let (first, second) = (by_finish("tool_calls"), by_finish("stop"));
    for (c, input, output) in [(first, 11, 7), (second, 23, 5)] {
        assert_eq!(attr(c, "gen_ai.operation.name"), "chat");
        assert_eq!(attr(c, "gen_ai.system"), "openai");
        assert_eq!(attr(c, "gen_ai.provider.name"), "openai");
        assert_eq!(attr(c, "gen_ai.request.model"), "test-model");
        assert_eq!(attr(c, "gen_ai.response.model"), SERVED_MODEL);
        assert_eq!(attr(c, "gen_ai.usage.input_tokens"), input, "{c}");
        assert_eq!(attr(c, "gen_ai.usage.output_tokens"), output, "{c}");
    }
    // A's call is parented to A's segment (lost with A), B's to B's.
    assert_ne!(first["parent_id"], segment_id);
    assert_eq!(second["parent_id"], segment_id);
    // Content only where the operator turned it on (B).
    assert!(attr(first, "gen_ai.input.messages").is_null(), "{first}");
    let prompt = attr(second, "gen_ai.input.messages").as_str().unwrap_or_else(|| panic!("{second}")).to_string();
    assert!(prompt.contains("use the slow tool"), "{prompt}");
    assert!(attr(second, "gen_ai.output.messages").as_str().unwrap().contains("The slow tool answered."));

    // The tool call in flight at the crash, made again by B.
    let tools = named(&spans, "execute_tool slow");
    assert_eq!(tools.len(), 1, "{all:?}");
    assert_eq!(attr(tools[0], "gen_ai.tool.name"), "slow");
    assert_eq!(attr(tools[0], "gen_ai.operation.name"), "execute_tool");
    assert_eq!(tools[0]["parent_id"], segment_id);

    // B counted what it sent.
    let metrics = reqwest::get(format!("http://{}/metrics", b.addr)).await.unwrap().text().await.unwrap();
    let exported = metrics.lines().find(|l| l.starts_with("agent_host_trace_spans_exported_total ")).unwrap();
    assert!(exported.split(' ').nth(1).unwrap().parse::<u64>().unwrap() >= 5, "{exported}");
    assert!(metrics.contains("agent_host_trace_export_failures_total 0"), "{metrics}");
}

/// A collector that is not there costs the runs nothing: the run completes
/// and the failed exports are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_collector_fails_no_run() {
    let dead = format!("http://127.0.0.1:{}", free_port());
    let env = Env::new("chat", "chat", &["llm"], true, &["--otlp-endpoint", &dead]).await;
    let a = env.spawn("A");
    let run = env.post(&a, "chat", "hello", json!({})).await;
    assert_eq!(wait_terminal(&env.db.pool, run, LONG).await, "completed");
    let failed = || async {
        let metrics = reqwest::get(format!("http://{}/metrics", a.addr)).await.unwrap().text().await.unwrap();
        metrics
            .lines()
            .find(|l| l.starts_with("agent_host_trace_export_failures_total "))
            .is_some_and(|l| l.split(' ').nth(1).unwrap().parse::<u64>().unwrap() >= 1)
    };
    wait_for("a failed export to be counted", LONG, failed).await;
}

/// Bad trace flags are usage errors (exit status 2), refused before anything is opened.
#[test]
fn bad_trace_flags_are_usage_errors() {
    for args in [
        &["--otlp-endpoint", "collector:4318"][..],
        &["--otlp-endpoint", "ftp://collector"],
        &["--otlp-endpoint", "http://collector:4318/?x=1"],
        &["--otlp-content"],
        &["--otlp-endpoint", "http://collector:4318", "--otlp-service-name", " "],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_agent-host"))
            .arg("serve")
            .args(args)
            .env_remove("AGENT_HOST_OTLP_ENDPOINT")
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {said}");
        assert!(said.contains("otlp"), "{args:?}: {said}");
    }
}
