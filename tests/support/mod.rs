//! Test support: one private PostgreSQL cluster per test binary (or the
//! server in DATABASE_URL), a migrated template, and a fresh database per test.
#![allow(dead_code)]

pub mod durable;
pub mod http;
pub mod mcp_servers;
pub mod process;
pub mod sse;
pub mod tools;
mod wait;

pub use wait::*;

use std::sync::OnceLock;
use std::time::Duration;

use agent_host::agent::AgentRegistry;
use agent_host::cluster::{Cluster, ClusterOptions};
use agent_host::db::enqueue::{self, Enqueued, NewRun, Owner};
use agent_host::db::{self, lifecycle, ConversationId, RunId};
use agent_host::hub::Hub;
use agent_host::worker::{Worker, WorkerConfig};
use serde_json::{json, Value};
use sqlx::{Connection, PgPool};

const TEMPLATE: &str = "agent_host_test_template";

struct Server {
    /// Base URL without a database name, e.g. postgres://postgres@127.0.0.1:5432
    base: String,
    _cluster: Option<Cluster>,
}

fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        // A thread of its own: we may be inside a test's runtime.
        std::thread::spawn(|| {
            let (base, cluster) = match std::env::var("DATABASE_URL") {
                Ok(url) => {
                    let base = url.rsplit_once('/').map(|(b, _)| b.to_string()).unwrap_or(url);
                    (base, None)
                }
                Err(_) => {
                    let dir = std::env::temp_dir().join(format!("agent-host-test-{}", std::process::id()));
                    let cluster = Cluster::start(&ClusterOptions { dir, ephemeral: true, remove_on_exit: true })
                        .expect("starting the test cluster");
                    let url = cluster.url("postgres");
                    (url.rsplit_once('/').unwrap().0.to_string(), Some(cluster))
                }
            };
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let mut admin = sqlx::PgConnection::connect(&format!("{base}/postgres")).await.unwrap();
                sqlx::query(&format!("DROP DATABASE IF EXISTS {TEMPLATE}")).execute(&mut admin).await.unwrap();
                sqlx::query(&format!("CREATE DATABASE {TEMPLATE}")).execute(&mut admin).await.unwrap();
                let pool = db::connect(&format!("{base}/{TEMPLATE}"), 1).await.unwrap();
                db::migrate(&pool).await.unwrap();
                pool.close().await;
                admin.close().await.unwrap();
            });
            Server { base, _cluster: cluster }
        })
        .join()
        .expect("test database setup")
    })
}

/// Restarts the private cluster under whatever is connected to it; `false`
/// when the tests run against DATABASE_URL's server, which is not ours to restart.
pub fn restart_postgres() -> bool {
    match &server()._cluster {
        Some(cluster) => {
            cluster.restart().expect("restarting PostgreSQL");
            true
        }
        None => false,
    }
}

/// Crashes the private cluster (immediate stop, crash recovery at start)
/// under whatever is connected to it; `false` against DATABASE_URL's server.
pub fn crash_postgres() -> bool {
    match &server()._cluster {
        Some(cluster) => {
            cluster.crash_restart().expect("crashing and restarting PostgreSQL");
            true
        }
        None => false,
    }
}

/// A fresh, migrated database of its own.
pub struct TestDb {
    pub url: String,
    pub pool: PgPool,
}

impl TestDb {
    pub async fn new() -> TestDb {
        let server = server();
        let name = format!("t_{}", uuid::Uuid::new_v4().simple());
        let mut admin = sqlx::PgConnection::connect(&format!("{}/postgres", server.base)).await.unwrap();
        sqlx::query(&format!("CREATE DATABASE {name} TEMPLATE {TEMPLATE}")).execute(&mut admin).await.unwrap();
        admin.close().await.unwrap();
        let url = format!("{}/{name}", server.base);
        let pool = db::connect(&url, 20).await.unwrap();
        TestDb { url, pool }
    }

    /// Another pool on the same database (another "process" in spirit).
    pub async fn pool(&self, max: u32) -> PgPool {
        db::connect(&self.url, max).await.unwrap()
    }
}

/// A user of tenant `name` (`<name>-user`).
pub fn tenant(name: &str) -> Owner {
    Owner { user_id: format!("{name}-user"), tenant_id: name.into() }
}

pub fn owner() -> Owner {
    Owner { user_id: "alice".into(), tenant_id: "acme".into() }
}

pub async fn enqueue(pool: &PgPool, conversation: Option<ConversationId>, plugin: &str, config: Value) -> Enqueued {
    enqueue_as(pool, &owner(), conversation, plugin, config).await
}

