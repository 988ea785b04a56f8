//! Approvals' costs: a decision (`POST /v1/runs/{id}/approvals/{call_id}`)
//! to the resumed run's `run_resumed` row and to the approved tool's call
//! starting, and the resident memory of runs waiting for a decision.
//!
//! The runs are a built-in agent's, resumable, whose one call of the `send`
//! tool needs approval (pinned manifest: `"approval": {"send": "always"}`):
//! the worker records the call and suspends the run (waiting: no lease, no
//! slot), and a decision re-queues it for any worker to resume by replay.

use std::io::{BufRead, Write};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_trait::async_trait;
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::sync::mpsc;

use crate::figures::{percentiles, rss_of};
use crate::library::{self, Agent, AgentError, AgentRegistry, DbArgs, EventSink, HostError, Hub};
use crate::library::{RunHost, RunId, RunInput, RunStatus, Tool, ToolCall, ToolRegistry, Worker, WorkerConfig};
use crate::queue::wait_status;
use crate::{sql, BenchArgs};

/// The tool whose calls need approval.
const SEND_TOOL: &str = "send";
/// The built-in agent that calls it once.
const APPROVER: &str = "bench-approver";
/// Its run's one call of [`SEND_TOOL`] (the tool call's ordinal).
const CALL_ID: i32 = 1;
/// Decisions before the measured ones, to warm connections and caches.
const WARMUP: usize = 5;
/// Bound on any one wait of the benchmark.
const WAIT_MAX: Duration = Duration::from_secs(30);
/// Bound on all the runs reaching their approval.
const SUSPEND_MAX: Duration = Duration::from_secs(600);
/// Worker slots of the measured hosts (the approvals test's `--max-runs 32`).
const SLOTS: usize = 32;
/// The pinned manifest of the approver's runs.
const MANIFEST: &str = r#"{"tools": ["send"], "durability": "resume", "approval": {"send": "always"}}"#;
/// The waiter child's line once its worker listens.
const READY: &str = "waiter ready";

/// Answers `{}` at once, first telling the benchmark (if it listens) which
/// run's call started when.
struct SendTool(Option<mpsc::UnboundedSender<(RunId, Instant)>>);

#[async_trait]
impl Tool for SendTool {
    async fn call(&self, call: &ToolCall<'_>, _sink: &dyn EventSink) -> Result<Value, HostError> {
        if let Some(tx) = &self.0 {
            let _ = tx.send((call.run_id, Instant::now()));
        }
        Ok(json!({}))
    }

    fn timeout(&self) -> Duration {
        WAIT_MAX
    }
}

/// Calls [`SEND_TOOL`] once and answers: its first attempt suspends there.
struct Approver;

#[async_trait]
impl Agent for Approver {
    async fn run(&self, host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        host.call_tool(SEND_TOOL, "{}").await?;
        Ok("sent".into())
    }
}

fn agents(started: Option<mpsc::UnboundedSender<(RunId, Instant)>>) -> AgentRegistry {
    let mut tools = ToolRegistry::default();
    tools.insert(SEND_TOOL, Arc::new(SendTool(started)));
    let mut agents = AgentRegistry::default().with_tools(tools);
    agents.insert(APPROVER, Arc::new(Approver));
    agents
}

fn worker_config(worker_id: &str) -> WorkerConfig {
    WorkerConfig { max_runs: SLOTS, worker_id: worker_id.into(), tenant_slot_share_pct: 100, ..WorkerConfig::default() }
}

pub async fn approvals(pool: &PgPool, url: &str, db_args: &DbArgs, args: &BenchArgs) -> anyhow::Result<()> {
    decision_latency(pool, url, args).await?;
    waiting_memory(pool, url, db_args, args).await
}

/// Waits until `n` runs are waiting.
async fn wait_waiting(pool: &PgPool, n: usize) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    while sql::count_status(pool, "waiting").await? < n as i64 {
        anyhow::ensure!(t0.elapsed() < SUSPEND_MAX, "{n} runs did not wait for approval within {SUSPEND_MAX:?}");
        tick.tick().await;
    }
    Ok(())
}

