//! The Responses API (`/v1/responses`) against real host processes on one
//! database, driven by real clients: the official `openai` Python SDK
//! (tests/py/responses_sdk.py, tests/py/responses_kill.py) and the Open
//! Responses conformance suite `llm-comply`. Both are installed by
//! scripts/test into a venv cached outside the clone (tests/py/requirements.txt),
//! named by AGENT_HOST_TEST_VENV.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::support::http::TestHost;
use crate::support::process::{HostProcess, FAST};
use crate::support::*;
use agent_host::db::{plugins, tokens, RunId};
use agent_host::stream::tail::LiveTails;
use serde_json::{json, Value};

/// How long one Python client may take.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(240);

fn venv() -> PathBuf {
    let venv = std::env::var("AGENT_HOST_TEST_VENV").expect(
        "AGENT_HOST_TEST_VENV is not set: run scripts/test, which installs tests/py/requirements.txt into a cached \
         venv and names it",
    );
    PathBuf::from(venv)
}

fn py_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("tests/py")
}

/// Host flags: short leases, and one compile cache for these tests (keyed by
/// digest and engine, written with atomic renames: any process may share it).
fn flags() -> Vec<String> {
    let cache = std::env::temp_dir().join("agent-host-responses-cache");
    let mut args: Vec<String> = FAST.iter().map(|s| s.to_string()).collect();
    args.extend(["--cache-dir".to_string(), cache.display().to_string()]);
    args
}

