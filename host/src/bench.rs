//! `agent-host bench`: the documented benchmark. Prints enqueue latency over
//! HTTP, pickup latency (enqueue commit to agent start, idle worker), drain
//! throughput of pre-enqueued no-op runs, the same SQL statements run without
//! the host (the SQL floor), and their ratio. Medians over passes; the machine
//! is shared and noisy, so single figures mean little.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_trait::async_trait;
use serde_json::json;
use sqlx::{Connection, PgPool};
use tokio::sync::mpsc;

use crate::agent::{Agent, AgentError, AgentRegistry, Components, RunHost, RunInput};
use crate::run::host::RunHostParts;
use crate::run::journal::{JournalConfig, FIRST_RUN_SEQ};
use crate::api::{self, AppState};
use crate::config::{BenchArgs, DbArgs};
use crate::db::enqueue::{self, NewRun, Owner};
use crate::db::lifecycle::{self, Claim, Finish};
use crate::db::{self, MessageStatus, RunStatus};
use crate::hub::Hub;
use crate::server;
use crate::worker::{Worker, WorkerConfig};

const BENCH_DATABASE: &str = "agent_host_bench";

/// Reports the instant it started, then returns like `noop`.
struct Pickup(mpsc::UnboundedSender<Instant>);

#[async_trait]
impl Agent for Pickup {
    async fn run(&self, _host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        let _ = self.0.send(Instant::now());
        Ok(String::new())
    }
}

pub async fn run(db_args: &DbArgs, args: &BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.runs > 0 && args.in_flight > 0 && args.passes > 0 && args.samples > 0,
        "counts must be positive"
    );
    let mut database = server::open_database(db_args).await?;
    let url = bench_database(&database.url).await?;
    let pool = server::connect_and_migrate(&url, (args.in_flight as u32 + 8).max(16)).await?;
    println!("agent-host bench: {} cores, database {}", num_cpus(), redact(&url));

    enqueue_latency(&pool, args).await?;
    pickup_latency(&pool, &url, args, true).await?;
    pickup_latency(&pool, &url, args, false).await?;
    throughput(&pool, &url, args).await?;
    stream_latency(&pool, &url).await?;
    sigkill_to_failed(&pool, &url, db_args).await?;
    sandbox(&pool, &url, db_args, args).await?;

    pool.close().await;
    if let Some(c) = database.cluster.as_mut() {
        c.stop();
    }
    Ok(())
}

/// A fresh database beside the given one, so the benchmark never touches real data.
async fn bench_database(url: &str) -> anyhow::Result<String> {
    let (base, _) = url.rsplit_once('/').context("database URL without a database name")?;
    let mut admin = sqlx::PgConnection::connect(&format!("{base}/postgres")).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {BENCH_DATABASE} WITH (FORCE)")).execute(&mut admin).await?;
    sqlx::query(&format!("CREATE DATABASE {BENCH_DATABASE}")).execute(&mut admin).await?;
    admin.close().await?;
    Ok(format!("{base}/{BENCH_DATABASE}"))
}

async fn enqueue_latency(pool: &PgPool, args: &BenchArgs) -> anyhow::Result<()> {
    db::bench::reset(pool).await?;
    let token = db::tokens::create(pool, "bench", "bench", false).await?;
    let app = api::router(AppState::new(pool.clone(), AgentRegistry::with_builtins(), None));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/v1/runs");
    let body = json!({ "content": "bench", "plugin": "noop" });
    let mut samples = Vec::with_capacity(args.samples);
    for i in 0..args.samples + 20 {
        let t0 = Instant::now();
        let res = client.post(&url).bearer_auth(&token).json(&body).send().await?;
        anyhow::ensure!(res.status() == 202, "enqueue answered {}", res.status());
        res.bytes().await?;
        if i >= 20 {
            samples.push(t0.elapsed()); // the first 20 warm the connections
        }
    }
    server.abort();
    println!("enqueue over HTTP, {} sequential POST /v1/runs: {}", args.samples, percentiles(&mut samples));
    Ok(())
}

/// With the hub down the dispatcher finds work on its poll tick, shortened
/// here to 100 ms (the default is 10 s), over fewer samples.
const HUB_DOWN_POLL: Duration = Duration::from_millis(100);

