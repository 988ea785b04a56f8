//! Live runs (issue 43): N concurrent turns of the Rust `chat` plugin on one
//! `serve` process (or `--live-processes K` sharing the database), each
//! against a streaming mock model built into this benchmark (an
//! OpenAI-compatible `/v1/chat/completions` that sends `--live-tokens-per-s`
//! tokens a second for `--live-secs`), each followed by one SSE client of
//! its own. Prints the database's commits a second
//! (`pg_stat_database.xact_commit`), its WAL bytes a second, the journal's
//! group commits and NOTIFYs a second (the hosts' `/metrics`), the CPU the
//! hosts and the database spent per live run-second, the hosts' resident
//! memory per live run (their peak over their idle size), the delay from a
//! token leaving the mock model to its client reading it (p50, p99, max),
//! and any frame lost or repeated.
//!
//! Each token's text is `<index>:<microseconds since the benchmark's
//! origin> `; the clients read the same clock (one process), so the delay is
//! exact, whatever merging the journal does to the tokens on the way.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use futures::StreamExt;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::figures::{self, percentiles};
use crate::library::{self, DbArgs, SseDecoder};
use crate::{sql, BenchArgs};

/// Turns posted at once while the benchmark enqueues them.
const ENQUEUE_CONCURRENCY: usize = 32;
/// Bound on one client's wait for the next piece of its stream.
const READ_MAX: Duration = Duration::from_secs(120);

struct Mock {
    origin: Instant,
    tokens: usize,
    every: Duration,
    sent: AtomicU64,
}

fn micros(origin: Instant) -> u64 {
    origin.elapsed().as_micros() as u64
}

async fn completions(State(m): State<Arc<Mock>>, _body: String) -> Response {
    let m2 = m.clone();
    let chunks = futures::stream::unfold(0usize, move |i| {
        let m = m2.clone();
        async move {
            if i > m.tokens {
                return None;
            }
            if i == m.tokens {
                let done =
                    "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
                return Some((Ok::<_, std::convert::Infallible>(done.to_string()), i + 1));
            }
            if i > 0 {
                tokio::time::sleep(m.every).await;
            }
            m.sent.fetch_add(1, Ordering::Relaxed);
            let text = format!("{i}:{} ", micros(m.origin));
            let chunk = json!({ "model": "mock", "choices": [{ "index": 0, "delta": { "content": text }, "finish_reason": null }] });
            Some((Ok(format!("data: {chunk}\n\n")), i + 1))
        }
    });
    Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(chunks)).unwrap()
}

/// What one client saw.
#[derive(Default)]
struct Seen {
    delays: Vec<Duration>,
    tokens: usize,
    lost: usize,
    repeated: usize,
    frames_out_of_order: usize,
    completed: bool,
}

async fn follow(addr: String, token: String, run: String, origin: Instant, tokens: usize) -> anyhow::Result<Seen> {
    let res = reqwest::Client::new()
        .get(format!("http://{addr}/v1/runs/{run}/events"))
        .bearer_auth(&token)
        .header("Accept", "text/event-stream")
        .send()
        .await?
        .error_for_status()?;
    let (mut body, mut decoder, mut out) = (res.bytes_stream(), SseDecoder::default(), Vec::new());
    let (mut seen, mut last_seq, mut got) = (Seen::default(), 0i64, HashSet::new());
    'read: while let Some(chunk) = tokio::time::timeout(READ_MAX, body.next()).await? {
        decoder.feed(&chunk?, &mut out).map_err(anyhow::Error::msg)?;
        let now = micros(origin);
        for data in out.drain(..) {
            let event: Value = serde_json::from_str(&data)?;
            let seq = event["seq"].as_i64().unwrap_or(0);
            if seq != last_seq + 1 {
                seen.frames_out_of_order += 1;
            }
            last_seq = seq;
            match event["type"].as_str() {
                Some("content_delta") => {
                    for piece in event["delta"].as_str().unwrap_or_default().split_whitespace() {
                        let Some((i, at)) = piece.split_once(':') else { continue };
                        let (Ok(i), Ok(at)) = (i.parse::<usize>(), at.parse::<u64>()) else { continue };
                        if !got.insert(i) {
                            seen.repeated += 1;
                        }
                        seen.tokens += 1;
                        seen.delays.push(Duration::from_micros(now.saturating_sub(at)));
                    }
                }
                Some("complete") => {
                    seen.completed = event["status"] == "completed";
                    break 'read;
                }
                _ => {}
            }
        }
    }
    seen.lost = tokens.saturating_sub(got.len());
    Ok(seen)
}