fn spawn(db: &TestDb, worker: &str) -> HostProcess {
    let args = flags();
    HostProcess::spawn(&db.url, worker, &args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// A database with the `chat` plugin (over the offline model) and a token.
async fn setup() -> (TestDb, String) {
    let db = TestDb::new().await;
    plugins::put(&db.pool, "chat", &plugin_wasm("chat"), &json!({ "tools": ["llm"] })).await.unwrap();
    let token = tokens::create(&db.pool, "alice", "acme", false).await.unwrap();
    (db, token)
}

/// Runs `program args` with `env`, at most [`CLIENT_TIMEOUT`]; its stdout,
/// after asserting it succeeded (stderr and stdout shown when it did not).
async fn client(program: &Path, args: &[&str], env: &[(&str, String)], hosts: &[&HostProcess]) -> String {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args).current_dir(py_dir()).kill_on_drop(true).stdin(std::process::Stdio::null());
    // Nothing written into the clone.
    cmd.env("PYTHONDONTWRITEBYTECODE", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(CLIENT_TIMEOUT, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{} {args:?} did not finish within {CLIENT_TIMEOUT:?}", program.display()))
        .expect("running the Python client");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{stderr}");
    if !out.status.success() {
        let logs: Vec<String> = hosts.iter().map(|h| format!("--- host {}:\n{}", h.worker_id, h.log())).collect();
        panic!("{} {args:?} failed ({}):\n{stdout}\n{stderr}\n{}", program.display(), out.status, logs.join("\n"));
    }
    stdout.into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_is_a_client_and_any_process_serves_any_response() {
    let (db, token) = setup().await;
    let a = spawn(&db, "A");
    let b = spawn(&db, "B");
    let env = [("AGENT_HOST_TOKEN", token), ("HOST_A", a.addr.clone()), ("HOST_B", b.addr.clone())];
    let out = client(&venv().join("bin/python"), &["responses_sdk.py"], &env, &[&a, &b]).await;
    assert!(out.contains("responses_sdk: all passed"), "{out}");
}

/// Every test of the suite but the compaction ones (an endpoint this host
/// does not serve) passes; `reasoning-summary` is skipped by the suite
/// itself for a model that is not a reasoning model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llm_comply_passes_every_non_compaction_test() {
    let (db, token) = setup().await;
    let a = spawn(&db, "A");
    let base = format!("http://{}/v1", a.addr);
    let args = ["run", "-u", &base, "-k", &token, "-m", "chat", "--json", "--timeout", "60"];
    let stdout = client(&venv().join("bin/llm-comply"), &args, &[], &[&a]).await;
    let start = stdout.find('{').unwrap_or_else(|| panic!("no JSON from llm-comply:\n{stdout}"));
    let report: Value = serde_json::from_str(&stdout[start..]).unwrap_or_else(|e| panic!("{e}:\n{stdout}"));
    let results = report["results"].as_array().unwrap();
    let status = |id: &str| results.iter().find(|r| r["id"] == id).map(|r| r["status"].as_str().unwrap().to_string());
    let required = [
        "basic-response",
        "system-prompt",
        "multi-turn",
        "tool-calling",
        "streaming-response",
        "streaming-usage",
        "image-input",
        "assistant-phase",
        "response-output-phase-schema",
        "error-handling",
    ];
    for id in required {
        assert_eq!(
            status(id).as_deref(),
            Some("passed"),
            "llm-comply {id}:\n{}",
            serde_json::to_string_pretty(&report).unwrap()
        );
    }
    assert_eq!(status("reasoning-summary").as_deref(), Some("skipped"));
    eprintln!("llm-comply: {}", report["summary"]);
}

/// The process serving a stream is SIGKILLed mid-stream (the run itself is
/// on another process and goes on): the SDK client resumes on that other
/// process with `starting_after` and gets every remaining event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_by_a_killed_process_resumes_on_another_without_gap_or_duplicate() {
    let (db, token) = setup().await;
    let b = spawn(&db, "B");
    // Only B exists when the run is claimed (so B runs it); A then joins to
    // serve the stream. Long enough (8 s) to be live when A is killed, which
    // the client checks right before the kill.
    let body = json!({ "model": "sleep", "input": "count", "background": true,
                       "config": { "steps": 200, "step_ms": 40 } });
    let res = reqwest::Client::new()
        .post(format!("http://{}/v1/responses", b.addr))
        .bearer_auth(&token)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let created: Value = res.json().await.unwrap();
    let id = created["id"].as_str().unwrap().to_string();
    let run: RunId = id.strip_prefix("resp_").unwrap().parse().unwrap();
    wait_status(&db.pool, run, "running", LONG).await;
    let a = spawn(&db, "A");
    let env = [
        ("AGENT_HOST_TOKEN", token),
        ("HOST_A", a.addr.clone()),
        ("HOST_A_PID", a.child.id().to_string()),
        ("HOST_B", b.addr.clone()),
        ("RESPONSE_ID", id),
    ];
    let out = client(&venv().join("bin/python"), &["responses_kill.py"], &env, &[&b]).await;
    assert!(out.contains("all passed"), "{out}");
    wait_status(&db.pool, run, "completed", LONG).await;
}

/// A component built for the 0.1.0 world (`legacy`, its own bindings) runs
/// unchanged beside the 0.2.0 ones (`chat`, through the SDK), on one process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn components_of_both_worlds_run_side_by_side() {
    let (db, token) = setup().await;
    plugins::put(&db.pool, "legacy", &plugin_wasm("legacy"), &json!({})).await.unwrap();
    let a = spawn(&db, "A");
    let http = reqwest::Client::new();
    let ask = |model: &str, input: &str| {
        http.post(format!("http://{}/v1/responses", a.addr))
            .bearer_auth(&token)
            .json(&json!({ "model": model, "input": input }))
            .send()
    };
    let old: Value = ask("legacy", "built for the old world").await.unwrap().json().await.unwrap();
    assert_eq!(old["status"], "completed", "{old}");
    assert_eq!(old["output"][0]["content"][0]["text"], "built for the old world");
    let new: Value = ask("chat", "and the new").await.unwrap().json().await.unwrap();
    assert_eq!(new["status"], "completed", "{new}");
    assert_eq!(new["output"][0]["content"][0]["text"], "Offline reply to: and the new");

    // The wire form of a stream: each event one frame of `event: <type>` and
    // one `data:` line, LF only, numbered from 0, then `data: [DONE]`.
    let raw = http
        .get(format!("http://{}/v1/responses/{}?stream=true", a.addr, old["id"].as_str().unwrap()))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!raw.contains('\r'), "{raw}");
    let frames: Vec<&str> = raw.split_terminator("\n\n").collect();
    assert_eq!(frames.last(), Some(&"data: [DONE]"), "{raw}");
    for (n, frame) in frames[..frames.len() - 1].iter().enumerate() {
        let lines: Vec<&str> = frame.lines().collect();
        assert_eq!(lines.len(), 2, "{frame}");
        let kind = lines[0].strip_prefix("event: ").unwrap();
        let data: Value = serde_json::from_str(lines[1].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!((data["type"].as_str(), data["sequence_number"].as_u64()), (Some(kind), Some(n as u64)), "{frame}");
    }
    assert!(frames.len() > 5 && frames[frames.len() - 2].starts_with("event: response.completed"), "{raw}");
}

/// The benchmark of docs/src/performance.md ("The Responses API"), by hand:
/// `cargo test -p agent-host --test it -- --ignored --nocapture responses_benchmark`.
/// Create to first delta through each route for the same run (`echo`), and
/// the events per second one Responses stream carries replaying a long
/// journal (a `sleep` run of 2,000 deltas journaled one per millisecond).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark, run by hand"]
async fn responses_benchmark() {
    let (db, token) = setup().await;
    let mut args = flags();
    args.extend(["--journal-flush-ms".to_string(), "1".to_string()]);
    let a = HostProcess::spawn(&db.url, "A", &args.iter().map(String::as_str).collect::<Vec<_>>());
    let body = json!({ "model": "sleep", "input": "long", "config": { "steps": 2000, "step_ms": 1 } });
    let res = reqwest::Client::new()
        .post(format!("http://{}/v1/responses", a.addr))
        .bearer_auth(&token)
        .json(&body)
        .send()
        .await
        .unwrap();
    let long: Value = res.json().await.unwrap();
    assert_eq!(long["status"], "completed", "{long}");
    let env = [
        ("AGENT_HOST_TOKEN", token),
        ("HOST", a.addr.clone()),
        ("LONG_RESPONSE", long["id"].as_str().unwrap().to_string()),
    ];
    let out = client(&venv().join("bin/python"), &["responses_bench.py"], &env, &[&a]).await;
    println!("{out}");
}

/// A create that would wait or stream while this process's live tails are
/// all taken is refused before it enqueues anything: the SDKs retry a 503,
/// and without an Idempotency-Key a retry after enqueue would be a second
/// run. A background create needs no tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_refused_for_want_of_a_tail_enqueues_nothing() {
    let db = TestDb::new().await;
    let host = TestHost::undispatched(&db, |s| s.live_tails = LiveTails::new(0)).await;
    for body in [json!({ "model": "echo", "input": "hi" }), json!({ "model": "echo", "input": "hi", "stream": true })] {
        let (status, err) = host.call("POST", "/v1/responses", Some(body)).await;
        assert_eq!(status, 503, "{err}");
        assert_eq!(err["error"]["type"], "server_error", "{err}");
    }
    let runs: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run").fetch_one(&db.pool).await.unwrap();
    assert_eq!(runs, 0, "a refused create enqueued nothing");
    let body = json!({ "model": "echo", "input": "hi", "background": true });
    let (status, r) = host.call("POST", "/v1/responses", Some(body)).await;
    assert_eq!((status.as_u16(), r["status"].as_str()), (200, Some("queued")), "{r}");
}