async fn pickup_latency(pool: &PgPool, url: &str, args: &BenchArgs, hub_up: bool) -> anyhow::Result<()> {
    db::bench::reset(pool).await?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut agents = AgentRegistry::default();
    agents.insert("pickup", Arc::new(Pickup(tx)));
    let mut config = WorkerConfig { max_runs: args.in_flight, worker_id: "bench".into(), ..WorkerConfig::default() };
    let samples = if hub_up { args.samples } else { args.samples.min(50) };
    if !hub_up {
        config.poll_tick = HUB_DOWN_POLL;
    }
    let hub = Hub::start(url.to_string());
    let worker = Worker::start(pool.clone(), hub_up.then(|| hub.clone()), agents, config).await?;
    let owner = Owner { user_id: "bench".into(), tenant_id: "bench".into() };
    let config = json!({});
    let mut latencies = Vec::with_capacity(samples);
    // Measure the hub's wake, not its first connect.
    let connecting = Instant::now();
    while !hub.stats().connected.load(Ordering::Relaxed) {
        anyhow::ensure!(connecting.elapsed() < Duration::from_secs(30), "the hub did not connect");
        tokio::task::yield_now().await;
    }
    for i in 0..samples + 20 {
        let new = bench_run(&owner, "bench", "pickup", None, &config);
        enqueue::enqueue(pool, &new).await?;
        let committed = Instant::now();
        let started = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .context("a run was not picked up within 30 s")?
            .context("worker stopped")?;
        if i >= 20 {
            latencies.push(started.saturating_duration_since(committed));
        }
    }
    worker.drain().await;
    let how = if hub_up { "hub up".to_string() } else { format!("hub down, poll tick {HUB_DOWN_POLL:?}") };
    println!(
        "pickup, enqueue commit to agent start, idle worker, {how}, {samples} runs: {}",
        percentiles(&mut latencies)
    );
    Ok(())
}

