//! The queue's figures: enqueue over HTTP, pickup (hub up and down), drain
//! throughput against the SQL floors, and SIGKILL to failed.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_trait::async_trait;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::mpsc;

use crate::figures::{self, median, percentiles, PickupP50};
use crate::graphile::{Graphile, Pass};
use crate::library::{self, Agent, AgentError, AgentRegistry, AppState, DbArgs, Hub, RunHost, RunInput, RunStatus};
use crate::library::{Worker, WorkerConfig};
use crate::{sql, BenchArgs};

/// Requests and runs before the measured ones, to warm connections and caches.
const WARMUP: usize = 20;
/// Bound on any one wait of the benchmark.
const WAIT_MAX: Duration = Duration::from_secs(30);
/// Bound on one drain pass.
const DRAIN_MAX: Duration = Duration::from_secs(600);
/// Runs in one bulk-enqueue statement.
const ENQUEUE_CHUNK: usize = 5_000;

/// A worker of the benchmark, as `serve` configures one.
pub fn worker_config(max_runs: usize) -> WorkerConfig {
    // One tenant, every slot: the queue's cost, not the share kept for others.
    WorkerConfig { max_runs, worker_id: "bench".into(), tenant_slot_share_pct: 100, ..WorkerConfig::default() }
}

/// Reports the instant it started, then returns like `noop`.
struct Pickup(mpsc::UnboundedSender<Instant>);

#[async_trait]
impl Agent for Pickup {
    async fn run(&self, _host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        let _ = self.0.send(Instant::now());
        Ok(String::new())
    }
}

/// The host's HTTP API (built-ins only, no hub) on a loopback port: its
/// address and the server task (abort it when done).
pub async fn serve_api(
    pool: &PgPool,
) -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    serve_api_with(pool, library::Quotas::default()).await
}

/// [`serve_api`] under the given quotas.
pub async fn serve_api_with(
    pool: &PgPool,
    quotas: library::Quotas,
) -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    let mut state = AppState::new(pool.clone(), AgentRegistry::with_builtins(), None);
    state.policy = std::sync::Arc::new(library::Policy { quotas, ..Default::default() });
    let app = library::router(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    Ok((addr, tokio::spawn(async move { axum::serve(listener, app).await })))
}

pub async fn enqueue_latency(pool: &PgPool, args: &BenchArgs) -> anyhow::Result<()> {
    sql::reset(pool).await?;
    let token = library::token(pool).await?;
    let (addr, server) = serve_api(pool).await?;
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/v1/runs");
    let body = json!({ "content": "bench", "plugin": "noop" });
    let mut samples = Vec::with_capacity(args.samples);
    for i in 0..args.samples + WARMUP {
        let t0 = Instant::now();
        let res = client.post(&url).bearer_auth(&token).json(&body).send().await?;
        anyhow::ensure!(res.status() == 202, "enqueue answered {}", res.status());
        res.bytes().await?;
        if i >= WARMUP {
            samples.push(t0.elapsed());
        }
    }
    server.abort();
    println!("enqueue over HTTP, {} sequential POST /v1/runs: {}", args.samples, percentiles(&mut samples));
    Ok(())
}

/// With the hub down the dispatcher finds work on its poll tick, shortened
/// here to 100 ms (the default is 10 s), over fewer samples.
const HUB_DOWN_POLL: Duration = Duration::from_millis(100);
const HUB_DOWN_SAMPLES_MAX: usize = 50;

/// How a pickup run reaches its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickupPath {
    /// Queued, woken for through the hub, claimed by the dispatcher.
    Claimed,
    /// Queued, found on the dispatcher's poll tick (the hub down).
    Polled,
    /// Started in the enqueue's statement on the enqueuing process's free
    /// slot (eager start), as the API of a process with a worker does.
    Eager,
}

