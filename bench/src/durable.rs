//! Durable resume's costs: the `call-tool` round trip with and without the
//! call log, the drain of resumable no-op runs beside at-most-once ones,
//! SIGKILL of a host to another worker's `run_resumed`, and the replay of a
//! run's 1,000 recorded calls.
//!
//! Every run is claimed by a real worker and runs on the host it builds; a
//! resumable run is one enqueued with `"durability": "resume"` pinned in its
//! manifest, so the worker records its calls (fenced, in `run_call`) and a
//! later claim replays them from the log.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_trait::async_trait;
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::sync::mpsc;

use crate::figures::{median, percentiles};
use crate::library::RUN_RESUMED;
use crate::library::{self, probe_failed, Agent, AgentError, AgentRegistry, DbArgs, EventSink, HostError, Hub};
use crate::library::{RunHost, RunId, RunInput, RunStatus, Tool, ToolCall, ToolRegistry, Worker, WorkerConfig};
use crate::queue::{drain_noops, spawn_serve, wait_status};
use crate::{sql, BenchArgs};

/// The no-op tool's name, granted to the benchmark's probes.
const NOOP_TOOL: &str = "bench-noop";
/// Calls before the measured ones, to warm connections and caches.
const WARMUP: usize = 20;
/// Bound on any one wait of the benchmark.
const WAIT_MAX: Duration = Duration::from_secs(30);
/// Bound on recording every replay run's calls.
const RECORD_MAX: Duration = Duration::from_secs(600);
/// The pinned manifest that makes a built-in resumable.
const RESUMABLE: &str = r#"{"durability": "resume"}"#;

/// Answers `{}` at once: the host's cost of a call, nothing else.
struct NoopTool;

#[async_trait]
impl Tool for NoopTool {
    async fn call(&self, _call: &ToolCall<'_>, _sink: &dyn EventSink) -> Result<Value, HostError> {
        Ok(json!({}))
    }

    fn timeout(&self) -> Duration {
        WAIT_MAX
    }

    fn idempotent(&self) -> bool {
        true
    }
}

fn tools() -> ToolRegistry {
    let mut tools = ToolRegistry::default();
    tools.insert(NOOP_TOOL, Arc::new(NoopTool));
    tools
}

/// The manifest of a probe granted the no-op tool for `calls` calls.
fn manifest(calls: usize, resumable: bool) -> Value {
    let mut m = json!({ "tools": [NOOP_TOOL], "limits": { "tool_calls_max": calls.max(1) } });
    if resumable {
        m["durability"] = json!("resume");
    }
    m
}

pub async fn durable(pool: &PgPool, url: &str, db_args: &DbArgs, args: &BenchArgs) -> anyhow::Result<()> {
    call_cost(pool, url, args).await?;
    drain_resumable(pool, url, args).await?;
    sigkill_to_resumed(pool, url, args, db_args).await?;
    replay(pool, url, args).await
}

/// Times `config.calls` no-op tool calls (after [`WARMUP`]) on its run's host.
struct CallProbe(mpsc::UnboundedSender<Vec<Duration>>);

#[async_trait]
impl Agent for CallProbe {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        let calls = input.config["calls"].as_u64().unwrap_or(0) as usize;
        let mut samples = Vec::with_capacity(calls);
        for i in 0..WARMUP + calls {
            let t0 = Instant::now();
            host.call_tool(NOOP_TOOL, "{}").await?;
            if i >= WARMUP {
                samples.push(t0.elapsed());
            }
        }
        self.0.send(samples).map_err(probe_failed)?;
        Ok(String::new())
    }
}

/// The cost of recording: `call-tool` of the no-op tool through the run
/// host, on an at-most-once run and on a resumable one (each call a fenced
/// insert before the tool runs and a fenced update before the answer).
async fn call_cost(pool: &PgPool, url: &str, args: &BenchArgs) -> anyhow::Result<()> {
    sql::reset(pool).await?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut agents = AgentRegistry::default().with_tools(tools());
    agents.insert("call-probe", Arc::new(CallProbe(tx)));
    let config =
        WorkerConfig { max_runs: 1, worker_id: "bench".into(), tenant_slot_share_pct: 100, ..WorkerConfig::default() };
    let worker = Worker::start(pool.clone(), Some(Hub::start(url.to_string())), agents, config).await?;
    let calls = args.samples;
    let mut p50s = Vec::new();
    for resumable in [false, true] {
        let m = manifest(WARMUP + calls, resumable);
        let run =
            library::enqueue_pinned(pool, "probe", "call-probe", None, Some(&m), &json!({ "calls": calls })).await?;
        let mut samples = tokio::time::timeout(WAIT_MAX + calls as u32 * Duration::from_millis(100), rx.recv())
            .await
            .context("the call-tool probe did not report")?
            .context("worker stopped")?;
        wait_status(pool, run.run_id, "the call-tool probe did not end", |s| s != RunStatus::Running).await?;
        let (status, error) = library::status(pool, run.run_id).await?;
        anyhow::ensure!(status == RunStatus::Completed, "the call-tool probe ended {status:?}: {error:?}");
        let line = percentiles(&mut samples);
        p50s.push(samples[(samples.len().max(1) - 1) / 2]);
        let how = if resumable { "resumable (recorded)" } else { "at-most-once" };
        println!("call-tool round trip, no-op tool, {how}, {calls} calls: {line}");
    }
    worker.drain().await;
    println!("ratio call-tool p50 resumable / at-most-once: {:.2}", p50s[1].as_secs_f64() / p50s[0].as_secs_f64());
    Ok(())
}