/// Decision to resumed: `--decisions` runs wait for approval on a worker in
/// this process (hub up); each is approved in turn over HTTP (the host's
/// router, in this process) and timed from just before the POST to its
/// answer, to its `run_resumed` row (by the database's clock: the row's
/// age read once the tool started, taken from the elapsed time then) and to
/// the approved tool's call starting on the resumed attempt.
async fn decision_latency(pool: &PgPool, url: &str, args: &BenchArgs) -> anyhow::Result<()> {
    sql::reset(pool).await?;
    let (tx, mut started) = mpsc::unbounded_channel();
    let hub = Hub::start(url.to_string());
    let worker = Worker::start(pool.clone(), Some(hub.clone()), agents(Some(tx)), worker_config("bench")).await?;
    let connecting = Instant::now();
    while !hub.stats().connected.load(Ordering::Relaxed) {
        anyhow::ensure!(connecting.elapsed() < WAIT_MAX, "the hub did not connect");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let n = WARMUP + args.decisions;
    let manifest: Value = serde_json::from_str(MANIFEST)?;
    let mut runs = Vec::with_capacity(n);
    for _ in 0..n {
        runs.push(library::enqueue_pinned(pool, "bench", APPROVER, None, Some(&manifest), &json!({})).await?.run_id);
    }
    wait_waiting(pool, n).await?;

    let token = library::token(pool).await?;
    let (addr, server) = crate::queue::serve_api(pool).await?;
    let client = reqwest::Client::new();
    let body = json!({ "decision": "approve" });
    let (mut answered, mut resumed, mut tool) = (Vec::new(), Vec::new(), Vec::new());
    for (i, run) in runs.iter().enumerate() {
        let post = format!("http://{addr}/v1/runs/{run}/approvals/{CALL_ID}");
        let t0 = Instant::now();
        let res = client.post(&post).bearer_auth(&token).json(&body).send().await?;
        anyhow::ensure!(res.status() == 200, "the decision answered {}", res.status());
        res.bytes().await?;
        let answer = t0.elapsed();
        let (id, at) = tokio::time::timeout(WAIT_MAX, started.recv())
            .await
            .context("the approved call did not start")?
            .context("worker stopped")?;
        anyhow::ensure!(id == *run, "run {id}'s call started, not the approved {run}'s");
        let before = t0.elapsed();
        let (_, since_resumed) = sql::since_resume(pool, *run).await?;
        let read = (before + t0.elapsed()) / 2;
        anyhow::ensure!(since_resumed.is_finite(), "run {run} has no run_resumed row");
        if i >= WARMUP {
            answered.push(answer);
            resumed.push(read.saturating_sub(Duration::from_secs_f64(since_resumed.max(0.0))));
            tool.push(at.saturating_duration_since(t0));
        }
    }
    server.abort();
    for run in &runs {
        wait_status(pool, *run, "an approved run did not end", |s| s != RunStatus::Running && s != RunStatus::Queued)
            .await?;
        let (status, error) = library::status(pool, *run).await?;
        anyhow::ensure!(status == RunStatus::Completed, "an approved run ended {status:?}: {error:?}");
    }
    worker.drain().await;
    let d = args.decisions;
    println!(
        "approval decision, POST /v1/runs/{{id}}/approvals/{{call_id}} answered, {d} decisions: {}",
        percentiles(&mut answered)
    );
    println!(
        "approval decision to run_resumed row (hub up), {d} decisions: {} (goal p50 under 50 ms plus the replay)",
        percentiles(&mut resumed)
    );
    println!(
        "approval decision to the approved tool's call starting (hub up), {d} decisions: {} (goal p50 under 50 ms \
         plus the replay)",
        percentiles(&mut tool)
    );
    Ok(())
}

/// Resident memory per waiting run: a host of its own (this binary's hidden
/// `waiter`, a worker of [`SLOTS`] slots with the approver) is warmed by one
/// run through its approval, then `--waiting` runs are enqueued and each
/// suspends; its RSS with them waiting minus its RSS idle, over the count.
async fn waiting_memory(pool: &PgPool, url: &str, db_args: &DbArgs, args: &BenchArgs) -> anyhow::Result<()> {
    sql::reset(pool).await?;
    let mut child = Waiter::spawn(url, db_args)?;
    let result = measure_waiting(pool, &mut child, args.waiting).await;
    child.stop();
    result
}

async fn measure_waiting(pool: &PgPool, child: &mut Waiter, n: usize) -> anyhow::Result<()> {
    let manifest: Value = serde_json::from_str(MANIFEST)?;
    let warm = library::enqueue_pinned(pool, "bench", APPROVER, None, Some(&manifest), &json!({})).await?.run_id;
    wait_waiting(pool, 1).await?;
    library::approve(pool, warm, CALL_ID).await?;
    wait_status(pool, warm, "the warm-up run did not end", |s| s == RunStatus::Completed).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let idle = rss_of(&child.pid());

    for chunk in (0..n).collect::<Vec<_>>().chunks(5_000) {
        sql::bulk_enqueue(pool, chunk.len() as i64, APPROVER, Some(MANIFEST)).await?;
    }
    wait_waiting(pool, n).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let waiting = rss_of(&child.pid());
    let (held, suspended, fenced) = child.stats()?;
    let running = sql::count_status(pool, "running").await?;
    anyhow::ensure!(idle > 0 && waiting > 0, "could not read the waiter's resident memory");
    let per_run = (waiting as f64 - idle as f64) / n as f64;
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "{n} runs waiting for approval, one host ({SLOTS} slots): RSS idle {:.1} MiB, with them {:.1} MiB, {per_run:.0} \
         bytes per waiting run; slots held {held}, runs running {running}; its worker counted {suspended} suspended, \
         {fenced} lost to the fence",
        mib(idle),
        mib(waiting)
    );
    Ok(())
}