pub async fn pickup_latency(pool: &PgPool, url: &str, args: &BenchArgs, path: PickupPath) -> anyhow::Result<PickupP50> {
    sql::reset(pool).await?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut agents = AgentRegistry::default();
    agents.insert("pickup", Arc::new(Pickup(tx)));
    let mut config = worker_config(args.in_flight);
    let hub_up = path != PickupPath::Polled;
    let samples = if hub_up { args.samples } else { args.samples.min(HUB_DOWN_SAMPLES_MAX) };
    if !hub_up {
        config.poll_tick = HUB_DOWN_POLL;
    }
    let hub = Hub::start(url.to_string());
    let worker = Worker::start(pool.clone(), hub_up.then(|| hub.clone()), agents, config).await?;
    let observer = worker.observer();
    let mut from_commit = Vec::with_capacity(samples);
    let mut from_call = Vec::with_capacity(samples);
    // Measure the hub's wake, not its first connect.
    let connecting = Instant::now();
    while !hub.stats().connected.load(Ordering::Relaxed) {
        anyhow::ensure!(connecting.elapsed() < WAIT_MAX, "the hub did not connect");
        tokio::task::yield_now().await;
    }
    let config = json!({});
    // What each run cost the database, besides its latency: the worker's
    // claim and ending statements, and the server's CPU (enqueue included).
    let stats = worker.stats();
    let server = sql::local_postmaster(pool).await?;
    let cpu0 = server.and_then(figures::server_cpu);
    let (claims0, endings0) =
        (stats.claim_rounds.load(Ordering::Relaxed), stats.finish_commits.load(Ordering::Relaxed));
    let mut eager = 0;
    for i in 0..samples + WARMUP {
        let called = Instant::now();
        if path == PickupPath::Eager {
            eager += usize::from(library::enqueue_local(pool, &observer, "bench", "pickup", &config).await?.1);
        } else {
            library::enqueue(pool, "bench", "pickup", None, &config).await?;
        }
        let committed = Instant::now();
        let started = tokio::time::timeout(WAIT_MAX, rx.recv())
            .await
            .context("a run was not picked up within 30 s")?
            .context("worker stopped")?;
        if i >= WARMUP {
            from_commit.push(started.saturating_duration_since(committed));
            from_call.push(started.saturating_duration_since(called));
        }
    }
    let cpu1 = server.and_then(figures::server_cpu);
    worker.drain().await;
    let n = (samples + WARMUP) as f64;
    let claims = (stats.claim_rounds.load(Ordering::Relaxed) - claims0) as f64 / n;
    let endings = (stats.finish_commits.load(Ordering::Relaxed) - endings0) as f64 / n;
    let how = match path {
        PickupPath::Claimed => "claimed, hub up".to_string(),
        PickupPath::Polled => format!("claimed, hub down, poll tick {HUB_DOWN_POLL:?}"),
        PickupPath::Eager => format!("eager start ({eager} of {} runs started in their enqueue)", samples + WARMUP),
    };
    println!("pickup, idle worker, {how}, {samples} runs:");
    println!("  enqueue commit to agent start: {}", percentiles(&mut from_commit));
    println!("  enqueue call to agent start:   {}", percentiles(&mut from_call));
    println!(
        "  per run, one at a time: {claims:.2} claim statements, {endings:.2} ending statements, database CPU {:.0} µs (enqueue included)",
        cpu0.zip(cpu1).map_or(f64::NAN, |(a, b)| (b - a) * 1e6 / n)
    );
    // Sorted by `percentiles`.
    let p50 = |v: &[Duration]| v[(v.len() - 1) / 2].as_secs_f64() * 1e3;
    Ok(PickupP50 { from_commit: p50(&from_commit), from_call: p50(&from_call) })
}