/// Drain of pre-enqueued `noop` runs, at-most-once and resumable passes
/// interleaved (the same worker settings as the drain figure).
async fn drain_resumable(pool: &PgPool, url: &str, args: &BenchArgs) -> anyhow::Result<()> {
    let (n, k) = (args.resume_runs, args.in_flight);
    let (mut plain, mut resumable) = (Vec::new(), Vec::new());
    for pass in 1..=args.passes {
        let p = drain_noops(pool, url, n, k, None).await?;
        let r = drain_noops(pool, url, n, k, Some(RESUMABLE)).await?;
        println!("  pass {pass}: at-most-once {p:.0} runs/s, resumable {r:.0} runs/s");
        plain.push(p);
        resumable.push(r);
    }
    let (p, r) = (median(&mut plain), median(&mut resumable));
    println!(
        "drain {n} no-op runs, {k} in flight, at-most-once: median {p:.0} runs/s; resumable: median {r:.0} runs/s \
         over {} passes",
        args.passes
    );
    println!("ratio drain resumable / at-most-once: {:.2} (goal at least 0.9)", r / p);
    Ok(())
}

/// SIGKILL to resumed: a real `serve` child (lease 1 s, grace 0.3 s) holds a
/// resumable `sleep` run and is killed; a worker in this process (reaper
/// every 100 ms) requeues the run and claims it, and the figure is the kill
/// to the `run_resumed` row it journals. Median over `--kills` kills.
async fn sigkill_to_resumed(pool: &PgPool, url: &str, args: &BenchArgs, db_args: &DbArgs) -> anyhow::Result<()> {
    sql::reset(pool).await?;
    let resumer_config = WorkerConfig {
        lease: Duration::from_secs(1),
        heartbeat: Duration::from_millis(200),
        reap_grace: Duration::from_millis(300),
        reap_interval: Duration::from_millis(100),
        worker_id: "bench-resumer".into(),
        tenant_slot_share_pct: 100,
        ..WorkerConfig::default()
    };
    let manifest: Value = serde_json::from_str(RESUMABLE)?;
    let config = json!({ "steps": 100_000, "step_ms": 20 });
    let mut samples = Vec::new();
    for _ in 0..args.kills {
        let mut child = spawn_serve(url, db_args)?;
        let run = library::enqueue_pinned(pool, "bench", "sleep", None, Some(&manifest), &config).await?;
        let claimed = wait_status(pool, run.run_id, "the child never claimed the run", |s| s == RunStatus::Running);
        if let Err(e) = claimed.await {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        // Started only now, so the child, not this worker, claims the first attempt.
        let hub = Hub::start(url.to_string());
        let resumer =
            Worker::start(pool.clone(), Some(hub.clone()), AgentRegistry::with_builtins(), resumer_config.clone())
                .await;
        let connecting = Instant::now();
        while resumer.is_ok() && !hub.stats().connected.load(std::sync::atomic::Ordering::Relaxed) {
            if connecting.elapsed() > WAIT_MAX {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        child.kill()?;
        let killed = Instant::now();
        let _ = child.wait();
        let resumer = resumer?;
        anyhow::ensure!(hub.stats().connected.load(std::sync::atomic::Ordering::Relaxed), "the hub did not connect");
        let mut tick = tokio::time::interval(Duration::from_millis(2));
        while !library::has_event(pool, run.run_id, RUN_RESUMED, 100_000).await? {
            anyhow::ensure!(killed.elapsed() < WAIT_MAX, "the run was not resumed within {WAIT_MAX:?}");
            tick.tick().await;
        }
        samples.push(killed.elapsed());
        library::cancel(pool, run.run_id).await?;
        wait_status(pool, run.run_id, "the resumed run did not end", |s| s == RunStatus::Cancelled).await?;
        resumer.drain().await;
    }
    println!(
        "SIGKILL to run_resumed by another worker (lease 1 s, reap grace 0.3 s, reaper every 100 ms), {} kills: {} \
         (goal under 1.6 s)",
        args.kills,
        percentiles(&mut samples)
    );
    Ok(())
}

/// What a resumed replay run measured when it went live again.
struct Live {
    /// The resumed attempt's claim to live, by the database's clock.
    from_claim: Duration,
    /// Its `run_resumed` row to live, by the database's clock.
    from_resumed: Duration,
}

/// Makes `config.calls` no-op tool calls (distinct arguments). On its first
/// attempt it then reports the run as recorded and waits to be handed back;
/// resumed, it answers every call from the log and, live again after the
/// last one, reads how long that took.
struct Replayer {
    pool: PgPool,
    recorded: mpsc::UnboundedSender<RunId>,
    live: mpsc::UnboundedSender<Result<Live, String>>,
}

#[async_trait]
impl Agent for Replayer {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        let calls = input.config["calls"].as_u64().unwrap_or(0);
        for i in 0..calls {
            host.call_tool(NOOP_TOOL, &format!("{{\"i\":{i}}}")).await?;
        }
        if host.resumed().is_none() {
            let _ = self.recorded.send(host.run_id());
            // Until the drain runs out of budget and hands the run back.
            std::future::pending::<()>().await;
        }
        let since = sql::since_resume(&self.pool, host.run_id()).await;
        let live = match since {
            Ok(_) if host.replayed() != calls => Err(format!("replayed {} of {calls} calls", host.replayed())),
            Ok((claim, resumed)) if claim.is_finite() && resumed.is_finite() => Ok(Live {
                from_claim: Duration::from_secs_f64(claim.max(0.0)),
                from_resumed: Duration::from_secs_f64(resumed.max(0.0)),
            }),
            Ok(_) => Err("the run has no claim or run_resumed row".into()),
            Err(e) => Err(e.to_string()),
        };
        self.live.send(live).map_err(probe_failed)?;
        Ok(String::new())
    }
}

/// Replay of `--replay-calls` recorded calls: `--replays` resumable runs
/// record their calls on one worker, which is drained with a tiny budget
/// and hands them back; a second worker (one run at a time, heartbeat far
/// off so the claim's stamp stays put) resumes each.
async fn replay(pool: &PgPool, url: &str, args: &BenchArgs) -> anyhow::Result<()> {
    sql::reset(pool).await?;
    let (calls, runs) = (args.replay_calls, args.replays);
    let (recorded_tx, mut recorded) = mpsc::unbounded_channel();
    let (live_tx, mut live) = mpsc::unbounded_channel();
    let mut agents = AgentRegistry::default().with_tools(tools());
    agents.insert("replayer", Arc::new(Replayer { pool: pool.clone(), recorded: recorded_tx, live: live_tx }));
    let first_config = WorkerConfig {
        max_runs: runs,
        drain_timeout: Duration::from_millis(10),
        worker_id: "bench-first".into(),
        tenant_slot_share_pct: 100,
        ..WorkerConfig::default()
    };
    let first = Worker::start(pool.clone(), Some(Hub::start(url.to_string())), agents.clone(), first_config).await?;
    let m = manifest(calls, true);
    let config = json!({ "calls": calls });
    for _ in 0..runs {
        library::enqueue_pinned(pool, "bench", "replayer", None, Some(&m), &config).await?;
    }
    let t0 = Instant::now();
    for _ in 0..runs {
        let left = RECORD_MAX.saturating_sub(t0.elapsed());
        tokio::time::timeout(left, recorded.recv())
            .await
            .with_context(|| format!("{runs} runs did not record {calls} calls within {RECORD_MAX:?}"))?
            .context("worker stopped")?;
    }
    // Every run is held by the first worker: the second only resumes.
    let hub = Hub::start(url.to_string());
    let second_config = WorkerConfig {
        max_runs: 1,
        lease: Duration::from_secs(3600),
        heartbeat: Duration::from_secs(1800),
        worker_id: "bench-resumer".into(),
        tenant_slot_share_pct: 100,
        ..WorkerConfig::default()
    };
    let second = Worker::start(pool.clone(), Some(hub.clone()), agents, second_config).await?;
    let connecting = Instant::now();
    while !hub.stats().connected.load(std::sync::atomic::Ordering::Relaxed) {
        anyhow::ensure!(connecting.elapsed() < WAIT_MAX, "the hub did not connect");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let report = first.drain().await;
    anyhow::ensure!(report.aborted == runs, "the drain handed back {} of {runs} runs", report.aborted);
    let (mut from_claim, mut from_resumed) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let l = tokio::time::timeout(WAIT_MAX, live.recv())
            .await
            .context("a handed-back run was not resumed")?
            .context("worker stopped")?
            .map_err(anyhow::Error::msg)?;
        from_claim.push(l.from_claim);
        from_resumed.push(l.from_resumed);
    }
    let t0 = Instant::now();
    while second.stats().finished.load(std::sync::atomic::Ordering::Relaxed) < runs as u64 {
        anyhow::ensure!(t0.elapsed() < WAIT_MAX, "the resumed runs did not end");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    second.drain().await;
    println!(
        "replay of {calls} recorded calls, resumed attempt's claim to agent live after the last, {runs} runs: {} \
         (goal p99 under 200 ms)",
        percentiles(&mut from_claim)
    );
    println!(
        "replay of {calls} recorded calls, run_resumed row to agent live after the last, {runs} runs: {} \
         (goal p99 under 200 ms)",
        percentiles(&mut from_resumed)
    );
    Ok(())
}
