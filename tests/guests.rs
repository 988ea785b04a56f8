//! Agents in three languages on one host: the `chat` example in Rust
//! (plugins/chat), Python (plugins/chat-python, componentize-py) and
//! JavaScript (plugins/chat-js, componentize-js), each built by
//! `scripts/build-plugin`. Each runs a turn with a tool call, is stopped
//! cooperatively, is interrupted when it ignores the stop, and fails with the
//! named memory reason past its limit, while the other languages' runs on the
//! same host complete. Compile once: a second real process runs a freshly
//! uploaded Python plugin without compiling, and a tampered stored artifact
//! is refused, logged and recompiled.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::http::TestHost;
use crate::support::process::{HostProcess, FAST};
use crate::support::*;
use agent_host::agent::{AgentRegistry, Components};
use agent_host::db::audit::Actor;
use agent_host::db::RunId;
use agent_host::error::HostError;
use agent_host::hub::Hub;
use agent_host::sandbox::{Manifest, Sandbox};
use agent_host::tools::{EventSink, Tool, ToolCall, ToolRegistry};
use agent_host::worker::WorkerConfig;
use reqwest::StatusCode;
use serde_json::{json, Value};

/// The three languages' chat examples: (plugin name, directory).
const CHATS: [(&str, &str); 3] = [("chat", "chat"), ("chat-python", "chat-python"), ("chat-js", "chat-js")];