async fn xact_commit(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(pool)
        .await?)
}

async fn metric(addr: &str, name: &str) -> anyhow::Result<f64> {
    let text = reqwest::get(format!("http://{addr}/metrics")).await?.text().await?;
    let line = text.lines().find(|l| l.starts_with(&format!("{name} "))).with_context(|| format!("{name} missing"))?;
    Ok(line.split_whitespace().nth(1).unwrap_or("0").parse()?)
}

/// What the database and the hosts did while every turn streamed.
struct Steady {
    secs: f64,
    writes: f64,
    wal: f64,
    db_cpu_us: f64,
    host_cpu: f64,
    group: f64,
    notifies: f64,
}

/// Runs whose status is `status`.
async fn count(pool: &PgPool, status: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE status = $1").bind(status).fetch_one(pool).await?)
}

/// The steady stretch: from the moment all `n` turns run (none ended yet)
/// for a third of a turn, or until the first ends. `None` when they never
/// all ran at once.
async fn steady(
    pool: &PgPool,
    addrs: &[String],
    pids: &[String],
    n: usize,
    args: &BenchArgs,
) -> anyhow::Result<Option<Steady>> {
    let deadline = Instant::now() + Duration::from_secs(args.live_secs.max(1) * 4);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        if count(pool, "completed").await? > 0 || Instant::now() > deadline {
            return Ok(None);
        }
        if count(pool, "running").await? == n as i64 {
            break;
        }
    }
    let marks = sql::ServerMarks::read(pool).await?;
    let (group0, notifies0, cpu0, t0) = (
        metric_sum(addrs, "agent_host_journal_group_commits_total").await?,
        metric_sum(addrs, "agent_host_journal_group_notifies_total").await?,
        cpu_sum(pids),
        Instant::now(),
    );
    let window = Duration::from_secs_f64(args.live_secs as f64 / 3.0);
    while t0.elapsed() < window {
        tick.tick().await;
        if count(pool, "completed").await? > 0 {
            break;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let server = marks.per(pool, 1.0).await?;
    Ok(Some(Steady {
        secs,
        writes: server.commits,
        wal: server.wal_bytes,
        db_cpu_us: server.cpu_us,
        host_cpu: cpu_sum(pids) - cpu0,
        group: metric_sum(addrs, "agent_host_journal_group_commits_total").await? - group0,
        notifies: metric_sum(addrs, "agent_host_journal_group_notifies_total").await? - notifies0,
    }))
}

/// The sum of a figure over every process's `/metrics`.
async fn metric_sum(addrs: &[String], name: &str) -> anyhow::Result<f64> {
    let mut sum = 0.0;
    for a in addrs {
        sum += metric(a, name).await?;
    }
    Ok(sum)
}

/// The hosts' resident memory together, in bytes.
fn rss_sum(pids: &[String]) -> u64 {
    pids.iter().map(|p| figures::rss_of(p)).sum()
}

/// The hosts' proportional memory together (a page shared by n mappings,
/// a guest's initial image, counts once).
fn pss_sum(pids: &[String]) -> u64 {
    pids.iter().map(|p| figures::memory_of(p).pss).sum()
}

/// The hosts' CPU seconds together.
fn cpu_sum(pids: &[String]) -> f64 {
    pids.iter().map(|p| figures::cpu_of(p)).sum()
}

/// This binary's hidden `serve` for the live runs, once it listens; returns
/// the child and its address.
fn spawn_serve(
    url: &str,
    db_args: &DbArgs,
    n: usize,
    model: &str,
    worker: &str,
    turn_secs: u64,
) -> anyhow::Result<(std::process::Child, String)> {
    use std::io::BufRead;
    let bound = (n + 16).to_string();
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["serve", "--database-url", url, "--cache-dir"])
        .arg(&db_args.cache_dir)
        .args(["--listen", "127.0.0.1:0", "--worker-id", worker, "--max-runs", &n.to_string()])
        .args(["--llm-base-url", model, "--llm-api-key", "sk-bench", "--llm-model", "mock"])
        .args(["--sse-tails-max", &bound, "--user-max-streams", &bound, "--tenant-max-streams", &bound])
        // One tenant sends every turn: it may hold every slot.
        .args(["--tenant-slot-share-pct", "100"])
        // A turn's one model call streams for its whole length, and more
        // when the host is saturated: well past the default timeout.
        .args(["--llm-timeout-ms", &(turn_secs * 4 + 120).saturating_mul(1000).to_string()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().context("child stdout")?;
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line?;
        if let Some(addr) = line.strip_prefix("agent-host listening on http://") {
            return Ok((child, addr.trim().to_string()));
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    anyhow::bail!("the serve child exited before listening")
}

pub async fn live(pool: &PgPool, url: &str, db_args: &DbArgs, args: &BenchArgs, n: usize) -> anyhow::Result<()> {
    sql::reset(pool).await?;
    let origin = Instant::now();
    let every = Duration::from_secs_f64(1.0 / args.live_tokens_per_s.max(1) as f64);
    let tokens = (args.live_secs as f64 * args.live_tokens_per_s as f64).round() as usize;
    let mock = Arc::new(Mock { origin, tokens, every, sent: AtomicU64::new(0) });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let model = format!("http://{}/v1", listener.local_addr()?);
    let app = Router::new().route("/v1/chat/completions", post(completions)).with_state(mock.clone());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let plugin = args.live_plugin.as_str();
    let path = match plugin {
        "chat" => args.plugin_dir.join("chat.wasm"),
        guest => args.guest_dir.join(format!("{guest}.wasm")),
    };
    let wasm = std::fs::read(&path).with_context(|| {
        format!("{} (build the plugins first: scripts/build-plugin plugins/{plugin})", path.display())
    })?;
    library::put_plugin_with(pool, plugin, &wasm, &json!({ "tools": ["llm"] })).await?;
    let token = library::token(pool).await?;
    let k = args.live_processes.max(1);
    let mut children = Vec::with_capacity(k);
    let mut spawned = Ok(());
    for p in 0..k {
        match spawn_serve(url, db_args, n.div_ceil(k), &model, &format!("live-{p}"), args.live_secs) {
            Ok(child) => children.push(child),
            Err(e) => {
                spawned = Err(e);
                break;
            }
        }
    }
    let result = match spawned {
        Ok(()) => {
            let addrs: Vec<String> = children.iter().map(|c| c.1.clone()).collect();
            let pids: Vec<String> = children.iter().map(|c| c.0.id().to_string()).collect();
            drive(pool, &addrs, &pids, &token, origin, tokens, n, args).await
        }
        Err(e) => Err(e),
    };
    for (mut child, _) in children {
        let _ = child.kill();
        let _ = child.wait();
    }
    server.abort();
    result
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    pool: &PgPool,
    addrs: &[String],
    pids: &[String],
    token: &str,
    origin: Instant,
    tokens: usize,
    n: usize,
    args: &BenchArgs,
) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let commits_before = xact_commit(pool).await?;
    let marks = sql::ServerMarks::read(pool).await?;
    let notifies_before = metric_sum(addrs, "agent_host_journal_group_notifies_total").await.unwrap_or(0.0);
    let group_before = metric_sum(addrs, "agent_host_journal_group_commits_total").await.unwrap_or(0.0);
    let host_cpu_before = cpu_sum(pids);
    let rss_idle = rss_sum(pids);
    let pss_idle = pss_sum(pids);
    // The hosts' peak resident and proportional memory, sampled while the
    // turns stream (proportional every second: its walk of the mappings
    // costs more).
    let (peak, pss_peak) = (Arc::new(AtomicU64::new(rss_idle)), Arc::new(AtomicU64::new(pss_idle)));
    let sampler = {
        let (peak, pss_peak, pids) = (peak.clone(), pss_peak.clone(), pids.to_vec());
        tokio::spawn(async move {
            for tick in 0u64.. {
                peak.fetch_max(rss_sum(&pids), Ordering::Relaxed);
                if tick % 4 == 0 {
                    pss_peak.fetch_max(pss_sum(&pids), Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };
    let t0 = Instant::now();
    // The turns arrive ENQUEUE_CONCURRENCY at a time, each followed by its
    // client as soon as it is accepted.
    let posted: Vec<anyhow::Result<tokio::task::JoinHandle<anyhow::Result<Seen>>>> = futures::stream::iter(0..n)
        .map(|i| {
            let (http, addr) = (http.clone(), addrs[i % addrs.len()].clone());
            async move {
                let res = http
                    .post(format!("http://{addr}/v1/runs"))
                    .bearer_auth(token)
                    .json(&json!({ "content": format!("turn {i}"), "plugin": args.live_plugin }))
                    .send()
                    .await?;
                anyhow::ensure!(res.status() == 202, "enqueue answered {}", res.status());
                let run: Value = res.json().await?;
                let run = run["run_id"].as_str().context("run_id")?.to_string();
                Ok(tokio::spawn(follow(addr, token.to_string(), run, origin, tokens)))
            }
        })
        .buffer_unordered(ENQUEUE_CONCURRENCY)
        .collect()
        .await;
    let clients = posted.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let steady = steady(pool, addrs, pids, n, args).await?;
    let mut delays = Vec::with_capacity(n * tokens);
    let (mut lost, mut repeated, mut disorder, mut failed) = (0, 0, 0, 0);
    for c in clients {
        let seen = c.await??;
        lost += seen.lost;
        repeated += seen.repeated;
        disorder += seen.frames_out_of_order;
        failed += usize::from(!seen.completed);
        delays.extend(seen.delays);
    }
    let took = t0.elapsed().as_secs_f64();
    sampler.abort();
    let host_cpu = cpu_sum(pids) - host_cpu_before;
    // Totals over the stretch: transactions that wrote, WAL bytes, the server's CPU (µs).
    let server = marks.per(pool, 1.0).await?;
    let rss_peak = peak.load(Ordering::Relaxed).max(rss_sum(pids));
    let pss_peak = pss_peak.load(Ordering::Relaxed);
    let commits = xact_commit(pool).await? - commits_before;
    let notifies = metric_sum(addrs, "agent_host_journal_group_notifies_total").await? - notifies_before;
    let group = metric_sum(addrs, "agent_host_journal_group_commits_total").await? - group_before;
    let mut per_commit = 0.0;
    for a in addrs {
        per_commit += metric(a, "agent_host_journal_group_rows_per_commit").await? / addrs.len() as f64;
    }
    let processes = match addrs.len() {
        1 => "one process".to_string(),
        k => format!("{k} processes"),
    };
    println!(
        "live: {n} concurrent {} turns ({} tokens/s for {} s each, one SSE client each), {took:.1} s on {processes}",
        args.live_plugin, args.live_tokens_per_s, args.live_secs
    );
    // A live run-second: one turn streaming for one second.
    let run_seconds = (n as u64 * args.live_secs).max(1) as f64;
    let db = match server.cpu_us.is_finite() {
        true => format!("{:.2} ms", server.cpu_us / 1e3 / run_seconds),
        false => "n/a (server not local)".to_string(),
    };
    println!(
        "live: CPU per live run-second: hosts {:.2} ms, database {db}; hosts' resident memory {:.0} MiB idle, {:.0} MiB at peak: {:.0} KiB per live run; proportional {:.0} MiB idle, {:.0} MiB at peak: {:.0} KiB per live run",
        host_cpu * 1e3 / run_seconds,
        rss_idle as f64 / 1048576.0,
        rss_peak as f64 / 1048576.0,
        rss_peak.saturating_sub(rss_idle) as f64 / 1024.0 / n as f64,
        pss_idle as f64 / 1048576.0,
        pss_peak as f64 / 1048576.0,
        pss_peak.saturating_sub(pss_idle) as f64 / 1024.0 / n as f64
    );
    println!(
        "live: database: transactions that wrote {:.1}/s ({:.3} per live run-second), all transactions {:.0}/s (reads included), WAL {:.0} kB/s ({:.2} kB per live run-second); journal group commits {:.1}/s ({per_commit:.1} rows each), journal NOTIFYs {:.1}/s",
        server.commits / took,
        server.commits / run_seconds,
        commits as f64 / took,
        server.wal_bytes / took / 1e3,
        server.wal_bytes / run_seconds / 1e3,
        group / took,
        notifies / took
    );
    match steady {
        Some(s) => println!(
            "live: steady ({:.1} s with every turn streaming): transactions that wrote {:.1}/s, journal group commits {:.1}/s, NOTIFYs {:.1}/s, WAL {:.0} kB/s; CPU per live run-second: hosts {:.2} ms, database {}",
            s.secs,
            s.writes / s.secs,
            s.group / s.secs,
            s.notifies / s.secs,
            s.wal / s.secs / 1e3,
            s.host_cpu * 1e3 / (s.secs * n as f64),
            match s.db_cpu_us.is_finite() {
                true => format!("{:.2} ms", s.db_cpu_us / 1e3 / (s.secs * n as f64)),
                false => "n/a".to_string(),
            }
        ),
        None => println!("live: steady: never had every turn streaming at once (the turns are too short for N)"),
    }
    println!("live: token to client, {} tokens: {}", delays.len(), percentiles(&mut delays));
    println!(
        "live: tokens lost {lost}, repeated {repeated}; frames out of order {disorder}; turns not completed {failed}"
    );
    Ok(())
}
