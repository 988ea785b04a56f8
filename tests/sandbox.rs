//! Sandboxed runs with real guest components built from `plugins/`: the echo
//! plugin end to end, misbehaving fixtures ending with named reasons while
//! other runs complete, refused uploads, pinned digests, fenced guests.

use std::sync::Arc;
use std::time::Duration;

use agent_host::agent::{AgentRegistry, Components};

use crate::support::http::multipart;
use crate::support::*;
use agent_host::db::{lifecycle, plugins, tokens, RunId};
use agent_host::hub::Hub;
use agent_host::worker::{Worker, WorkerConfig};
use axum::body::Body;
use axum::http::{header, StatusCode};
use serde_json::{json, Value};

struct Env {
    db: TestDb,
    agents: AgentRegistry,
    router: axum::Router,
    token: String,
}

impl Env {
    async fn new() -> Env {
        let db = TestDb::new().await;
        let (agents, router) = sandboxed_router(&db);
        let token = tokens::create(&db.pool, "alice", "acme", false).await.unwrap();
        Env { db, agents, router, token }
    }

    fn sandbox(&self) -> &Arc<dyn Components> {
        self.agents.sandbox().unwrap()
    }

    async fn register(&self, name: &str, wasm: &str, manifest: Value) -> String {
        let bytes = plugin_wasm(wasm);
        self.sandbox().validate(&bytes).unwrap();
        plugins::put(&self.db.pool, name, &bytes, &manifest).await.unwrap().digest
    }

    async fn post_run(&self, plugin: &str, content: &str, config: Value) -> (StatusCode, Value) {
        let body = json!({ "content": content, "plugin": plugin, "config": config }).to_string();
        let req = request("POST", "/v1/runs", Some(&self.token))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .unwrap();
        let (status, _, value) = oneshot(&self.router, req).await;
        assert!(!value.is_null(), "a JSON answer");
        (status, value)
    }

    async fn run(&self, plugin: &str, content: &str, config: Value) -> RunId {
        let (status, v) = self.post_run(plugin, content, config).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{v}");
        v["run_id"].as_str().unwrap().parse().unwrap()
    }

    async fn worker(&self, config: WorkerConfig) -> Worker {
        Worker::start(self.db.pool.clone(), Some(Hub::start(self.db.url.clone())), self.agents.clone(), config)
            .await
            .unwrap()
    }

