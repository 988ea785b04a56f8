//! Guests in Python and JavaScript beside Rust (the `chat` examples):
//!
//! - the first run of a freshly uploaded plugin on a process that never saw
//!   it: enqueue to the guest's first event (its `step`), each sample on a
//!   fresh sandbox (a new engine, an empty local cache: what a new process
//!   has) whose worker claims the run; the upload compiled it once and
//!   stored the artifact, so the fresh sandbox deserializes. Beside it, one
//!   first run with no stored artifact (it compiles);
//! - per run: store + instantiate + a bare turn (no host call: the chats'
//!   `answer` switch, Rust's `echo` of nothing), and + one chat turn over the
//!   offline model;
//! - memory per parked guest, Python and JavaScript (each in `hold_ms`):
//!   resident, proportional and private dirty (`/proc/self/smaps_rollup`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::figures::{memory_of, percentiles};
use crate::library::WorkerConfig;
use crate::library::{self, guest_input, probe_failed, run_guest, Agent, AgentError, AgentRegistry, Components};
use crate::library::{DbArgs, Hub, Manifest, RunHost, RunInput, RunStatus, Sandbox, ToolRegistry, Worker};
use crate::{sql, BenchArgs};

/// First runs per language (each on a fresh sandbox).
const FIRST_RUNS: usize = 5;

/// Chat turns per language for the per-run figure, at most.
const TURNS_MAX: usize = 200;
/// Python guests parked at once, at most.
const PARKED_MAX: usize = 50;
/// Bound on any one wait.
const WAIT_MAX: Duration = Duration::from_secs(300);
const PROBE: &str = "guests-probe";

/// A directory removed when dropped.
struct TempDir(PathBuf);