async fn throughput(pool: &PgPool, url: &str, args: &BenchArgs) -> anyhow::Result<()> {
    let (mut e2e, mut floor, mut batched) = (Vec::new(), Vec::new(), Vec::new());
    for pass in 1..=args.passes {
        let rate = drain_pass(pool, url, args).await?;
        e2e.push(rate);
        let f = floor_pass(pool, args).await?;
        floor.push(f);
        let b = batched_floor_pass(pool, args).await?;
        batched.push(b);
        println!(
            "  pass {pass}: end to end {rate:.0} runs/s, SQL floor {f:.0} runs/s, batched SQL floor {b:.0} runs/s"
        );
    }
    let (e, f, b) = (median(&mut e2e), median(&mut floor), median(&mut batched));
    println!(
        "drain {} pre-enqueued no-op runs, {} in flight: median {e:.0} runs/s over {} passes",
        args.runs, args.in_flight, args.passes
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
    Ok(())
}

async fn drain_pass(pool: &PgPool, url: &str, args: &BenchArgs) -> anyhow::Result<f64> {
    db::bench::reset(pool).await?;
    enqueue_all(pool, args.runs).await?;
    let config = WorkerConfig { max_runs: args.in_flight, worker_id: "bench".into(), ..WorkerConfig::default() };
    let t0 = Instant::now();
    let worker =
        Worker::start(pool.clone(), Some(Hub::start(url.to_string())), AgentRegistry::with_builtins(), config).await?;
    let stats = worker.stats();
    let mut tick = tokio::time::interval(Duration::from_millis(2));
    while stats.finished.load(Ordering::Relaxed) < args.runs as u64 {
        tick.tick().await;
        anyhow::ensure!(t0.elapsed() < Duration::from_secs(600), "drain pass took over 10 minutes");
    }
    let took = t0.elapsed();
    worker.drain().await;
    Ok(args.runs as f64 / took.as_secs_f64())
}

/// The floor: the worker's own statements (claim one, finish it) on
/// `in_flight` connections, with nothing of the host around them.
async fn floor_pass(pool: &PgPool, args: &BenchArgs) -> anyhow::Result<f64> {
    db::bench::reset(pool).await?;
    enqueue_all(pool, args.runs).await?;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..args.in_flight {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("floor-{i}");
            let mut done = 0u64;
            loop {
                let claim = Claim {
                    limit: 1,
                    lease: Duration::from_secs(30),
                    worker_id: &id,
                    prefilter: true,
                    tenant_max_running: None,
                };
                let claimed = lifecycle::claim(&pool, &claim).await?;
                let Some(run) = claimed.into_iter().next() else {
                    return Ok::<u64, sqlx::Error>(done);
                };
                let finish = Finish {
                    status: RunStatus::Completed,
                    error: None,
                    assistant: Some(("", MessageStatus::Complete)),
                    usage: None,
                };
                lifecycle::finish(&pool, run.id, run.claim_token, &finish).await?;
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
    db::bench::reset(pool).await?;
    enqueue_all(pool, args.runs).await?;
    let t0 = Instant::now();
    let mut done = 0;
    loop {
        let claim = Claim {
            limit: args.in_flight as i64,
            lease: Duration::from_secs(30),
            worker_id: "floor",
            prefilter: true,
            tenant_max_running: None,
        };
        let claimed = lifecycle::claim(pool, &claim).await?;
        if claimed.is_empty() {
            break;
        }
        done += claimed.len();
        let finishes = claimed.into_iter().map(|run| {
            let pool = pool.clone();
            async move {
                let finish = Finish {
                    status: RunStatus::Completed,
                    error: None,
                    assistant: Some(("", MessageStatus::Complete)),
                    usage: None,
                };
                lifecycle::finish(&pool, run.id, run.claim_token, &finish).await
            }
        });
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
    const CHUNK: usize = 5_000;
    let mut left = n;
    while left > 0 {
        let k = left.min(CHUNK);
        db::bench::bulk_enqueue(pool, k as i64, "noop").await?;
        left -= k;
    }
    db::bench::analyze(pool).await?;
    Ok(())
}

/// The sandbox's costs: instantiation from the cached pre plus a trivial
/// run, one `emit-event` host call, and memory per parked guest.
async fn sandbox(pool: &PgPool, url: &str, db_args: &DbArgs, args: &BenchArgs) -> anyhow::Result<()> {
    let dir = &args.plugin_dir;
    let (echo, fixtures) = (dir.join("echo.wasm"), dir.join("fixtures.wasm"));
    if !echo.exists() || !fixtures.exists() {
        println!(
            "sandbox: skipped, no plugins in {} (cargo build --release --target wasm32-wasip2 --manifest-path plugins/Cargo.toml)",
            dir.display()
        );
        return Ok(());
    }
    db::bench::reset(pool).await?;
    let sandbox = crate::sandbox::Sandbox::new(pool.clone(), Some(db_args.cache_dir.clone()))?;
    let mut digests = Vec::new();
    for (name, path) in [("echo", &echo), ("fixtures", &fixtures)] {
        let bytes = std::fs::read(path)?;
        sandbox.validate(&bytes)?;
        digests.push(db::plugins::put(pool, name, &bytes, &json!({})).await?.digest);
    }
    let manifest = crate::sandbox::Manifest::default();
    // A real claimed run behind the host, so emits go through the journal.
    let owner = Owner { user_id: "bench".into(), tenant_id: "bench".into() };
    let config = json!({});
    let new = bench_run(&owner, "bench", "echo", Some(digests[0].as_str()), &config);
    let run = enqueue::enqueue(pool, &new).await?;
    let claim = Claim {
        limit: 1,
        lease: Duration::from_secs(3600),
        worker_id: "bench",
        prefilter: true,
        tenant_max_running: None,
    };
    let claimed = lifecycle::claim(pool, &claim).await?.pop().context("bench run not claimed")?;
    let journal = crate::run::journal::Journal::start(
        pool.clone(),
        claimed.id,
        claimed.claim_token,
        FIRST_RUN_SEQ,
        JournalConfig::default(),
        tokio_util::sync::CancellationToken::new(),
        Default::default(),
    );
    let host = RunHost::new(RunHostParts {
        run_id: claimed.id,
        journal,
        cancel: Default::default(),
        tools: Default::default(),
        manifest: manifest.clone(),
    });
    let input = |content: &str, config: serde_json::Value| RunInput {
        run_id: run.run_id,
        conversation_id: run.conversation_id,
        content: content.to_string(),
        config,
        history: vec![],
    };

    // Instantiate from the cached pre and run a guest that makes no host call.
    run_wasm(&sandbox, &host, &digests[0], &manifest, input("", json!({}))).await?; // warm the caches
    let mut samples = Vec::with_capacity(args.samples);
    for _ in 0..args.samples {
        let t0 = Instant::now();
        run_wasm(&sandbox, &host, &digests[0], &manifest, input("", json!({}))).await?;
        samples.push(t0.elapsed());
    }
    println!("sandbox: store + instantiate + trivial run, {} runs: {}", args.samples, percentiles(&mut samples));

    // emit-event: 1,000 content deltas in one run, through the journal writer.
    let words = "w ".repeat(1000);
    let mut per_call = Vec::new();
    for _ in 0..20 {
        let t0 = Instant::now();
        run_wasm(&sandbox, &host, &digests[0], &manifest, input(&words, json!({}))).await?;
        per_call.push(t0.elapsed() / 1000);
    }
    println!("sandbox: one emit-event (content_delta) host call: {}", percentiles(&mut per_call));
    let (_, flushed) = host.close().await;
    flushed?;

    cancel_latency(pool, url, &sandbox, &digests, args).await?;

    // Memory: guests parked in a long host call.
    let parked = args.parked;
    let rss_before = rss_bytes();
    let host = RunHost::new(RunHostParts {
        run_id: claimed.id,
        journal: crate::run::journal::Journal::start(
            pool.clone(),
            claimed.id,
            claimed.claim_token,
            1_000_000,
            JournalConfig::default(),
            tokio_util::sync::CancellationToken::new(),
            Default::default(),
        ),
        cancel: Default::default(),
        tools: Default::default(),
        manifest: manifest.clone(),
    });
    let mut tasks = Vec::new();
    for _ in 0..parked {
        let (sandbox, host, digest, manifest) = (sandbox.clone(), host.clone(), digests[1].clone(), manifest.clone());
        let input = input("park", json!({ "mode": "block" }));
        tasks.push(tokio::spawn(async move { run_wasm(&sandbox, &host, &digest, &manifest, input).await }));
    }
    let t0 = Instant::now();
    while sandbox.live() < parked {
        anyhow::ensure!(t0.elapsed() < Duration::from_secs(120), "only {} of {parked} guests parked", sandbox.live());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let rss_after = rss_bytes();
    println!(
        "sandbox: {parked} guests parked in a host call: process RSS {:.0} MiB, {:.0} KiB per parked guest",
        rss_after as f64 / (1 << 20) as f64,
        rss_after.saturating_sub(rss_before) as f64 / 1024.0 / parked as f64
    );
    for t in tasks {
        t.abort();
    }
    Ok(())
}

/// Cancel commit to terminal commit, through a real worker: a cooperative
/// guest (echo, checking cancel between words) and one that never looks
/// (interrupted after the grace).
async fn cancel_latency(
    pool: &PgPool,
    url: &str,
    sandbox: &Arc<crate::sandbox::Sandbox>,
    digests: &[String],
    args: &BenchArgs,
) -> anyhow::Result<()> {
    db::bench::reset(pool).await?;
    let grace = Duration::from_millis(500);
    let agents = AgentRegistry::default().with_sandbox(sandbox.clone());
    let config = WorkerConfig { worker_id: "bench".into(), cancel_grace: grace, ..WorkerConfig::default() };
    let hub = Hub::start(url.to_string());
    let worker = Worker::start(pool.clone(), Some(hub.clone()), agents, config).await?;
    let owner = Owner { user_id: "bench".into(), tenant_id: "bench".into() };
    let words = "word ".repeat(100_000);
    let cases = [
        ("echo", &digests[0], words.as_str(), json!({ "delay_ms": 2 }), args.samples.min(50)),
        ("fixtures", &digests[1], "x", json!({ "mode": "ignore-cancel" }), args.samples.min(10)),
    ];
    for (plugin, digest, content, config, n) in cases {
        let mut samples = Vec::with_capacity(n);
        for _ in 0..n {
            let new = bench_run(&owner, content, plugin, Some(digest), &config);
            let run = enqueue::enqueue(pool, &new).await?;
            let mut ended = hub.subscribe(&crate::db::notify::events_channel(run.run_id)).await;
            let t0 = Instant::now();
            let status =
                || sqlx::query_scalar::<_, String>("SELECT status FROM agent_run WHERE id = $1").bind(run.run_id);
            while status().fetch_one(pool).await? != "running" {
                anyhow::ensure!(t0.elapsed() < Duration::from_secs(30), "bench run was not claimed");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            // Let the guest get going before the stop.
            tokio::time::sleep(Duration::from_millis(20)).await;
            db::lifecycle::cancel(pool, run.run_id, "bench").await?;
            let asked = Instant::now();
            while db::journal::terminal_state(pool, run.run_id).await?.is_none() {
                tokio::time::timeout(Duration::from_secs(30), ended.recv()).await.context("run did not end")?;
            }
            samples.push(asked.elapsed());
        }
        let what = if plugin == "echo" { "cooperative guest" } else { "guest ignoring cancel, grace 500 ms" };
        println!("cancel to terminal, {what}, {n} runs: {}", percentiles(&mut samples));
    }
    worker.drain().await;
    Ok(())
}

/// Emits `ticks` structural events 5 ms apart, reporting the instant before
/// each, then `deltas` content deltas as fast as it can.
struct Ticker {
    sent: mpsc::UnboundedSender<Instant>,
    ticks: usize,
    deltas: usize,
}

#[async_trait]
impl Agent for Ticker {
    async fn run(&self, host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        for i in 0..self.ticks {
            let _ = self.sent.send(Instant::now());
            host.emit_event("tick", json!({ "i": i })).await?;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for _ in 0..self.deltas {
            host.emit_delta("x").await?;
        }
        Ok(String::new())
    }
}

/// Emit to client: a run's events through the journal, the NOTIFY and the
/// HTTP API to an SSE client in this process; and the journal rows that
/// 1,000 content deltas become.
async fn stream_latency(pool: &PgPool, url: &str) -> anyhow::Result<()> {
    use futures::StreamExt;
    db::bench::reset(pool).await?;
    let (tx, mut sent) = mpsc::unbounded_channel();
    let (ticks, deltas) = (200, 1000);
    let mut agents = AgentRegistry::default();
    agents.insert("ticker", Arc::new(Ticker { sent: tx, ticks, deltas }));
    let hub = Hub::start(url.to_string());
    let config = WorkerConfig { worker_id: "bench".into(), ..WorkerConfig::default() };
    let worker = Worker::start(pool.clone(), Some(hub.clone()), agents.clone(), config).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = api::router(AppState::new(pool.clone(), agents, Some(hub)));
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let token = db::tokens::create(pool, "bench", "bench", false).await?;
    let owner = Owner { user_id: "bench".into(), tenant_id: "bench".into() };
    let config = json!({});
    let new = bench_run(&owner, "bench", "ticker", None, &config);
    let run = enqueue::enqueue(pool, &new).await?;
    let res = reqwest::Client::new()
        .get(format!("http://{addr}/v1/runs/{}/events", run.run_id))
        .bearer_auth(&token)
        .header("Accept", "text/event-stream")
        .send()
        .await?
        .error_for_status()?;
    let (mut body, mut decoder, mut out) = (res.bytes_stream(), crate::stream::decode::SseDecoder::default(), Vec::new());
    let mut samples = Vec::with_capacity(ticks);
    'read: while let Some(chunk) = tokio::time::timeout(Duration::from_secs(30), body.next()).await? {
        decoder.feed(&chunk?, &mut out).map_err(anyhow::Error::msg)?;
        let arrived = Instant::now();
        for data in out.drain(..) {
            let event: serde_json::Value = serde_json::from_str(&data)?;
            match event["type"].as_str() {
                Some("tick") => samples.push(arrived - sent.recv().await.context("ticker gone")?),
                Some("complete") => break 'read,
                _ => {}
            }
        }
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM run_event WHERE run_id = $1 AND type = 'content_delta'")
        .bind(run.run_id)
        .fetch_one(pool)
        .await?;
    server.abort();
    worker.drain().await;
    println!(
        "emit to SSE client (a structural event, through journal, NOTIFY and HTTP), {ticks} events: {}",
        percentiles(&mut samples)
    );
    println!(
        "journal rows for {deltas} content deltas emitted back to back: {rows} (flush every {:?})",
        crate::run::journal::FLUSH_DEFAULT
    );
    Ok(())
}

/// SIGKILL to failed: a real `agent-host serve` child (short lease: 1 s,
/// grace 0.3 s) holding a run is killed; this process's reaper (every
/// 100 ms) ends the run. Median over five kills.
async fn sigkill_to_failed(pool: &PgPool, url: &str, db_args: &DbArgs) -> anyhow::Result<()> {
    use std::io::BufRead;
    db::bench::reset(pool).await?;
    let reaper_config = WorkerConfig {
        lease: Duration::from_secs(1),
        heartbeat: Duration::from_millis(200),
        reap_grace: Duration::from_millis(300),
        reap_interval: Duration::from_millis(100),
        dispatch: false,
        worker_id: "bench-reaper".into(),
        ..WorkerConfig::default()
    };
    let reaper = Worker::start(pool.clone(), None, AgentRegistry::default(), reaper_config).await?;
    let owner = Owner { user_id: "bench".into(), tenant_id: "bench".into() };
    let config = json!({ "steps": 100_000, "step_ms": 50 });
    let mut samples = Vec::new();
    for _ in 0..5 {
        let mut child = std::process::Command::new(std::env::current_exe()?)
            .args(["--database-url", url, "--cache-dir"])
            .arg(&db_args.cache_dir)
            .args(["serve", "--listen", "127.0.0.1:0", "--worker-id", "bench-victim", "--lease-ms", "1000"])
            .args(["--heartbeat-ms", "200", "--reap-grace-ms", "300"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take().context("child stdout")?;
        for line in std::io::BufReader::new(stdout).lines() {
            if line?.starts_with("agent-host listening on") {
                break;
            }
        }
        let new = bench_run(&owner, "bench", "sleep", None, &config);
        let run = enqueue::enqueue(pool, &new).await?;
        let status = || sqlx::query_scalar::<_, String>("SELECT status FROM agent_run WHERE id = $1").bind(run.run_id);
        let t0 = Instant::now();
        while status().fetch_one(pool).await? != "running" {
            anyhow::ensure!(t0.elapsed() < Duration::from_secs(30), "the child never claimed the run");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        child.kill()?;
        let killed = Instant::now();
        let _ = child.wait();
        while status().fetch_one(pool).await? != "failed" {
            anyhow::ensure!(killed.elapsed() < Duration::from_secs(30), "the run was never reaped");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        samples.push(killed.elapsed());
    }
    reaper.drain().await;
    println!(
        "SIGKILL to failed (lease 1 s, reap grace 0.3 s, reaper every 100 ms), 5 kills: {}",
        percentiles(&mut samples)
    );
    Ok(())
}

/// A run of the benchmark's owner, in a conversation of its own.
fn bench_run<'a>(
    owner: &'a Owner,
    content: &'a str,
    plugin: &'a str,
    plugin_digest: Option<&'a str>,
    config: &'a serde_json::Value,
) -> NewRun<'a> {
    NewRun {
        owner,
        conversation_id: None,
        content,
        plugin,
        plugin_digest,
        plugin_manifest: None,
        config,
        request: config,
        idempotency_key: None,
    }
}

/// Resident set size of this process.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()))
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

fn percentiles(samples: &mut [Duration]) -> String {
    samples.sort();
    let at = |p: f64| {
        let i = ((p * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1;
        samples[i]
    };
    let fmt = |d: Duration| {
        if d < Duration::from_millis(1) {
            format!("{:.1} µs", d.as_secs_f64() * 1e6)
        } else {
            format!("{:.2} ms", d.as_secs_f64() * 1e3)
        }
    };
    format!("p50 {}, p99 {}, max {}", fmt(at(0.50)), fmt(at(0.99)), fmt(at(1.0)))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(a)) if a > s => format!("{}://…@{}", &url[..s], &url[a + 1..]),
        _ => url.to_string(),
    }
}

async fn run_wasm(
    sandbox: &Arc<crate::sandbox::Sandbox>,
    host: &RunHost,
    digest: &str,
    manifest: &crate::sandbox::Manifest,
    input: RunInput,
) -> Result<String, AgentError> {
    Components::agent(sandbox.as_ref(), digest, manifest).await?.run(host, input).await
}