/// The hidden `waiter` child: its pid, its stdin (a line `stats` asks; its
/// end stops it) and its stdout.
struct Waiter {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Waiter {
    fn spawn(url: &str, db_args: &DbArgs) -> anyhow::Result<Waiter> {
        let mut child = std::process::Command::new(std::env::current_exe()?)
            .args(["--database-url", url, "--cache-dir"])
            .arg(&db_args.cache_dir)
            .arg("waiter")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()?;
        let stdin = child.stdin.take();
        let stdout = std::io::BufReader::new(child.stdout.take().context("child stdout")?);
        let mut w = Waiter { child, stdin, stdout };
        match w.line() {
            Ok(l) if l == READY => Ok(w),
            other => {
                w.stop();
                anyhow::bail!("the waiter child did not start: {other:?}")
            }
        }
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    fn line(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        anyhow::ensure!(self.stdout.read_line(&mut line)? > 0, "the waiter child exited");
        Ok(line.trim_end().to_string())
    }

    /// Its worker's slots held, runs it counted suspended and runs it counted lost to the fence.
    fn stats(&mut self) -> anyhow::Result<(usize, u64, u64)> {
        writeln!(self.stdin.as_mut().context("waiter stopped")?, "stats")?;
        let line = self.line()?;
        let mut words = line.split_whitespace();
        let (Some(held), Some(suspended), Some(fenced)) = (words.next(), words.next(), words.next()) else {
            anyhow::bail!("the waiter answered {line:?}");
        };
        Ok((held.parse()?, suspended.parse()?, fenced.parse()?))
    }

    /// Closes its stdin (it drains and exits); killed if it has not after [`WAIT_MAX`].
    fn stop(&mut self) {
        self.stdin = None;
        let t0 = Instant::now();
        while t0.elapsed() < WAIT_MAX {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `waiter` role: a worker with the approver and nothing else (no API,
/// no sandbox), until its stdin ends; a `stats` line answers
/// `<slots held> <runs counted suspended> <runs counted lost to the fence>`.
pub async fn waiter(db_args: &DbArgs) -> anyhow::Result<()> {
    let mut database = library::open_database(db_args).await?;
    let pool = library::connect_and_migrate(&database.url, 8).await?;
    let hub = Hub::start(database.listen_url.clone());
    let worker = Worker::start(pool.clone(), Some(hub.clone()), agents(None), worker_config("bench-waiter")).await?;
    let connecting = Instant::now();
    while !hub.stats().connected.load(Ordering::Relaxed) {
        anyhow::ensure!(connecting.elapsed() < WAIT_MAX, "the hub did not connect");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    println!("{READY}");
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(tokio::io::stdin()));
    while let Some(line) = lines.next_line().await? {
        if line.trim() == "stats" {
            let stats = worker.stats();
            let (suspended, fenced) = (stats.suspended.load(Ordering::Relaxed), stats.fenced.load(Ordering::Relaxed));
            println!("{} {suspended} {fenced}", worker.in_flight());
        }
    }
    worker.drain().await;
    pool.close().await;
    if let Some(c) = database.cluster.as_mut() {
        c.stop();
    }
    Ok(())
}