/// Distinguishes this process's temporary directories.
static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl TempDir {
    fn new(what: &str) -> TempDir {
        TempDir(std::env::temp_dir().join(format!(
            "agent-host-bench-{what}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        )))
    }
}

/// A sandbox on `cache` with the bench's one artifact key (its sandboxes
/// stand for processes of one deployment, which share a key).
fn sandbox(pool: &PgPool, cache: &TempDir) -> anyhow::Result<Arc<Sandbox>> {
    static KEY: std::sync::OnceLock<agent_host::sandbox::key::ArtifactKey> = std::sync::OnceLock::new();
    let key = KEY.get_or_init(|| agent_host::sandbox::key::ArtifactKey::random().expect("a random key")).clone();
    Ok(Sandbox::with_key(pool.clone(), Some(cache.0.clone()), key)?)
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn manifest() -> Value {
    json!({ "tools": ["llm"] })
}

/// The offline model, as every host has it.
fn tools() -> anyhow::Result<ToolRegistry> {
    ToolRegistry::from_config(&Default::default(), &[]).map_err(anyhow::Error::msg)
}

pub async fn guests(pool: &PgPool, url: &str, _db_args: &DbArgs, args: &BenchArgs) -> anyhow::Result<()> {
    let chats = [
        ("chat", args.plugin_dir.join("chat.wasm")),
        ("chat-python", args.guest_dir.join("chat-python.wasm")),
        ("chat-js", args.guest_dir.join("chat-js.wasm")),
    ];
    let mut present = Vec::new();
    for (name, path) in &chats {
        match std::fs::read(path) {
            Ok(bytes) => present.push((*name, bytes)),
            Err(_) => println!("guests: {name} skipped, no {} (scripts/build-plugin plugins/{name})", path.display()),
        }
    }
    let mut digests = Vec::new();
    for (name, bytes) in &present {
        digests.push((name.to_string(), first_runs(pool, url, name, bytes).await?));
    }
    // Per-run cost and parked memory, on one sandbox that has them all.
    sql::reset(pool).await?;
    let cache = TempDir::new("guests");
    let sandbox = sandbox(pool, &cache)?;
    let uploader: Arc<dyn Components> = sandbox.clone();
    for (name, bytes) in &present {
        register(pool, &uploader, name, bytes.clone()).await?;
    }
    let mut bare = Vec::new();
    if let Ok(echo) = std::fs::read(args.plugin_dir.join("echo.wasm")) {
        bare.push(("echo".to_string(), register(pool, &uploader, "echo", echo).await?, json!({})));
    }
    for (name, digest) in digests.iter().filter(|(n, _)| n != "chat") {
        bare.push((name.clone(), digest.clone(), json!({ "answer": "" })));
    }
    let parkable: Vec<(String, String)> =
        digests.iter().filter(|(n, _)| n == "chat-python" || n == "chat-js").cloned().collect();
    let probe = Arc::new(Probe {
        sandbox,
        digests,
        bare,
        parkable,
        turns: args.samples.min(TURNS_MAX),
        parked: args.parked.min(PARKED_MAX),
    });
    probe_run(pool, url, probe.clone(), "turns").await?;
    probe_run(pool, url, probe, "parked").await
}

async fn register(pool: &PgPool, sandbox: &Arc<dyn Components>, name: &str, bytes: Vec<u8>) -> anyhow::Result<String> {
    let actor = agent_host::db::audit::Actor::cli();
    let row = agent_host::service::plugins::register(pool, sandbox, &actor, None, name, bytes, &manifest()).await?;
    Ok(row.digest)
}

/// Uploads `name` (timed: validation is its one compile), then times its
/// first run on fresh sandboxes; returns its digest.
async fn first_runs(pool: &PgPool, url: &str, name: &str, bytes: &[u8]) -> anyhow::Result<String> {
    sql::reset(pool).await?;
    sqlx::query("TRUNCATE plugin_artifact").execute(pool).await?;
    let cache = TempDir::new("upload");
    let uploader: Arc<dyn Components> = sandbox(pool, &cache)?;
    let t0 = Instant::now();
    let digest = register(pool, &uploader, name, bytes.to_vec()).await?;
    println!(
        "guests: upload of {name} ({:.1} MB), validated and compiled once: {:.2?}",
        bytes.len() as f64 / 1e6,
        t0.elapsed()
    );
    let mut samples = Vec::with_capacity(FIRST_RUNS);
    for _ in 0..FIRST_RUNS {
        let (took, stats) = first_run(pool, url, name, &digest).await?;
        anyhow::ensure!(
            stats.compiles == 0 && stats.artifacts_loaded == 1,
            "{name}: the fresh sandbox compiled: {stats:?}"
        );
        samples.push(took);
    }
    println!(
        "guests: first run of a freshly uploaded {name} on a process that never saw it (enqueue to first event, {FIRST_RUNS} runs): {}",
        percentiles(&mut samples)
    );
    sqlx::query("DELETE FROM plugin_artifact WHERE digest = $1").bind(&digest).execute(pool).await?;
    let (took, stats) = first_run(pool, url, name, &digest).await?;
    anyhow::ensure!(stats.compiles == 1, "{name}: without the artifact the first run compiles: {stats:?}");
    println!("guests: the same with no stored artifact (the first run compiles): {took:.2?}");
    Ok(digest)
}

/// One run of `name` on a sandbox that never saw it: enqueue to its first
/// guest event, and the sandbox's compile counters.
async fn first_run(
    pool: &PgPool,
    url: &str,
    name: &str,
    digest: &str,
) -> anyhow::Result<(Duration, agent_host::agent::CompileStats)> {
    let cache = TempDir::new("fresh");
    let sandbox = sandbox(pool, &cache)?;
    let agents = AgentRegistry::default().with_sandbox(sandbox.clone()).with_tools(tools()?);
    let config =
        WorkerConfig { max_runs: 1, worker_id: "bench".into(), tenant_slot_share_pct: 100, ..WorkerConfig::default() };
    let worker = Worker::start(pool.clone(), Some(Hub::start(url.to_string())), agents, config).await?;
    let manifest = manifest();
    let run = library::enqueue_pinned(pool, "hello", name, Some(digest), Some(&manifest), &json!({})).await?;
    let t0 = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    while !library::has_event(pool, run.run_id, "step", 10).await? {
        tick.tick().await;
        anyhow::ensure!(t0.elapsed() < WAIT_MAX, "{name}: no first event within {WAIT_MAX:?}");
    }
    let took = t0.elapsed();
    while !library::is_terminal(pool, run.run_id).await? {
        tick.tick().await;
        anyhow::ensure!(t0.elapsed() < WAIT_MAX, "{name}: the run did not end");
    }
    worker.drain().await;
    let (status, error) = library::status(pool, run.run_id).await?;
    anyhow::ensure!(status == RunStatus::Completed, "{name}: ended {status:?}: {error:?}");
    Ok((took, sandbox.compile_stats()))
}

/// Runs the chats on its run's host: `{"measure": "turns"}` or `"parked"`.
struct Probe {
    sandbox: Arc<Sandbox>,
    digests: Vec<(String, String)>,
    /// (name, digest, config) of a turn that makes no host call.
    bare: Vec<(String, String, Value)>,
    /// (name, digest) of the guests whose parked memory is measured.
    parkable: Vec<(String, String)>,
    turns: usize,
    parked: usize,
}

#[async_trait]
impl Agent for Probe {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        match input.config["measure"].as_str() {
            Some("turns") => self.turns(host, &input).await.map_err(probe_failed)?,
            Some("parked") => self.parked(host, &input).await.map_err(probe_failed)?,
            other => return Err(probe_failed(format!("unknown measure {other:?}"))),
        }
        Ok(String::new())
    }
}

impl Probe {
    /// One warm-up turn, then `self.turns` timed ones (store + instantiate + the turn).
    async fn time_turns(
        &self,
        host: &RunHost,
        digest: &str,
        manifest: &Manifest,
        turn: impl Fn() -> RunInput,
    ) -> anyhow::Result<Vec<Duration>> {
        run_guest(&self.sandbox, host, digest, manifest, turn()).await?; // warm
        let mut samples = Vec::with_capacity(self.turns);
        for _ in 0..self.turns {
            let t0 = Instant::now();
            run_guest(&self.sandbox, host, digest, manifest, turn()).await?;
            samples.push(t0.elapsed());
        }
        Ok(samples)
    }

    async fn turns(&self, host: &RunHost, input: &RunInput) -> anyhow::Result<()> {
        let manifest = Manifest::parse(&manifest()).map_err(anyhow::Error::msg)?;
        for (name, digest, config) in &self.bare {
            let turn = || guest_input(input, "", config.clone());
            let mut samples = self.time_turns(host, digest, &manifest, turn).await?;
            println!(
                "guests: {name}: store + instantiate + a turn with no host call, {} runs: {}",
                self.turns,
                percentiles(&mut samples)
            );
        }
        for (name, digest) in &self.digests {
            let turn = || guest_input(input, "hi", json!({}));
            let mut samples = self.time_turns(host, digest, &manifest, turn).await?;
            println!(
                "guests: {name}: store + instantiate + one chat turn over the offline model, {} runs: {}",
                self.turns,
                percentiles(&mut samples)
            );
        }
        Ok(())
    }

    async fn parked(&self, host: &RunHost, input: &RunInput) -> anyhow::Result<()> {
        for (name, digest) in &self.parkable {
            self.park(host, input, name, digest).await?;
        }
        Ok(())
    }

    /// `self.parked` guests of `name` parked at once: what each adds.
    async fn park(&self, host: &RunHost, input: &RunInput, name: &str, digest: &str) -> anyhow::Result<()> {
        let manifest = Manifest::parse(&manifest()).map_err(anyhow::Error::msg)?;
        let before = memory_of("self");
        let mut tasks = Vec::with_capacity(self.parked);
        for _ in 0..self.parked {
            let (sandbox, host, digest, manifest) =
                (self.sandbox.clone(), host.clone(), digest.to_string(), manifest.clone());
            let input = guest_input(input, "park", json!({ "hold_ms": 600_000 }));
            tasks.push(tokio::spawn(async move { run_guest(&sandbox, &host, &digest, &manifest, input).await }));
        }
        let t0 = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        while self.sandbox.live() < self.parked {
            tick.tick().await;
            anyhow::ensure!(
                t0.elapsed() < WAIT_MAX,
                "only {} of {} {name} guests parked",
                self.sandbox.live(),
                self.parked
            );
        }
        let (rss, pss, dirty) = memory_of("self").per(&before, self.parked);
        println!(
            "guests: {} {name} guests parked, per guest: {rss:.2} MiB resident, {pss:.2} MiB proportional, \
             {dirty:.2} MiB private dirty",
            self.parked
        );
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
        // Every guest given back before the next language parks.
        let t0 = Instant::now();
        while self.sandbox.live() > 0 {
            tick.tick().await;
            anyhow::ensure!(t0.elapsed() < WAIT_MAX, "{} {name} guests never ended", self.sandbox.live());
        }
        Ok(())
    }
}

async fn probe_run(pool: &PgPool, url: &str, probe: Arc<Probe>, measure: &str) -> anyhow::Result<()> {
    let mut agents = AgentRegistry::default().with_tools(tools()?);
    agents.insert(PROBE, probe);
    let config =
        WorkerConfig { max_runs: 1, worker_id: "bench".into(), tenant_slot_share_pct: 100, ..WorkerConfig::default() };
    let worker = Worker::start(pool.clone(), Some(Hub::start(url.to_string())), agents, config).await?;
    // The guests' tool calls go through the probe run's host: its manifest grants them.
    let run =
        library::enqueue_pinned(pool, "probe", PROBE, None, Some(&manifest()), &json!({ "measure": measure })).await?;
    let t0 = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    while !library::is_terminal(pool, run.run_id).await? {
        tick.tick().await;
        anyhow::ensure!(t0.elapsed() < WAIT_MAX * 4, "the guests probe ({measure}) did not end");
    }
    worker.drain().await;
    let (status, error) = library::status(pool, run.run_id).await?;
    anyhow::ensure!(status == RunStatus::Completed, "the guests probe ({measure}) ended {status:?}: {error:?}");
    Ok(())
}