/// Another user's token finds none of alice's responses: get, stream,
/// cancel, delete, input_items and previous_response_id all answer 404 (and
/// change nothing). A blocking create whose client goes away leaves its run
/// going to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_users_token_finds_nothing_and_a_dropped_wait_leaves_the_run_going() {
    let db = TestDb::new().await;
    let host = TestHost::builtins(&db).await;
    let bob = tokens::create(&db.pool, "bob", "acme", false).await.unwrap();
    let body = json!({ "model": "sleep", "input": "long", "background": true,
                       "config": { "steps": 100000, "step_ms": 20 } });
    let (status, r) = host.call("POST", "/v1/responses", Some(body)).await;
    assert_eq!(status, 200, "{r}");
    let id = r["id"].as_str().unwrap().to_string();
    let run: RunId = id.strip_prefix("resp_").unwrap().parse().unwrap();
    wait_status(&db.pool, run, "running", LONG).await;
    for (method, path) in [
        ("GET", format!("/v1/responses/{id}")),
        ("GET", format!("/v1/responses/{id}?stream=true")),
        ("GET", format!("/v1/responses/{id}/input_items")),
        ("POST", format!("/v1/responses/{id}/cancel")),
        ("DELETE", format!("/v1/responses/{id}")),
    ] {
        let (status, err) = host.call_as(&bob, method, &path, None).await;
        assert_eq!(status, 404, "{method} {path}: {err}");
        assert_eq!(err["error"]["code"], "not_found", "{method} {path}: {err}");
    }
    let next = json!({ "model": "echo", "input": "mine now", "previous_response_id": id });
    let (status, err) = host.call_as(&bob, "POST", "/v1/responses", Some(next)).await;
    assert_eq!((status.as_u16(), err["error"]["param"].as_str()), (404, Some("previous_response_id")), "{err}");
    assert_eq!(crate::support::status(&db.pool, run).await, "running", "bob's cancel and delete changed nothing");
    let (status, own) = host.call("GET", &format!("/v1/responses/{id}"), None).await;
    assert_eq!((status.as_u16(), own["status"].as_str()), (200, Some("in_progress")), "{own}");
    let (status, _) = host.call("POST", &format!("/v1/responses/{id}/cancel"), None).await;
    assert_eq!(status, 200);
    wait_status(&db.pool, run, "cancelled", LONG).await;

    // A blocking create dropped by its client: the run still ends completed.
    let body = json!({ "model": "sleep", "input": "short", "config": { "steps": 20, "step_ms": 50 } });
    let dropped = host
        .client
        .post(format!("{}/v1/responses", host.base))
        .bearer_auth(&host.token)
        .json(&body)
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(dropped.is_err_and(|e| e.is_timeout()), "the client gave up before the run's end");
    let last: RunId = sqlx::query_scalar("SELECT id FROM agent_run ORDER BY created_at DESC LIMIT 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_ne!(last, run);
    wait_status(&db.pool, last, "completed", LONG).await;
}