/// How each language's guest misbehaves on purpose: (plugin, config of a
/// turn that streams until a stop and looks at it, of one that ignores it,
/// of one that keeps `mb` MiB alive). The Python and JavaScript chats have
/// switches for it; the Rust `chat` has none, so Rust's are the fixtures
/// plugin's modes (plugins/fixtures).
fn misbehaving(mb: u64) -> [(&'static str, Value, Value, Value); 3] {
    let chat = |plugin| {
        (
            plugin,
            json!({ "hold_ms": 120_000, "tools": [offered()] }),
            json!({ "hold_ms": 120_000, "ignore_stop": true, "tools": [offered()] }),
            json!({ "hoard_mb": mb }),
        )
    };
    [
        (
            "fixtures",
            json!({ "mode": "work", "steps": 6_000, "step_ms": 20 }),
            json!({ "mode": "ignore-cancel" }),
            json!({ "mode": "membomb" }),
        ),
        chat("chat-python"),
        chat("chat-js"),
    ]
}

/// A host tool the model is offered: it answers with what it was asked.
struct Lookup;

#[async_trait::async_trait]
impl Tool for Lookup {
    async fn call(&self, call: &ToolCall<'_>, _sink: &dyn EventSink) -> Result<Value, HostError> {
        Ok(json!(format!("lookup found {}", call.args["input"].as_str().unwrap_or("nothing"))))
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(5)
    }
}

fn offered() -> Value {
    json!({ "name": "lookup", "description": "looks things up", "parameters": { "type": "object" } })
}

/// A host in this process (worker and API) with the three chats
/// registered through the upload path, granted `llm` and `lookup`.
async fn host(db: &TestDb, config: WorkerConfig) -> (TestHost, TempDir) {
    let cache = TempDir::new("guests");
    let sandbox: Arc<dyn Components> = Sandbox::new(db.pool.clone(), Some(cache.0.clone())).unwrap();
    let manifest = json!({ "tools": ["llm", "lookup"] });
    for (name, dir) in CHATS {
        let wasm = example_wasm(dir);
        agent_host::service::plugins::register(&db.pool, &sandbox, &Actor::cli(), None, name, wasm, &manifest)
            .await
            .unwrap_or_else(|e| panic!("registering {name}: {e}"));
    }
    let fixtures = plugin_wasm("fixtures");
    let manifest = json!({ "tools": ["record"] });
    agent_host::service::plugins::register(&db.pool, &sandbox, &Actor::cli(), None, "fixtures", fixtures, &manifest)
        .await
        .unwrap();
    let mut tools = ToolRegistry::from_config(&Default::default(), &[]).unwrap();
    tools.insert("lookup", Arc::new(Lookup));
    tools.insert("record", Arc::new(Lookup));
    let agents = AgentRegistry::with_builtins().with_sandbox(sandbox).with_tools(tools);
    (TestHost::start(db, Some(Hub::start(db.url.clone())), agents, config).await, cache)
}

async fn post(host: &TestHost, plugin: &str, content: &str, config: Value) -> RunId {
    let body = json!({ "content": content, "plugin": plugin, "config": config });
    let (code, v) = host.call("POST", "/v1/runs", Some(body)).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{v}");
    v["run_id"].as_str().unwrap().parse().unwrap()
}

async fn answer(db: &TestDb, run: RunId) -> String {
    sqlx::query_scalar("SELECT content FROM message WHERE run_id = $1 AND role = 'assistant'")
        .bind(run)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// A chat turn that calls the lookup tool: its answer quotes the tool's.
async fn assert_chatted(db: &TestDb, plugin: &str, run: RunId, asked: &str) {
    let status = wait_terminal(&db.pool, run, LONG).await;
    assert_eq!(status, "completed", "{plugin}: {}", run_error(&db.pool, run).await);
    let j = journal_payloads(&db.pool, run).await;
    let started: Vec<_> = j.iter().filter(|(_, t, _)| t == "tool_call_started").map(|(_, _, p)| &p["name"]).collect();
    assert_eq!(started, [&json!("llm"), &json!("lookup"), &json!("llm")], "{plugin}: {j:?}");
    assert!(j.iter().any(|(_, t, p)| t == "step" && p["n"] == 2), "{plugin}: the loop's second step: {j:?}");
    let text = answer(db, run).await;
    assert!(text.contains(&format!("lookup found {asked}")), "{plugin}: {text}");
    assert_eq!(deltas_text(&j), text, "{plugin}: the streamed text is the answer");
    assert_journal_sound(&db.pool, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_languages_chat_runs_a_turn_with_a_tool_call() {
    let db = TestDb::new().await;
    let (host, _cache) = host(&db, fast_config("w")).await;
    let mut runs = Vec::new();
    for (plugin, _) in CHATS {
        let asked = format!("weather for {plugin}");
        runs.push((plugin, post(&host, plugin, &asked, json!({ "tools": [offered()] })).await, asked));
    }
    for (plugin, run, asked) in runs {
        assert_chatted(&db, plugin, run, &asked).await;
    }
    host.stop().await;
}

/// Stops each language's chat while it streams: one looks at the stop and
/// returns, one ignores it and is interrupted after the grace; meanwhile a
/// turn of every other language completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_languages_chat_stops_cooperatively_or_is_interrupted_after_the_grace() {
    let db = TestDb::new().await;
    let config = WorkerConfig { max_runs: 12, ..fast_config("w") };
    let grace = config.cancel_grace;
    let (host, _cache) = host(&db, config).await;
    for (plugin, cooperative, ignoring, _) in misbehaving(0) {
        for (forced, config) in [(false, cooperative), (true, ignoring)] {
            let run = post(&host, plugin, "hold on", config).await;
            let others: Vec<_> = futures_others(&host, plugin).await;
            wait_for(&format!("{plugin} to run"), LONG, || async {
                let j = journal(&db.pool, run).await;
                j.iter().any(|(_, t)| t == "content_delta") || (plugin == "fixtures" && forced && !j.is_empty())
            })
            .await;
            let asked = Instant::now();
            let (code, _) = host.call("POST", &format!("/v1/runs/{run}/cancel"), None).await;
            assert_eq!(code, StatusCode::ACCEPTED);
            let within = if forced { grace + Duration::from_secs(2) } else { Duration::from_secs(2) };
            assert_eq!(wait_terminal(&db.pool, run, within).await, "cancelled", "{plugin} forced={forced}");
            let took = asked.elapsed();
            let error = run_error(&db.pool, run).await;
            if forced {
                assert!(took >= grace, "{plugin}: interrupted before the grace ({took:?})");
                assert!(error.contains("interrupted"), "{plugin}: {error}");
            } else {
                assert!(took < grace, "{plugin}: a cooperative stop took {took:?}");
                assert!(!error.contains("interrupted"), "{plugin}: {error}");
            }
            // What it streamed before the stop is kept.
            let streamed = deltas_text(&journal_payloads(&db.pool, run).await);
            if !streamed.is_empty() {
                let partial: Option<String> =
                    sqlx::query_scalar("SELECT content FROM message WHERE run_id = $1 AND role = 'assistant'")
                        .bind(run)
                        .fetch_optional(&db.pool)
                        .await
                        .unwrap();
                assert_eq!(partial.as_deref(), Some(streamed.as_str()), "{plugin}: the partial answer is kept");
            }
            assert_journal_sound(&db.pool, run).await;
            for (other, run, asked) in others {
                assert_chatted(&db, other, run, &asked).await;
            }
            eprintln!("{plugin} forced={forced}: stop to terminal {took:?}");
        }
    }
    host.stop().await;
}

/// One ordinary chat turn of each language other than `plugin`.
async fn futures_others(host: &TestHost, plugin: &str) -> Vec<(&'static str, RunId, String)> {
    let mut runs = Vec::new();
    let language = if plugin == "fixtures" { "chat" } else { plugin };
    for (other, _) in CHATS.iter().filter(|(p, _)| *p != language) {
        let asked = format!("news from {other}");
        runs.push((*other, post(host, other, &asked, json!({ "tools": [offered()] })).await, asked));
    }
    runs
}

/// Past the default memory limit, each language's chat fails with the named
/// reason; the other languages' turns on the same host complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_languages_chat_fails_with_the_memory_reason_past_its_limit() {
    let db = TestDb::new().await;
    let (host, _cache) = host(&db, WorkerConfig { max_runs: 12, ..fast_config("w") }).await;
    let limit = agent_host::sandbox::manifest::MEMORY_BYTES_DEFAULT;
    let hoard_mb = 2 * limit >> 20;
    for (plugin, _, _, hoard) in misbehaving(hoard_mb) {
        let run = post(&host, plugin, "remember everything", hoard).await;
        let others = futures_others(&host, plugin).await;
        assert_eq!(wait_terminal(&db.pool, run, LONG).await, "failed", "{plugin}");
        let error = run_error(&db.pool, run).await;
        assert_eq!(error, format!("limit: memory of {limit} bytes exceeded"), "{plugin}");
        for (other, run, asked) in others {
            assert_chatted(&db, other, run, &asked).await;
        }
    }
    host.stop().await;
}

/// One sample of a process's `/metrics`.
async fn metric(addr: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("http://{addr}/metrics")).await.unwrap().text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
        .parse()
        .unwrap()
}

async fn call(addr: &str, token: &str, method: reqwest::Method, path: &str, body: Value) -> (StatusCode, Value) {
    let res = reqwest::Client::new()
        .request(method, format!("http://{addr}{path}"))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = res.status();
    (status, res.json().await.unwrap_or(Value::Null))
}

/// A run of `plugin` through `addr`'s API, waited for to complete; its answer.
async fn run_via(db: &TestDb, addr: &str, token: &str, plugin: &str) -> String {
    let body = json!({ "content": "hello from another process", "plugin": plugin });
    let (code, v) = call(addr, token, reqwest::Method::POST, "/v1/runs", body).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{v}");
    let run: RunId = v["run_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(wait_terminal(&db.pool, run, LONG).await, "completed", "{}", run_error(&db.pool, run).await);
    answer(db, run).await
}

/// Compile once, run anywhere: the process that takes an upload compiles
/// it once (validation) and stores the artifact; a second process with an
/// empty local cache and the same artifact key (`AGENT_HOST_ARTIFACT_KEY`)
/// runs it without compiling; a third finds the stored artifact tampered
/// with, refuses it (logged), recompiles and replaces it; a fourth with
/// another key compiles once for its key and leaves the first key's row be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_never_saw_a_python_plugin_runs_it_without_compiling() {
    let db = TestDb::new().await;
    let token = agent_host::db::tokens::create(&db.pool, "alice", "acme", true).await.unwrap();
    let wasm = example_wasm("chat-python");
    let key = [("AGENT_HOST_ARTIFACT_KEY", "6a0f3c1e9b7d4a2f8e5c0b1d3f7a9e2c4b6d8f0a1c3e5b7d9f2a4c6e8b0d1f3a")];
    let other_key = [("AGENT_HOST_ARTIFACT_KEY", "another key of a host that shares no artifacts, 32+ bytes")];

    let dirs = [TempDir::new("a"), TempDir::new("b"), TempDir::new("c"), TempDir::new("d")];
    let [cache_a, cache_b, cache_c, cache_d] = dirs.each_ref().map(TempDir::arg);
    let mut a = HostProcess::spawn_with_env(&db.url, "a", &[FAST, &["--cache-dir", &cache_a]].concat(), &key);
    let (content_type, body) = crate::support::http::multipart(&[
        ("name", b"py-fresh"),
        ("component", &wasm),
        ("manifest", br#"{"tools": ["llm"]}"#),
    ]);
    let res = reqwest::Client::new()
        .post(format!("http://{}/v1/plugins", a.addr))
        .bearer_auth(&token)
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap();
    assert!(res.status().is_success(), "{}", res.text().await.unwrap());
    assert_eq!(metric(&a.addr, "agent_host_component_compiles_total").await, 1.0, "the upload's validation");
    a.signal(nix::sys::signal::Signal::SIGTERM);
    a.wait_exit(LONG).await;
    let digest = agent_host::db::plugins::digest_of(&wasm);
    let rows = || async {
        sqlx::query_as::<_, (String, i32)>(
            "SELECT key_id, get_byte(artifact, 4096) FROM plugin_artifact WHERE digest = $1 ORDER BY created_at",
        )
        .bind(&digest)
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };
    let stored = rows().await;
    assert_eq!(stored.len(), 1, "the validation's artifact is stored");
    let (key_id, original) = stored[0].clone();

    let b = HostProcess::spawn_with_env(&db.url, "b", &[FAST, &["--cache-dir", &cache_b]].concat(), &key);
    let text = run_via(&db, &b.addr, &token, "py-fresh").await;
    assert!(text.contains("hello from another process"), "{text}");
    assert_eq!(metric(&b.addr, "agent_host_component_compiles_total").await, 0.0, "{}", b.log());
    assert_eq!(metric(&b.addr, "agent_host_component_artifacts_loaded_total").await, 1.0);
    drop(b);

    // One byte of the stored artifact changed: not loaded, recompiled, replaced.
    sqlx::query("UPDATE plugin_artifact SET artifact = set_byte(artifact, 4096, (get_byte(artifact, 4096) + 1) % 256) WHERE digest = $1")
        .bind(&digest)
        .execute(&db.pool)
        .await
        .unwrap();
    let c = HostProcess::spawn_with_env(&db.url, "c", &[FAST, &["--cache-dir", &cache_c]].concat(), &key);
    run_via(&db, &c.addr, &token, "py-fresh").await;
    assert_eq!(metric(&c.addr, "agent_host_component_artifacts_rejected_total").await, 1.0);
    assert_eq!(metric(&c.addr, "agent_host_component_artifacts_loaded_total").await, 0.0);
    assert_eq!(metric(&c.addr, "agent_host_component_compiles_total").await, 1.0);
    c.wait_log("failed its MAC check", LONG).await;
    assert_eq!(rows().await, vec![(key_id.clone(), original)], "the recompiled artifact replaced the tampered one");
    drop(c);

    // Another key: the first key's artifact is neither loaded nor called
    // tampered nor overwritten; this host compiles once for its own key.
    let d = HostProcess::spawn_with_env(&db.url, "d", &[FAST, &["--cache-dir", &cache_d]].concat(), &other_key);
    run_via(&db, &d.addr, &token, "py-fresh").await;
    assert_eq!(metric(&d.addr, "agent_host_component_compiles_total").await, 1.0);
    assert_eq!(metric(&d.addr, "agent_host_component_artifacts_rejected_total").await, 0.0, "{}", d.log());
    drop(d);
    let both = rows().await;
    assert_eq!(both.len(), 2, "one row per key");
    assert_eq!(both[0], (key_id.clone(), original), "the first key's row is untouched");
    assert_ne!(both[1].0, key_id);

    // A key too short to be a secret is refused at start, naming the rule.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .args(["serve", "--database-url", &db.url, "--cache-dir", &cache_d, "--listen", "127.0.0.1:0"])
        .env("AGENT_HOST_ARTIFACT_KEY", "hunter2")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("at least 32 bytes"), "{stderr}");
}

/// The local cache trusts only files with this host's MAC: one byte of a
/// cached compiled component changed, a fresh sandbox on that cache
/// directory deletes the file (counted, logged), recompiles and writes a
/// good one, which the next sandbox loads without compiling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_local_cache_file_is_not_loaded() {
    let db = TestDb::new().await;
    let cache = TempDir::new("guests");
    let wasm = plugin_wasm("fixtures");
    let digest = agent_host::db::plugins::digest_of(&wasm);
    let first: Arc<dyn Components> = Sandbox::new(db.pool.clone(), Some(cache.0.clone())).unwrap();
    let manifest = Manifest::default();
    let plugin_manifest = json!({ "tools": [] });
    agent_host::service::plugins::register(&db.pool, &first, &Actor::cli(), None, "fx", wasm, &plugin_manifest)
        .await
        .unwrap();
    let files = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&cache.0)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
            .collect()
    };
    let file = files().pop().expect("the upload's artifact is cached");
    // No stored row either: what is not loaded must be compiled.
    sqlx::query("DELETE FROM plugin_artifact").execute(&db.pool).await.unwrap();
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 1;
    std::fs::write(&file, &bytes).unwrap();

    let second = Sandbox::new(db.pool.clone(), Some(cache.0.clone())).unwrap();
    let before = second.compile_stats();
    Components::agent(&*second, &digest, &manifest).await.expect("recompiled");
    let after = second.compile_stats();
    assert_eq!(after.artifacts_rejected - before.artifacts_rejected, 1, "{after:?}");
    assert_eq!(after.compiles - before.compiles, 1, "{after:?}");
    let rewritten = std::fs::read(&file).expect("a good file replaces the tampered one");
    assert_ne!(rewritten, bytes);

    let third = Sandbox::new(db.pool.clone(), Some(cache.0.clone())).unwrap();
    Components::agent(&*third, &digest, &manifest).await.expect("loaded from the cache");
    let stats = third.compile_stats();
    assert_eq!((stats.compiles, stats.artifacts_rejected), (0, 0), "{stats:?}");
    // An upload of a digest the cache has is validated without a compile.
    let third: Arc<dyn Components> = third;
    let wasm = plugin_wasm("fixtures");
    agent_host::service::plugins::register(&db.pool, &third, &Actor::cli(), None, "fx-again", wasm, &plugin_manifest)
        .await
        .unwrap();
    assert_eq!(third.compile_stats().compiles, 0);
}