    async fn wait_terminal(&self, id: RunId) -> (String, String) {
        let status = wait_terminal(&self.db.pool, id, LONG).await;
        (status, run_error(&self.db.pool, id).await)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_echo_plugin_streams_the_message_back() {
    let env = Env::new().await;
    let digest = env.register("echo", "echo", json!({})).await;
    let w = env.worker(fast_config("w")).await;
    let id = env.run("echo", "hello from a sandboxed guest", json!({})).await;
    assert_eq!(env.wait_terminal(id).await, ("completed".into(), String::new()));
    let pinned: Option<String> = sqlx::query_scalar("SELECT plugin_digest FROM agent_run WHERE id = $1")
        .bind(id)
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
    assert_eq!(pinned.as_deref(), Some(digest.as_str()));
    let deltas: Vec<String> = sqlx::query_scalar(
        "SELECT payload->>'delta' FROM run_event WHERE run_id = $1 AND type = 'content_delta' ORDER BY seq",
    )
    .bind(id)
    .fetch_all(&env.db.pool)
    .await
    .unwrap();
    assert_eq!(deltas.concat(), "hello from a sandboxed guest");
    let answer: String = sqlx::query_scalar("SELECT content FROM message WHERE run_id = $1 AND role = 'assistant'")
        .bind(id)
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
    assert_eq!(answer, "hello from a sandboxed guest");
    assert_journal_sound(&env.db.pool, id).await;
    w.drain().await;
}

/// Each misbehaviour ends its own run with a named reason within its limit,
/// while an ordinary run on the same host completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_guests_end_with_named_reasons_and_others_carry_on() {
    let env = Env::new().await;
    let limits = json!({ "limits": { "cpu_ms": 300, "memory_bytes": 32 << 20, "wall_ms": 3000, "events_max": 5,
                                     "host_calls_max": 50 } });
    env.register("fixtures", "fixtures", limits).await;
    env.register("echo", "echo", json!({})).await;
    let w = env.worker(WorkerConfig { max_runs: 12, ..fast_config("w") }).await;
    let cases = [
        ("spin", "failed", "limit: cpu time"),
        ("membomb", "failed", "limit: memory"),
        ("trap", "failed", "trap"),
        ("oversized", "failed", "limit: event payload"),
        ("ungranted-tool", "failed", "denied"),
        ("chatty", "failed", "limit: more than 5 events"),
        ("block", "failed", "limit: wall time"),
        ("calls", "failed", "limit: more than 50 host calls"),
    ];
    let mut ids = Vec::new();
    for (mode, _, _) in &cases {
        ids.push(
            env.run(
                "fixtures",
                "misbehave",
                json!({ "mode": mode, "count": if *mode == "calls" { 100_000 } else { 10 } }),
            )
            .await,
        );
    }
    let ordinary = env.run("echo", "still here", json!({})).await;
    assert_eq!(env.wait_terminal(ordinary).await.0, "completed");
    for ((mode, want_status, want_reason), id) in cases.iter().zip(ids) {
        let (status, error) = env.wait_terminal(id).await;
        assert_eq!(&status, want_status, "{mode}: {error}");
        assert!(error.contains(want_reason), "{mode}: {error:?} does not name {want_reason:?}");
        // The reason reaches the stream's complete event too.
        let complete: Value =
            sqlx::query_scalar("SELECT payload FROM run_event WHERE run_id = $1 AND type = 'complete'")
                .bind(id)
                .fetch_one(&env.db.pool)
                .await
                .unwrap();
        assert_eq!(complete["error"].as_str(), Some(error.as_str()), "{mode}");
    }
    w.drain().await;
}

/// Issue 40: what a guest may take from the host through WASI is bounded.
/// A call asking for 2 MiB of random bytes (past the cap of 1 MiB a call)
/// and a guest making 20,000 pollables it never drops (40,000 entries, past
/// the resource table's 10,000) each end their own run failed with a named
/// reason (the host names both `trap`), while a neighbour run on the same
/// host, running beside them, goes on and completes; and a
/// guest within both caps (1 MiB of random, 4,000 pollables: 8,000 entries)
/// completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_taking_too_much_random_or_too_many_resources_fails_alone() {
    use agent_host::sandbox::{RANDOM_BYTES_MAX, RESOURCES_MAX};
    let env = Env::new().await;
    env.register("fixtures", "fixtures", json!({})).await;
    let w = env.worker(fast_config("w")).await;
    env.register("echo", "echo", json!({})).await;
    let neighbour = env.run("fixtures", "beside", json!({ "mode": "block", "ms": 2_000 })).await;
    wait_status(&env.db.pool, neighbour, "running", LONG).await;
    let random = env.run("fixtures", "take", json!({ "mode": "random", "bytes": 2 * RANDOM_BYTES_MAX })).await;
    let resources = env.run("fixtures", "take", json!({ "mode": "resources", "count": 2 * RESOURCES_MAX })).await;
    let cases = [
        (random, "trap", format!("requested len {} exceeds limit {RANDOM_BYTES_MAX}", 2 * RANDOM_BYTES_MAX)),
        (resources, "trap", "resource table has no free keys".to_string()),
    ];
    for (id, reason, says) in &cases {
        let (status, error) = env.wait_terminal(*id).await;
        assert_eq!(status, "failed", "{error}");
        assert!(error.starts_with(&format!("{reason}: ")), "{error:?} is not named {reason:?}");
        assert!(error.contains(says.as_str()), "{error:?} does not say {says:?}");
        assert_journal_sound(&env.db.pool, *id).await;
    }
    assert_eq!(status(&env.db.pool, neighbour).await, "running", "the neighbour ended with them");
    let (status, error) = env.wait_terminal(neighbour).await;
    assert_eq!(status, "completed", "the neighbour: {error}");
    let after = env.run("echo", "still here", json!({})).await;
    assert_eq!(env.wait_terminal(after).await, ("completed".into(), String::new()));
    // Within the caps, the same modes complete.
    let within = [
        json!({ "mode": "random", "bytes": RANDOM_BYTES_MAX }),
        // A pollable from the clock takes two entries of the table (the
        // deadline and the pollable over it).
        json!({ "mode": "resources", "count": RESOURCES_MAX / 2 - 1_000 }),
    ];
    for config in within {
        let id = env.run("fixtures", "take", config.clone()).await;
        assert_eq!(env.wait_terminal(id).await, ("completed".into(), String::new()), "{config}");
    }
    w.drain().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasi_grants_nothing() {
    let env = Env::new().await;
    env.register("fixtures", "fixtures", json!({})).await;
    let w = env.worker(fast_config("w")).await;
    let id = env.run("fixtures", "try", json!({ "mode": "escape" })).await;
    assert_eq!(env.wait_terminal(id).await.0, "completed");
    let answer: String = sqlx::query_scalar("SELECT content FROM message WHERE run_id = $1 AND role = 'assistant'")
        .bind(id)
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
    let seen: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(seen, json!({ "file": false, "env": 0, "net": false }));
    // Output past the cap is dropped, not fatal: a chatty guest still completes.
    let noisy = env.run("fixtures", "print", json!({ "mode": "noisy" })).await;
    assert_eq!(env.wait_terminal(noisy).await, ("completed".into(), String::new()));
    w.drain().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn components_that_do_not_fit_the_world_are_refused() {
    let env = Env::new().await;
    let err = env.sandbox().validate(b"definitely not wasm").unwrap_err().to_string();
    assert!(err.contains("not a component"), "{err}");
    // A valid component that does not export `run`.
    let err = env.sandbox().validate(b"(component)").unwrap_err().to_string();
    assert!(err.contains("not a component of the agent-host:plugin world"), "{err}");
    // A component importing something the host does not provide.
    let wat = r#"(component (import "evil:net/sockets" (instance (export "connect" (func)))))"#;
    let err = env.sandbox().validate(wat.as_bytes()).unwrap_err().to_string();
    assert!(err.contains("evil:net/sockets"), "{err}");
    // An unknown plugin is refused at enqueue.
    let (status, v) = env.post_run("nope", "x", json!({})).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
}

/// A run executes the digest its plugin name pointed at when it was enqueued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repointed_name_does_not_change_an_enqueued_run() {
    let env = Env::new().await;
    let echo = env.register("agent", "echo", json!({})).await;
    let id = env.run("agent", "pinned words", json!({ "mode": "trap" })).await;
    let fixtures = env.register("agent", "fixtures", json!({})).await;
    assert_ne!(echo, fixtures);
    let w = env.worker(fast_config("w")).await;
    assert_eq!(env.wait_terminal(id).await.0, "completed", "the run executed the re-pointed component");
    let later = env.run("agent", "x", json!({ "mode": "trap" })).await;
    assert_eq!(env.wait_terminal(later).await.0, "failed");
    w.drain().await;
}

/// A guest that keeps going after its claim was lost gets `fenced` and is
/// interrupted: nothing more is written, and the worker stands down at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_keeps_going_after_its_claim_was_lost_is_interrupted() {
    let env = Env::new().await;
    env.register("fixtures", "fixtures", json!({})).await;
    let config = WorkerConfig {
        lease: Duration::from_secs(600),
        heartbeat: Duration::from_secs(300),
        reap_interval: Duration::from_secs(3600),
        journal_flush: Duration::from_millis(20),
        ..fast_config("w")
    };
    let w = env.worker(config).await;
    let id = env.run("fixtures", "go", json!({ "mode": "narrate" })).await;
    let pool = env.db.pool.clone();
    wait_for("the guest to narrate", LONG, || {
        let pool = pool.clone();
        async move { journal(&pool, id).await.len() > 5 }
    })
    .await;
    update_run(&env.db.pool, id, "claim_expires_at = now() - interval '1 hour'").await;
    let expired = lifecycle::find_expired(&env.db.pool, Duration::ZERO, 10).await.unwrap();
    assert!(lifecycle::reap(&env.db.pool, expired[0], Duration::ZERO).await.unwrap());
    let ended = journal(&env.db.pool, id).await;
    wait_fenced(&w, "the guest to be interrupted").await;
    assert_eq!(journal(&env.db.pool, id).await, ended);
    w.drain().await;
}