/// What the request maps to, as the run keeps it: function tools beside the
/// plugin config's own, none offered for `tool_choice: "none"`; a request too
/// big for the run's config is told what counts; `previous_response_id`
/// naming an older response (a branch) is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_maps_onto_the_runs_config_and_refuses_what_it_cannot_keep() {
    let db = TestDb::new().await;
    let host = TestHost::builtins(&db).await;
    let config_of = |id: &str| {
        let run: RunId = id.strip_prefix("resp_").unwrap().parse().unwrap();
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, Value>("SELECT config FROM agent_run WHERE id = $1")
                .bind(run)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let tool = json!({ "type": "function", "name": "get_weather", "parameters": { "type": "object" } });
    let body = json!({ "model": "echo", "input": "hi", "background": true, "tools": [tool],
                       "config": { "tools": [{ "name": "own" }] } });
    let (status, r) = host.call("POST", "/v1/responses", Some(body)).await;
    assert_eq!(status, 200, "{r}");
    let config = config_of(r["id"].as_str().unwrap()).await;
    let names: Vec<&str> = config["tools"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["own", "get_weather"], "{config}");
    assert_eq!(config["client_tools"], json!(["get_weather"]));
    let body = json!({ "model": "echo", "input": "hi", "background": true, "tools": [tool], "tool_choice": "none" });
    let (_, r) = host.call("POST", "/v1/responses", Some(body)).await;
    let config = config_of(r["id"].as_str().unwrap()).await;
    assert!(config.get("tools").is_none() && config.get("client_tools").is_none(), "{config}");
    assert_eq!(r["tool_choice"], "none");

    let body = json!({ "model": "echo", "input": "hi", "instructions": "x".repeat(20 * 1024) });
    let (status, err) = host.call("POST", "/v1/responses", Some(body)).await;
    assert_eq!(status, 400, "{err}");
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("instructions, tools") && message.contains("limit is 16384"), "{message}");
    assert_eq!(err["error"]["param"], Value::Null, "{err}");

    let (_, first) = host.call("POST", "/v1/responses", Some(json!({ "model": "echo", "input": "one" }))).await;
    let first = first["id"].as_str().unwrap().to_string();
    let next = |prev: &str, input: &str| json!({ "model": "echo", "input": input, "previous_response_id": prev });
    let (status, second) = host.call("POST", "/v1/responses", Some(next(&first, "two"))).await;
    assert_eq!((status.as_u16(), second["status"].as_str()), (200, Some("completed")), "{second}");
    let (status, err) = host.call("POST", "/v1/responses", Some(next(&first, "a branch"))).await;
    assert_eq!((status.as_u16(), err["error"]["param"].as_str()), (400, Some("previous_response_id")), "{err}");
}