/// The drain passes, each with the SQL floors beside it, and, given
/// `graphile`, one of its drain passes interleaved with each of ours (its
/// first on even passes, so a drift within a pair falls on both sides
/// alike). Returns our passes' rates and its passes, pass by pass.
pub async fn throughput(
    pool: &PgPool,
    url: &str,
    args: &BenchArgs,
    mut graphile: Option<&mut Graphile>,
) -> anyhow::Result<(Vec<f64>, Vec<Pass>)> {
    let (mut e2e, mut floor, mut batched) = (Vec::new(), Vec::new(), Vec::new());
    let (mut commits, mut wal, mut claims, mut endings) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut host_cpu, mut server_cpu) = (Vec::new(), Vec::new());
    let mut theirs = Vec::new();
    for pass in 1..=args.passes {
        let theirs_first = pass % 2 == 0;
        if let (true, Some(g)) = (theirs_first, graphile.as_deref_mut()) {
            theirs.push(g.drain_pass(pool, args).await?);
        }
        let d = drain_costs(pool, url, args.runs, args.in_flight, None).await?;
        if let (false, Some(g)) = (theirs_first, graphile.as_deref_mut()) {
            theirs.push(g.drain_pass(pool, args).await?);
        }
        e2e.push(d.rate);
        commits.push(d.commits_per_run);
        wal.push(d.wal_bytes_per_run);
        claims.push(d.runs_per_claim);
        endings.push(d.runs_per_ending_commit);
        host_cpu.push(d.host_cpu_us);
        server_cpu.push(d.server_cpu_us);
        let f = floor_pass(pool, args).await?;
        floor.push(f);
        let b = batched_floor_pass(pool, args).await?;
        batched.push(b);
        println!(
            "  pass {pass}: end to end {:.0} runs/s ({:.2} commits, {:.0} WAL bytes per run; CPU per run: {}), \
             SQL floor {f:.0} runs/s, batched SQL floor {b:.0} runs/s",
            d.rate,
            d.commits_per_run,
            d.wal_bytes_per_run,
            figures::cpu_line("host", d.host_cpu_us, d.server_cpu_us)
        );
        // Its pass of this round, when there is a comparison.
        if let Some(t) = theirs.last() {
            println!(
                "  pass {pass}: graphile-worker defaults {:.0} jobs/s ({} per job), batched {:.0} jobs/s ({} per job), \
                 equal work {:.0} jobs/s ({} per job) (ratios {:.2}, {:.2}, {:.2})",
                t.defaults,
                t.defaults_costs.line(),
                t.batched,
                t.batched_costs.line(),
                t.equal,
                t.equal_costs.line(),
                d.rate / t.defaults,
                d.rate / t.batched,
                d.rate / t.equal
            );
        }
    }
    let ours = e2e.clone();
    let (e, f, b) = (median(&mut e2e), median(&mut floor), median(&mut batched));
    println!(
        "drain {} pre-enqueued no-op runs, {} in flight: median {e:.0} runs/s over {} passes",
        args.runs, args.in_flight, args.passes
    );
    let drained = Drained {
        rate: e,
        commits_per_run: median(&mut commits),
        wal_bytes_per_run: median(&mut wal),
        runs_per_claim: median(&mut claims),
        runs_per_ending_commit: median(&mut endings),
        host_cpu_us: median(&mut host_cpu),
        server_cpu_us: median(&mut server_cpu),
    };
    println!(
        "drain costs per run (medians): {:.3} commits (transactions that wrote), {:.0} WAL bytes; \
         {:.1} runs per claim statement, {:.1} runs per ending commit; CPU {}",
        drained.commits_per_run,
        drained.wal_bytes_per_run,
        drained.runs_per_claim,
        drained.runs_per_ending_commit,
        figures::cpu_line("host", drained.host_cpu_us, drained.server_cpu_us)
    );
    println!(
        "SQL floor, {n} connections each claiming one run and finishing it: median {f:.0} runs/s",
        n = args.in_flight
    );
    println!(
        "batched SQL floor, one claim of up to {n} runs, finished on {n} connections: median {b:.0} runs/s",
        n = args.in_flight
    );
    println!("ratio end to end / SQL floor: {:.2}; end to end / batched SQL floor: {:.2}", e / f, e / b);
    Ok((ours, theirs))
}

/// The end-to-end drain passes alone (`--drain-only`), nothing around them.
pub async fn drains(pool: &PgPool, url: &str, args: &BenchArgs) -> anyhow::Result<()> {
    let mut rates = Vec::new();
    for pass in 1..=args.passes {
        let d = drain_costs(pool, url, args.runs, args.in_flight, None).await?;
        rates.push(d.rate);
        println!(
            "  pass {pass}: {:.0} runs/s ({:.2} commits, {:.0} WAL bytes per run; {:.1} runs per claim, {:.1} per ending commit; \
             CPU per run: {})",
            d.rate,
            d.commits_per_run,
            d.wal_bytes_per_run,
            d.runs_per_claim,
            d.runs_per_ending_commit,
            figures::cpu_line("host", d.host_cpu_us, d.server_cpu_us)
        );
    }
    println!(
        "drain {} pre-enqueued no-op runs, {} in flight: median {:.0} runs/s",
        args.runs,
        args.in_flight,
        median(&mut rates)
    );
    Ok(())
}