/// A component that could never fit one guest's share of the pool is
/// refused when it is compiled (at upload), with the count it needs.
#[tokio::test]
async fn a_component_past_the_per_component_limits_is_refused_at_upload() {
    let db = TestDb::new().await;
    let sandbox = Sandbox::new(db.pool.clone(), None).unwrap();
    let instances = "(core instance (instantiate $m))\n".repeat(65);
    let wat = format!("(component (core module $m) {instances})");
    let err = sandbox.validate(wat.as_bytes()).unwrap_err().to_string();
    assert!(err.contains("core module instances") && err.contains("64"), "{err}");
}

/// A pool with room for two guests at once and four Python turns wanting
/// one each: the late ones wait for a slot (counted) and every turn completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_makes_a_run_wait_never_fail() {
    let db = TestDb::new().await;
    let cache = TempDir::new("guests");
    let sandbox = Sandbox::with_pool_size(db.pool.clone(), Some(cache.0.clone()), 2).unwrap();
    let components: Arc<dyn Components> = sandbox.clone();
    let manifest = json!({ "tools": ["llm"] });
    let wasm = example_wasm("chat-python");
    agent_host::service::plugins::register(&db.pool, &components, &Actor::cli(), None, "chat-python", wasm, &manifest)
        .await
        .unwrap();
    let agents = AgentRegistry::with_builtins().with_sandbox(components);
    let host = TestHost::start(&db, Some(Hub::start(db.url.clone())), agents, fast_config("w")).await;
    let mut runs = Vec::new();
    for i in 0..4 {
        runs.push(post(&host, "chat-python", &format!("turn {i}"), json!({ "hold_ms": 300, "answer": "done" })).await);
    }
    for run in runs {
        assert_eq!(wait_terminal(&db.pool, run, LONG).await, "completed", "{}", run_error(&db.pool, run).await);
    }
    assert!(sandbox.compile_stats().pool_waits > 0, "the late turns waited: {:?}", sandbox.compile_stats());
    host.stop().await;
}

/// The JavaScript build leaves out the WASI features the host does not
/// grant: its component names no `wasi:http` interface it would import
/// (outgoing requests, their types), while the host's own interface is there.
#[test]
fn the_javascript_component_leaves_out_wasi_http() {
    let wasm = example_wasm("chat-js");
    let has = |name: &str| wasm.windows(name.len()).any(|w| w == name.as_bytes());
    assert!(has("agent-host:plugin/host@0.2.0"));
    for absent in ["wasi:http/outgoing-handler", "wasi:http/types"] {
        assert!(!has(absent), "the component names {absent}");
    }
}
