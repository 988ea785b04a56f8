//! The sandbox's costs: instantiation from the cached pre plus a trivial run,
//! one `emit-event` host call, cancel to terminal, and memory per parked
//! guest.
//!
//! Guests run on the host of a run that a real worker claimed: the probe is
//! an agent, and the worker hands it the run's host (journal, fence, cancel)
//! as it hands any agent. Every emit goes through that run's journal, and the
//! run ends through the worker's terminal write; the benchmark never opens a
//! journal or picks a seq of its own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_trait::async_trait;
use serde_json::json;
use sqlx::PgPool;

use crate::figures::{percentiles, rss_bytes};
use crate::library::{self, guest_input, probe_failed, run_guest, Agent, AgentError, AgentRegistry, DbArgs, Hub};
use crate::library::{Manifest, RunHost, RunInput, RunStatus, Sandbox, Worker, WorkerConfig};
use crate::{sql, BenchArgs};

/// The probe's plugin name (a built-in agent of the benchmark's workers).
const PROBE: &str = "sandbox-probe";
/// Bound on one probe run (the parked guests take longest to start).
const PROBE_MAX: Duration = Duration::from_secs(600);
/// Bound on parking every guest.
const PARK_MAX: Duration = Duration::from_secs(120);
/// Guest runs of 1,000 content deltas each, for the emit-event figure.
const EMIT_RUNS: usize = 20;
const EMIT_WORDS: usize = 1000;
/// Bound on any one wait for a run.
const WAIT_MAX: Duration = Duration::from_secs(30);
const CANCEL_GRACE: Duration = Duration::from_millis(500);

/// Runs guests on its run's host and prints what they cost. The run's config
/// says which measurement: `{"measure": "calls"}` or `{"measure": "parked"}`.
struct Probe {
    sandbox: Arc<Sandbox>,
    echo: String,
    fixtures: String,
    samples: usize,
    parked: usize,
}

#[async_trait]
impl Agent for Probe {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        match input.config["measure"].as_str() {
            Some("calls") => self.calls(host, &input).await.map_err(probe_failed)?,
            Some("parked") => self.parked(host, &input).await.map_err(probe_failed)?,
            other => return Err(probe_failed(format!("unknown measure {other:?}"))),
        }
        Ok(String::new())
    }
}

impl Probe {
    /// Instantiation from the cached pre with a guest that makes no host
    /// call; then `emit-event` through the run's journal writer.
    async fn calls(&self, host: &RunHost, input: &RunInput) -> anyhow::Result<()> {
        let manifest = Manifest::default();
        let trivial = || guest_input(input, "", json!({}));
        run_guest(&self.sandbox, host, &self.echo, &manifest, trivial()).await?; // warm the caches
        let mut samples = Vec::with_capacity(self.samples);
        for _ in 0..self.samples {
            let t0 = Instant::now();
            run_guest(&self.sandbox, host, &self.echo, &manifest, trivial()).await?;
            samples.push(t0.elapsed());
        }
        println!("sandbox: store + instantiate + trivial run, {} runs: {}", self.samples, percentiles(&mut samples));

        // echo emits one content delta per word.
        let words = "w ".repeat(EMIT_WORDS);
        let mut per_call = Vec::with_capacity(EMIT_RUNS);
        for _ in 0..EMIT_RUNS {
            let t0 = Instant::now();
            run_guest(&self.sandbox, host, &self.echo, &manifest, guest_input(input, &words, json!({}))).await?;
            per_call.push(t0.elapsed() / EMIT_WORDS as u32);
        }
        println!("sandbox: one emit-event (content_delta) host call: {}", percentiles(&mut per_call));
        Ok(())
    }

    /// Memory: guests parked in a long host call, all on this run's host.
    async fn parked(&self, host: &RunHost, input: &RunInput) -> anyhow::Result<()> {
        let parked = self.parked;
        let rss_before = rss_bytes();
        let mut tasks = Vec::with_capacity(parked);
        for _ in 0..parked {
            let (sandbox, host, digest) = (self.sandbox.clone(), host.clone(), self.fixtures.clone());
            let input = guest_input(input, "park", json!({ "mode": "block" }));
            tasks.push(tokio::spawn(
                async move { run_guest(&sandbox, &host, &digest, &Manifest::default(), input).await },
            ));
        }
        let t0 = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        while self.sandbox.live() < parked {
            tick.tick().await;
            anyhow::ensure!(t0.elapsed() < PARK_MAX, "only {} of {parked} guests parked", self.sandbox.live());
        }
        let rss_after = rss_bytes();
        println!(
            "sandbox: {parked} guests parked in a host call: process RSS {:.0} MiB, {:.0} KiB per parked guest",
            rss_after as f64 / (1 << 20) as f64,
            rss_after.saturating_sub(rss_before) as f64 / 1024.0 / parked as f64
        );
        for t in &tasks {
            t.abort();
        }
        // Their stores are gone once the aborted tasks are.
        for t in tasks {
            let _ = t.await;
        }
        Ok(())
    }
}