pub async fn enqueue_as(
    pool: &PgPool,
    owner: &Owner,
    conversation: Option<ConversationId>,
    plugin: &str,
    config: Value,
) -> Enqueued {
    try_enqueue_as(pool, owner, conversation, plugin, config).await.unwrap()
}

/// [`enqueue_as`], its refusal returned.
pub async fn try_enqueue_as(
    pool: &PgPool,
    owner: &Owner,
    conversation: Option<ConversationId>,
    plugin: &str,
    config: Value,
) -> Result<Enqueued, enqueue::EnqueueError> {
    let request = json!({ "plugin": plugin });
    enqueue::enqueue(pool, &new_run(owner, conversation, plugin, &config, &request)).await
}

/// A turn "hello agent" of `plugin` for `owner` in `conversation` (`None`:
/// a new one), its plugin not pinned.
pub fn new_run<'a>(
    owner: &'a Owner,
    conversation: Option<ConversationId>,
    plugin: &'a str,
    config: &'a Value,
    request: &'a Value,
) -> NewRun<'a> {
    NewRun {
        owner,
        conversation_id: conversation,
        content: "hello agent",
        plugin,
        plugin_digest: None,
        plugin_manifest: None,
        config,
        request,
        idempotency_key: None,
        webhook: None,
        parent: None,
    }
}

/// Short leases and ticks, set through configuration.
pub fn fast_config(worker_id: &str) -> WorkerConfig {
    WorkerConfig {
        max_runs: 8,
        lease: Duration::from_millis(1_000),
        heartbeat: Duration::from_millis(200),
        reap_grace: Duration::from_millis(300),
        reap_interval: Duration::from_millis(100),
        poll_tick: Duration::from_millis(500),
        drain_timeout: Duration::from_secs(5),
        worker_id: worker_id.into(),
        journal_flush: Duration::from_millis(50),
        retention: Duration::from_secs(24 * 3600),
        retention_interval: Duration::from_secs(60),
        cancel_grace: Duration::from_millis(500),
        tenant_max_running: None,
        // Every slot for one tenant: the tests of the default share set it.
        tenant_slot_share_pct: 100,
        dispatch: true,
        ..WorkerConfig::default()
    }
}

/// The deadline of a wait that should end long before it: only a failing
/// test waits this long.
pub const LONG: Duration = Duration::from_secs(60);

/// A hub on the test database, once it is connected (so its connect is no
/// wake for a worker started after).
pub async fn connected_hub(db: &TestDb) -> Hub {
    let hub = Hub::start(db.url.clone());
    let h = hub.clone();
    wait_for("the hub to connect", LONG, || {
        let h = h.clone();
        async move { h.stats().connected.load(std::sync::atomic::Ordering::Relaxed) }
    })
    .await;
    hub
}

/// A worker running `agents` on the test database, with its own hub.
pub async fn start_worker_with(db: &TestDb, agents: AgentRegistry, config: WorkerConfig) -> Worker {
    Worker::start(db.pool.clone(), Some(Hub::start(db.url.clone())), agents, config).await.unwrap()
}

/// A worker running the built-in agents on the test database, with its own hub.
pub async fn start_worker(db: &TestDb, config: WorkerConfig) -> Worker {
    start_worker_with(db, AgentRegistry::with_builtins(), config).await
}

pub async fn status(pool: &PgPool, id: RunId) -> String {
    sqlx::query_scalar("SELECT status FROM agent_run WHERE id = $1").bind(id).fetch_one(pool).await.unwrap()
}

pub async fn wait_status(pool: &PgPool, id: RunId, want: &str, within: Duration) {
    let p = pool.clone();
    wait_for(&format!("run {id} to be {want}"), within, || {
        let p = p.clone();
        async move { status(&p, id).await == want }
    })
    .await;
}

/// Waits for a run to be terminal; returns its status.
pub async fn wait_terminal(pool: &PgPool, run: RunId, within: Duration) -> String {
    wait_for(&format!("run {run} to end"), within, || async {
        ["completed", "failed", "cancelled"].contains(&status(pool, run).await.as_str())
    })
    .await;
    status(pool, run).await
}

/// A request to the in-process router, with `token` as its bearer.
pub fn request(method: &str, uri: &str, token: Option<&str>) -> axum::http::request::Builder {
    let req = axum::http::Request::builder().method(method).uri(uri);
    match token {
        Some(t) => req.header(axum::http::header::AUTHORIZATION, format!("Bearer {t}")),
        None => req,
    }
}