/// One drain's rate and what it wrote.
#[derive(Debug, Clone, Copy)]
pub struct Drained {
    pub rate: f64,
    /// Transactions that wrote (one commit record and one WAL flush each), per run.
    pub commits_per_run: f64,
    /// WAL the server wrote during the drain, per run.
    pub wal_bytes_per_run: f64,
    /// Runs claimed per claim statement.
    pub runs_per_claim: f64,
    /// Runs ended per group-committed ending statement.
    pub runs_per_ending_commit: f64,
    /// CPU this process (the worker) spent per run, in µs.
    pub host_cpu_us: f64,
    /// CPU the database server spent per run, in µs (every process of it,
    /// whoever it served); NaN for a server that is not on this machine.
    pub server_cpu_us: f64,
}

/// Pre-enqueues `runs` no-op runs (with `manifest` pinned on each), then
/// drains them with a worker of `in_flight` slots: runs/s from the worker's
/// start to its last terminal write.
pub async fn drain_noops(
    pool: &PgPool,
    url: &str,
    runs: usize,
    in_flight: usize,
    manifest: Option<&str>,
) -> anyhow::Result<f64> {
    Ok(drain_costs(pool, url, runs, in_flight, manifest).await?.rate)
}

/// [`drain_noops`], with the commits and WAL the drain cost (the server's
/// counters read before the worker starts and after its last ending).
pub async fn drain_costs(
    pool: &PgPool,
    url: &str,
    runs: usize,
    in_flight: usize,
    manifest: Option<&str>,
) -> anyhow::Result<Drained> {
    sql::reset(pool).await?;
    enqueue_noops(pool, runs, manifest).await?;
    let server = sql::ServerMarks::read(pool).await?;
    let own0 = figures::cpu_self();
    let t0 = Instant::now();
    let hub = Some(Hub::start(url.to_string()));
    let worker = Worker::start(pool.clone(), hub, AgentRegistry::with_builtins(), worker_config(in_flight)).await?;
    let stats = worker.stats();
    let mut tick = tokio::time::interval(Duration::from_millis(2));
    while stats.finished.load(Ordering::Relaxed) < runs as u64 {
        tick.tick().await;
        anyhow::ensure!(t0.elapsed() < DRAIN_MAX, "drain pass took over {DRAIN_MAX:?}");
    }
    let took = t0.elapsed();
    let own1 = figures::cpu_self();
    let n = runs as f64;
    let costs = server.per(pool, n).await?;
    worker.drain().await;
    let per = |a: u64| if a == 0 { f64::NAN } else { n / a as f64 };
    Ok(Drained {
        rate: n / took.as_secs_f64(),
        commits_per_run: costs.commits,
        wal_bytes_per_run: costs.wal_bytes,
        runs_per_claim: per(stats.claim_rounds.load(Ordering::Relaxed)),
        runs_per_ending_commit: per(stats.finish_commits.load(Ordering::Relaxed)),
        host_cpu_us: (own1 - own0) * 1e6 / n,
        server_cpu_us: costs.cpu_us,
    })
}

/// The floor: the worker's own statements (claim one, finish it) on
/// `in_flight` connections, with nothing of the host around them.
async fn floor_pass(pool: &PgPool, args: &BenchArgs) -> anyhow::Result<f64> {
    sql::reset(pool).await?;
    enqueue_all(pool, args.runs).await?;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..args.in_flight {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("floor-{i}");
            let mut done = 0u64;
            loop {
                let Some(run) = library::claim(&pool, &id, 1).await?.into_iter().next() else {
                    return Ok::<u64, sqlx::Error>(done);
                };
                library::finish_completed(&pool, &run).await?;
                done += 1;
            }
        }));
    }
    let mut done = 0;
    for t in tasks {
        done += t.await??;
    }
    let took = t0.elapsed();
    anyhow::ensure!(done == args.runs as u64, "floor finished {done} of {} runs", args.runs);
    Ok(args.runs as f64 / took.as_secs_f64())
}

/// The floor with the host's batching and none of the host: claim up to
/// `in_flight` runs in one statement, finish them concurrently, repeat.
async fn batched_floor_pass(pool: &PgPool, args: &BenchArgs) -> anyhow::Result<f64> {
    sql::reset(pool).await?;
    enqueue_all(pool, args.runs).await?;
    let t0 = Instant::now();
    let mut done = 0;
    loop {
        let claimed = library::claim(pool, "floor", args.in_flight).await?;
        if claimed.is_empty() {
            break;
        }
        done += claimed.len();
        let finishes = claimed.iter().map(|run| library::finish_completed(pool, run));
        for r in futures::future::join_all(finishes).await {
            r?;
        }
    }
    let took = t0.elapsed();
    anyhow::ensure!(done == args.runs, "batched floor finished {done} of {} runs", args.runs);
    Ok(args.runs as f64 / took.as_secs_f64())
}