/// One probe run, claimed and ended by a worker of its own.
async fn probe_run(pool: &PgPool, url: &str, probe: Arc<Probe>, measure: &str) -> anyhow::Result<()> {
    let mut agents = AgentRegistry::default();
    agents.insert(PROBE, probe);
    let config =
        WorkerConfig { max_runs: 1, worker_id: "bench".into(), tenant_slot_share_pct: 100, ..WorkerConfig::default() };
    let worker = Worker::start(pool.clone(), Some(Hub::start(url.to_string())), agents, config).await?;
    let run = library::enqueue(pool, "probe", PROBE, None, &json!({ "measure": measure })).await?;
    let t0 = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    while !library::is_terminal(pool, run.run_id).await? {
        tick.tick().await;
        anyhow::ensure!(t0.elapsed() < PROBE_MAX, "the sandbox probe ({measure}) did not end within {PROBE_MAX:?}");
    }
    worker.drain().await;
    let (status, error) = library::status(pool, run.run_id).await?;
    anyhow::ensure!(status == RunStatus::Completed, "the sandbox probe ({measure}) ended {status:?}: {error:?}");
    Ok(())
}

pub async fn sandbox(pool: &PgPool, url: &str, db_args: &DbArgs, args: &BenchArgs) -> anyhow::Result<()> {
    let dir = &args.plugin_dir;
    let (echo, fixtures) = (dir.join("echo.wasm"), dir.join("fixtures.wasm"));
    if !echo.exists() || !fixtures.exists() {
        println!(
            "sandbox: skipped, no plugins in {} (cargo build --release --target wasm32-wasip2 --manifest-path plugins/Cargo.toml)",
            dir.display()
        );
        return Ok(());
    }
    sql::reset(pool).await?;
    let sandbox = Sandbox::new(pool.clone(), Some(db_args.cache_dir.clone()))?;
    let mut digests = Vec::new();
    for (name, path) in [("echo", &echo), ("fixtures", &fixtures)] {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        digests.push(library::put_plugin(pool, &sandbox, name, &bytes).await?);
    }
    let probe = Arc::new(Probe {
        sandbox: sandbox.clone(),
        echo: digests[0].clone(),
        fixtures: digests[1].clone(),
        samples: args.samples,
        parked: args.parked,
    });
    probe_run(pool, url, probe.clone(), "calls").await?;
    cancel_latency(pool, url, &sandbox, &digests, args).await?;
    probe_run(pool, url, probe, "parked").await
}

/// Cancel commit to terminal commit, through a real worker: a cooperative
/// guest (echo, checking cancel between words) and one that never looks
/// (interrupted after the grace).
async fn cancel_latency(
    pool: &PgPool,
    url: &str,
    sandbox: &Arc<Sandbox>,
    digests: &[String],
    args: &BenchArgs,
) -> anyhow::Result<()> {
    sql::reset(pool).await?;
    let agents = AgentRegistry::default().with_sandbox(sandbox.clone());
    let config = WorkerConfig {
        worker_id: "bench".into(),
        cancel_grace: CANCEL_GRACE,
        tenant_slot_share_pct: 100,
        ..WorkerConfig::default()
    };
    let hub = Hub::start(url.to_string());
    let worker = Worker::start(pool.clone(), Some(hub.clone()), agents, config).await?;
    let words = "word ".repeat(100_000);
    let cases = [
        ("echo", &digests[0], words.as_str(), json!({ "delay_ms": 2 }), args.samples.min(50)),
        ("fixtures", &digests[1], "x", json!({ "mode": "ignore-cancel" }), args.samples.min(10)),
    ];
    for (plugin, digest, content, config, n) in cases {
        let mut samples = Vec::with_capacity(n);
        for _ in 0..n {
            let run = library::enqueue(pool, content, plugin, Some(digest), &config).await?;
            let mut ended = hub.subscribe(&library::events_channel(run.run_id)).await;
            let t0 = Instant::now();
            while library::status(pool, run.run_id).await?.0 != RunStatus::Running {
                anyhow::ensure!(t0.elapsed() < WAIT_MAX, "bench run was not claimed");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            // Let the guest get going before the stop.
            tokio::time::sleep(Duration::from_millis(20)).await;
            library::cancel(pool, run.run_id).await?;
            let asked = Instant::now();
            while !library::is_terminal(pool, run.run_id).await? {
                tokio::time::timeout(WAIT_MAX, ended.recv()).await.context("run did not end")?;
            }
            samples.push(asked.elapsed());
        }
        let what = if plugin == "echo" { "cooperative guest" } else { "guest ignoring cancel, grace 500 ms" };
        println!("cancel to terminal, {what}, {n} runs: {}", percentiles(&mut samples));
    }
    worker.drain().await;
    Ok(())
}