/// `POST /v1/plugins` (admins only) validates before it stores; `GET` lists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_upload_over_http_for_admins_only() {
    let env = Env::new().await;
    let admin = tokens::create(&env.db.pool, "root", "acme", true).await.unwrap();
    let upload = |token: String, fields: Vec<(&'static str, Vec<u8>)>| {
        let router = env.router.clone();
        async move {
            let borrowed: Vec<(&str, &[u8])> = fields.iter().map(|(n, v)| (*n, v.as_slice())).collect();
            let (ct, body) = multipart(&borrowed);
            let req = request("POST", "/v1/plugins", Some(&token))
                .header(header::CONTENT_TYPE, ct)
                .body(Body::from(body))
                .unwrap();
            let (status, _, value) = oneshot(&router, req).await;
            (status, value)
        }
    };
    let echo = plugin_wasm("echo");
    let (status, v) = upload(env.token.clone(), vec![("name", b"echo".to_vec()), ("component", echo.clone())]).await;
    assert_eq!((status, v["error"]["code"].as_str()), (StatusCode::FORBIDDEN, Some("forbidden")));
    let (status, v) = upload(admin.clone(), vec![("name", b"junk".to_vec()), ("component", b"nope".to_vec())]).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("not a component"), "{v}");
    let (status, v) = upload(
        admin.clone(),
        vec![
            ("name", b"echo".to_vec()),
            ("component", echo.clone()),
            ("manifest", br#"{"limits": {"nope": 1}}"#.to_vec()),
        ],
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    let (status, v) = upload(
        admin.clone(),
        vec![("name", b"echo".to_vec()), ("component", echo.clone()), ("manifest", br#"{"tools": ["llm"]}"#.to_vec())],
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{v}");
    assert_eq!(v["digest"].as_str().unwrap(), plugins::digest_of(&echo));
    assert_eq!(v["manifest"]["tools"][0], "llm");

    let req = request("GET", "/v1/plugins", Some(&env.token)).body(Body::empty()).unwrap();
    let (status, _, listed) = oneshot(&env.router, req).await;
    assert_eq!(status, StatusCode::OK);
    let names: Vec<&str> = listed["plugins"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"echo") && names.contains(&"noop") && !names.contains(&"junk"), "{listed}");
    // The uploaded plugin runs.
    let w = env.worker(fast_config("w")).await;
    let id = env.run("echo", "uploaded and running", json!({})).await;
    assert_eq!(env.wait_terminal(id).await.0, "completed");
    w.drain().await;
}