/// One request through the in-process router (tower's `oneshot`): the
/// status, the headers, and the body as JSON (`Null` when it is not JSON).
pub async fn oneshot(
    router: &axum::Router,
    req: axum::http::Request<axum::body::Body>,
) -> (axum::http::StatusCode, axum::http::HeaderMap, Value) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let res = router.clone().oneshot(req).await.unwrap();
    let (status, headers) = (res.status(), res.headers().clone());
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    (status, headers, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// The journal of a run as (seq, type).
pub async fn journal(pool: &PgPool, id: RunId) -> Vec<(i32, String)> {
    sqlx::query_as("SELECT seq, type FROM run_event WHERE run_id = $1 ORDER BY seq")
        .bind(id)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// The journal of a run as (seq, type, payload).
pub async fn journal_payloads(pool: &PgPool, run: RunId) -> Vec<(i32, String, Value)> {
    sqlx::query_as("SELECT seq, type, payload FROM run_event WHERE run_id = $1 ORDER BY seq")
        .bind(run)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// The text of a journal's `content_delta` events, in order.
pub fn deltas_text(journal: &[(i32, String, Value)]) -> String {
    journal.iter().filter(|(_, t, _)| t == "content_delta").map(|(_, _, p)| p["delta"].as_str().unwrap()).collect()
}

/// Journal invariants every run keeps: seq 1..n without gaps, at most one
/// `complete`, and nothing after it.
pub async fn assert_journal_sound(pool: &PgPool, id: RunId) -> Vec<(i32, String)> {
    let j = journal(pool, id).await;
    for (i, (seq, _)) in j.iter().enumerate() {
        assert_eq!(*seq, i as i32 + 1, "run {id}: seq gap in {j:?}");
    }
    let completes: Vec<_> = j.iter().filter(|(_, t)| t == "complete").collect();
    assert!(completes.len() <= 1, "run {id}: {} complete events", completes.len());
    if let Some((seq, _)) = completes.first() {
        assert_eq!(*seq as usize, j.len(), "run {id}: events after complete: {j:?}");
    }
    j
}

/// No journal event without its run and no message without its
/// conversation (the schema refuses deleting either parent, and every
/// insert takes the parent's id from its row: migrations/0014).
pub async fn assert_no_orphans(pool: &PgPool) {
    let (events, messages): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM run_event e WHERE NOT EXISTS (SELECT 1 FROM agent_run r WHERE r.id = e.run_id)),
                (SELECT count(*) FROM message m
                 WHERE NOT EXISTS (SELECT 1 FROM conversation c WHERE c.id = m.conversation_id))",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((events, messages), (0, 0), "events without a run, messages without a conversation");
}

/// A run's error text (empty when none).
pub async fn run_error(pool: &PgPool, id: RunId) -> String {
    sqlx::query_scalar::<_, Option<String>>("SELECT error FROM agent_run WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
        .unwrap_or_default()
}

/// A guest component from `plugins/`, built once (for wasm32-wasip2) if the
/// test command has not built it already.
pub fn plugin_wasm(name: &str) -> Vec<u8> {
    static BUILT: OnceLock<()> = OnceLock::new();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let path = root.join("plugins/target/wasm32-wasip2/release").join(format!("{name}.wasm"));
    if !path.exists() {
        BUILT.get_or_init(|| {
            let status = std::process::Command::new(env!("CARGO"))
                .args(["build", "--release", "--target", "wasm32-wasip2", "--manifest-path"])
                .arg(root.join("plugins/Cargo.toml"))
                .arg("--target-dir")
                .arg(root.join("plugins/target"))
                .status()
                .expect("running cargo for the plugins");
            assert!(status.success(), "building plugins/ failed (is the wasm32-wasip2 target installed?)");
        });
    }
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Makes every insert into `table` fail with `message`: a plpgsql function
/// `function` raising it, and a trigger `trigger` before each insert.
pub async fn fail_inserts(pool: &PgPool, function: &str, trigger: &str, table: &str, message: &str) {
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION '{message}'; END $$;
         CREATE TRIGGER {trigger} BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION {function}();"
    ))
    .execute(pool)
    .await
    .unwrap();
}

/// Claims one run for `worker_id` with `lease` (and the prefilter on).
/// A claim of up to `limit` rows by `worker_id` (a 30 s lease, no cap, no rooms).
pub fn claim_args(worker_id: &str, limit: i64, prefilter: bool) -> lifecycle::Claim<'_> {
    lifecycle::Claim {
        limit,
        lease: Duration::from_secs(30),
        worker_id,
        prefilter,
        tenant_max_running: None,
        rooms: Default::default(),
    }
}

pub async fn claim_one(pool: &PgPool, worker_id: &str, lease: Duration) -> lifecycle::ClaimedRun {
    lifecycle::claim(
        pool,
        &lifecycle::Claim {
            limit: 1,
            lease,
            worker_id,
            prefilter: true,
            tenant_max_running: None,
            rooms: Default::default(),
        },
    )
    .await
    .unwrap()
    .remove(0)
}

/// `UPDATE agent_run SET <set> WHERE id = run`: a row forced into a state
/// (a lease in the past, a status flipped behind the worker's back).
pub async fn update_run(pool: &PgPool, run: RunId, set: &str) {
    sqlx::query(&format!("UPDATE agent_run SET {set} WHERE id = $1")).bind(run).execute(pool).await.unwrap();
}

/// Waits until `worker` has fenced one run (`what` names the wait), then
/// checks it runs nothing.
pub async fn wait_fenced(worker: &Worker, what: &str) {
    let ws = worker.stats();
    wait_for(what, LONG, || {
        let ws = ws.clone();
        async move { ws.fenced.load(std::sync::atomic::Ordering::Relaxed) == 1 }
    })
    .await;
    assert_eq!(worker.in_flight(), 0);
}

/// A fresh directory under the system's temporary one, removed when
/// dropped (compiled components are tens of MB).
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(what: &str) -> TempDir {
        TempDir(std::env::temp_dir().join(format!("agent-host-{what}-{}", uuid::Uuid::new_v4().simple())))
    }

    /// The path as a command-line argument.
    pub fn arg(&self) -> String {
        self.0.to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Built-in agents with a sandbox (so plugin names reach the registry), and
/// the router in-process over them.
pub fn sandboxed_router(db: &TestDb) -> (AgentRegistry, axum::Router) {
    let cache = std::env::temp_dir().join(format!("agent-host-cache-{}", std::process::id()));
    let sandbox = agent_host::sandbox::Sandbox::new(db.pool.clone(), Some(cache)).unwrap();
    let agents = AgentRegistry::with_builtins().with_sandbox(sandbox);
    let router = agent_host::api::router(agent_host::api::AppState::new(db.pool.clone(), agents.clone(), None));
    (agents, router)
}

/// A test-only audit of every status transition, in commit-compatible
/// order: the sequence is drawn after the row's unique-index check passed.
/// A run inserted already running (an eager start) is a transition from
/// `(insert)`.
pub async fn install_audit(pool: &PgPool) {
    for sql in [
        "CREATE TABLE run_audit (n bigserial PRIMARY KEY, run_id uuid, conversation_id uuid, old text, new text)",
        "CREATE FUNCTION run_audit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO run_audit (run_id, conversation_id, old, new)
             VALUES (NEW.id, NEW.conversation_id,
                     CASE WHEN TG_OP = 'INSERT' THEN '(insert)' ELSE OLD.status END, NEW.status);
             RETURN NULL;
         END $$",
        "CREATE TRIGGER run_audit AFTER UPDATE OF status ON agent_run
         FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION run_audit()",
        "CREATE TRIGGER run_audit_insert AFTER INSERT ON agent_run
         FOR EACH ROW WHEN (NEW.status <> 'queued') EXECUTE FUNCTION run_audit()",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

/// An example plugin of any language (`plugins/<dir>`), built with
/// `scripts/build-plugin` (which skips the build when its inputs are
/// unchanged: the test command has built them already).
pub fn example_wasm(dir: &str) -> Vec<u8> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let out = std::process::Command::new(root.join("scripts/build-plugin"))
        .arg(root.join("plugins").join(dir))
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("running scripts/build-plugin");
    assert!(out.status.success(), "scripts/build-plugin plugins/{dir} failed");
    let path = String::from_utf8(out.stdout).unwrap().lines().last().unwrap().to_string();
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Enqueues a built-in run with `manifest` pinned.
pub async fn enqueue_pinned(db: &TestDb, plugin: &str, manifest: Option<&Value>, config: Value) -> RunId {
    let request = json!({});
    let new = NewRun {
        owner: &owner(),
        conversation_id: None,
        content: "hello",
        plugin,
        plugin_digest: None,
        plugin_manifest: manifest,
        config: &config,
        request: &request,
        idempotency_key: None,
        webhook: None,
        parent: None,
    };
    enqueue::enqueue(&db.pool, &new).await.unwrap().run_id
}