/// Pre-enqueues `n` no-op runs in chunks (each chunk one statement).
async fn enqueue_all(pool: &PgPool, n: usize) -> anyhow::Result<()> {
    enqueue_noops(pool, n, None).await
}

/// [`enqueue_all`] with a manifest pinned on each run.
pub async fn enqueue_noops(pool: &PgPool, n: usize, manifest: Option<&str>) -> anyhow::Result<()> {
    let mut left = n;
    while left > 0 {
        let k = left.min(ENQUEUE_CHUNK);
        sql::bulk_enqueue(pool, k as i64, "noop", manifest).await?;
        left -= k;
    }
    sql::analyze(pool).await?;
    Ok(())
}

/// Polls the run's status until `done` holds, for at most [`WAIT_MAX`].
pub async fn wait_status(
    pool: &PgPool,
    run: library::RunId,
    what: &str,
    done: impl Fn(RunStatus) -> bool,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    loop {
        tick.tick().await;
        if done(library::status(pool, run).await?.0) {
            return Ok(());
        }
        anyhow::ensure!(t0.elapsed() < WAIT_MAX, "{what} within {WAIT_MAX:?}");
    }
}

/// This binary's hidden `serve` (the host's own serve, in a process of its
/// own; lease 1 s, heartbeat 0.2 s, reap grace 0.3 s), once it listens.
pub fn spawn_serve(url: &str, db_args: &DbArgs) -> anyhow::Result<std::process::Child> {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["serve", "--database-url", url, "--cache-dir"])
        .arg(&db_args.cache_dir)
        .args(["--listen", "127.0.0.1:0", "--worker-id", "bench-victim", "--lease-ms", "1000"])
        .args(["--heartbeat-ms", "200", "--reap-grace-ms", "300"])
        // Its runs are the built-in `sleep` agent's.
        .arg("--builtin-agents")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut listening = false;
    for line in std::io::BufReader::new(stdout).lines() {
        if line?.starts_with("agent-host listening on") {
            listening = true;
            break;
        }
    }
    if !listening {
        let _ = child.kill();
        let _ = child.wait();
        anyhow::bail!("the serve child exited before listening");
    }
    Ok(child)
}

/// SIGKILL to failed: a real `serve` child (short lease: 1 s, grace 0.3 s)
/// holding a run is killed; this process's reaper (every 100 ms) ends the
/// run. Median over `--kills` kills.
pub async fn sigkill_to_failed(pool: &PgPool, url: &str, db_args: &DbArgs, args: &BenchArgs) -> anyhow::Result<()> {
    sql::reset(pool).await?;
    let reaper_config = WorkerConfig {
        lease: Duration::from_secs(1),
        heartbeat: Duration::from_millis(200),
        reap_grace: Duration::from_millis(300),
        reap_interval: Duration::from_millis(100),
        dispatch: false,
        worker_id: "bench-reaper".into(),
        tenant_slot_share_pct: 100,
        ..WorkerConfig::default()
    };
    let reaper = Worker::start(pool.clone(), None, AgentRegistry::default(), reaper_config).await?;
    let config = json!({ "steps": 100_000, "step_ms": 50 });
    let mut samples = Vec::new();
    for _ in 0..args.kills {
        let mut child = spawn_serve(url, db_args)?;
        let run = library::enqueue(pool, "bench", "sleep", None, &config).await?;
        if let Err(e) =
            wait_status(pool, run.run_id, "the child never claimed the run", |s| s == RunStatus::Running).await
        {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        child.kill()?;
        let killed = Instant::now();
        let _ = child.wait();
        wait_status(pool, run.run_id, "the run was never reaped", |s| s == RunStatus::Failed).await?;
        samples.push(killed.elapsed());
    }
    reaper.drain().await;
    println!(
        "SIGKILL to failed (lease 1 s, reap grace 0.3 s, reaper every 100 ms), {} kills: {}",
        args.kills,
        percentiles(&mut samples)
    );
    Ok(())
}
