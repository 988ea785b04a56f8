//! Proof under faults: three host processes on one database run hundreds of
//! runs over dozens of conversations while the test SIGKILLs one, SIGSTOPs
//! another past its lease, restarts PostgreSQL, terminates the LISTEN
//! connections, and drops SSE clients on purpose. Then an invariant checker
//! reads the database, the executions a receiver outside the hosts counted,
//! and every client's received stream.
//!
//! This binary has a private cluster of its own (the restart must not pull
//! the database from under other tests).

mod support;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_host::db::{plugins, tokens, ConversationId, RunId};
use axum::routing::post;
use axum::{Json, Router};
use futures::StreamExt;
use nix::sys::signal::Signal;
use serde_json::{json, Value};
use sqlx::PgPool;
use support::process::{HostProcess, FAST};
use support::*;

const CONVERSATIONS: usize = 30;
const TURNS: usize = 8;

/// A timestamp as the database wrote it.
type Stamp = chrono::DateTime<chrono::Utc>;

/// Counts each run's execution starts (the `record` webhook tool).
type Starts = Arc<Mutex<HashMap<String, u32>>>;

async fn recorder(starts: Starts) -> String {
    let record = move |Json(body): Json<Value>| async move {
        let run = body["args"]["run_id"].as_str().unwrap_or("?").to_string();
        *starts.lock().unwrap().entry(run).or_default() += 1;
        Json(json!({ "recorded": true }))
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, Router::new().route("/record", post(record))).await.unwrap() });
    base
}

/// Hosts that clients may talk to (a stopped or killed one is taken out).
type Live = Arc<Mutex<Vec<String>>>;

/// Follows one run's stream to its `complete`, across hosts and drops: picks
/// a live host, rejoins with Last-Event-ID, and hangs up on purpose every few
/// frames. Returns every event received as (seq, type, payload) and the drops.
async fn follow(live: Live, token: String, run: RunId, salt: usize) -> (Vec<(i32, String, Value)>, usize) {
    let http = reqwest::Client::new();
    let (mut got, mut last, mut drops, mut attempt) = (Vec::new(), 0, 0, salt);
    let deadline = Instant::now() + 2 * LONG;
    loop {
        assert!(Instant::now() < deadline, "client of {run} never saw the end (last seq {last})");
        attempt += 1;
        let host = {
            let hosts = live.lock().unwrap();
            hosts[attempt % hosts.len()].clone()
        };
        let res = http
            .get(format!("http://{host}/v1/runs/{run}/events"))
            .bearer_auth(&token)
            .header("Accept", "text/event-stream")
            .header("Last-Event-ID", last.to_string())
            .timeout(Duration::from_secs(20))
            .send()
            .await;
        let Ok(res) = res.and_then(|r| r.error_for_status()) else {
            // A backoff, not synchronisation: that host is down (or the
            // database is restarting); the next attempt picks another.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let hang_up_after = 1 + (attempt * 7 + salt) % 5;
        let (mut body, mut decoder, mut out, mut frames) =
            (res.bytes_stream(), agent_host::stream::decode::SseDecoder::default(), Vec::new(), 0);
        'stream: while let Some(Ok(chunk)) = body.next().await {
            decoder.feed(&chunk, &mut out).unwrap();
            for data in out.drain(..) {
                let mut event: Value = serde_json::from_str(&data).unwrap();
                let map = event.as_object_mut().unwrap();
                let seq = map.remove("seq").unwrap().as_i64().unwrap() as i32;
                let kind = map.remove("type").unwrap().as_str().unwrap().to_string();
                assert_eq!(seq, last + 1, "client of {run}: a gap or a repeat after seq {last}");
                last = seq;
                let done = kind == "complete";
                got.push((seq, kind, event));
                if done {
                    return (got, drops);
                }
                frames += 1;
                if frames == hang_up_after {
                    drops += 1;
                    break 'stream;
                }
            }
        }
    }
}

/// A count the test can read while PostgreSQL restarts (errors read as 0).
async fn terminal_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE status IN ('completed', 'failed', 'cancelled')")
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

async fn wait_all_terminal(pool: &PgPool, n: i64) {
    wait_for(&format!("{n} runs to end"), 2 * LONG, || async move { terminal_count(pool).await >= n }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_system_keeps_its_promises_while_processes_die_pause_and_disconnect() {
    suite(false).await
}

/// The same faults with a resumable plugin: every run completes (none
/// fails), its call is sent again only when it was in flight at a fault
/// (then with the same key), and every stream equals its journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumable_runs_all_complete_while_processes_die_pause_and_disconnect() {
    suite(true).await
}

/// One suite at a time: each runs three hosts and restarts the cluster.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn suite(resumable: bool) {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = TestDb::new().await;
    let pool = &db.pool;
    install_audit(pool).await;
    let starts = Starts::default();
    let record_url = recorder(starts.clone()).await;
    let dir = std::env::temp_dir().join(format!("agent-host-faults-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let tools = dir.join("tools.toml");
    // A resumable run re-sends a call in flight at a fault (same key): the
    // receiver must say it can take that.
    std::fs::write(
        &tools,
        format!("[[webhook]]\nname = \"record\"\nurl = \"{record_url}/record\"\nidempotent = {resumable}\n"),
    )
    .unwrap();
    let manifest = match resumable {
        true => json!({ "tools": ["record"], "durability": "resume" }),
        false => json!({ "tools": ["record"] }),
    };
    plugins::put(pool, "work", &plugin_wasm("fixtures"), &manifest).await.unwrap();
    let token = tokens::create(pool, "alice", "acme", false).await.unwrap();

    let cache = dir.join("cache");
    let mut args: Vec<&str> = FAST.to_vec();
    args.extend(["--max-runs", "4", "--tools-file", tools.to_str().unwrap(), "--cache-dir", cache.to_str().unwrap()]);
    // A run may meet several of the faults below (each one an attempt).
    args.extend(["--resume-attempts", "5"]);
    let mut hosts: Vec<HostProcess> = ["A", "B", "C"].iter().map(|id| HostProcess::spawn(&db.url, id, &args)).collect();
    let live: Live = Arc::new(Mutex::new(hosts.iter().map(|h| h.addr.clone()).collect()));

    // Dozens of conversations, several turns each, posted round-robin.
    let http = reqwest::Client::new();
    let post = |host: &str, path: String, body: Value| {
        http.post(format!("http://{host}{path}")).bearer_auth(&token).json(&body).send()
    };
    let config = json!({ "mode": "work", "steps": 10, "step_ms": 40 });
    let mut runs: Vec<(ConversationId, RunId)> = Vec::new();
    for c in 0..CONVERSATIONS {
        let host = hosts[c % 3].addr.clone();
        let conv: Value = post(&host, "/v1/conversations".into(), json!({})).await.unwrap().json().await.unwrap();
        let conv: ConversationId = conv["id"].as_str().unwrap().parse().unwrap();
        for t in 0..TURNS {
            let body = json!({ "content": format!("turn {t}"), "plugin": "work", "config": config });
            let res = post(&host, format!("/v1/conversations/{conv}/runs"), body).await.unwrap();
            assert_eq!(res.status(), 202);
            let v: Value = res.json().await.unwrap();
            runs.push((conv, v["run_id"].as_str().unwrap().parse().unwrap()));
        }
    }
    let total = runs.len() as i64;
    // Clients on a third of the runs, dropping and rejoining throughout.
    let clients: Vec<_> = runs
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 3 == 0)
        .map(|(i, (_, run))| (*run, tokio::spawn(follow(live.clone(), token.clone(), *run, i))))
        .collect();

    // SIGKILL one host mid-run; a replacement joins.
    wait_all_terminal(pool, 20).await;
    let killed = hosts.remove(0);
    live.lock().unwrap().retain(|a| a != &killed.addr);
    killed.signal(Signal::SIGKILL);
    drop(killed);
    let replacement = HostProcess::spawn(&db.url, "A2", &args);
    live.lock().unwrap().push(replacement.addr.clone());
    hosts.push(replacement);

    // SIGSTOP another past its lease: its runs are reaped; then it resumes
    // and must change nothing (the fence).
    wait_all_terminal(pool, 50).await;
    let paused = &hosts[0];
    assert_eq!(paused.worker_id, "B");
    live.lock().unwrap().retain(|a| a != &paused.addr);
    paused.signal(Signal::SIGSTOP);
    wait_for("the paused host's runs to be reaped", 2 * LONG, || async move {
        let held: i64 =
            sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE worker_id = 'B' AND status = 'running'")
                .fetch_one(pool)
                .await
                .unwrap_or(1);
        held == 0
    })
    .await;
    paused.signal(Signal::SIGCONT);
    live.lock().unwrap().push(paused.addr.clone());

    // Restart PostgreSQL under everyone.
    wait_all_terminal(pool, 90).await;
    let restarted = restart_postgres();
    eprintln!("PostgreSQL restarted: {restarted}");

    // Cut every LISTEN connection: the hubs reconnect (and re-read).
    wait_all_terminal(pool, 130).await;
    let cut: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = $1",
    )
    .bind(agent_host::hub::APPLICATION_NAME)
    .fetch_all(pool)
    .await
    .unwrap();
    eprintln!("LISTEN connections terminated: {}", cut.len());
    assert!(!cut.is_empty(), "the hubs' LISTEN connections were found and cut");

    wait_all_terminal(pool, total).await;
    let mut streams = HashMap::new();
    let mut drops = 0;
    for (run, client) in clients {
        let (got, d) = client.await.unwrap();
        drops += d;
        streams.insert(run, got);
    }

    // ---- the invariant checker ----
    let by_status: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM agent_run GROUP BY status ORDER BY status")
            .fetch_all(pool)
            .await
            .unwrap();
    eprintln!("runs by status: {by_status:?}; clients hung up {drops} times on purpose");
    // Every run is terminal.
    assert!(by_status.iter().all(|(s, _)| ["completed", "failed", "cancelled"].contains(&s.as_str())), "{by_status:?}");
    let completed = by_status.iter().find(|(s, _)| s == "completed").map_or(0, |(_, n)| *n);
    assert!(completed > total / 2, "most runs complete despite the faults ({completed} of {total})");
    if resumable {
        let errors: Vec<(RunId, i32, Option<String>)> =
            sqlx::query_as("SELECT id, attempt, error FROM agent_run WHERE status <> 'completed'")
                .fetch_all(pool)
                .await
                .unwrap();
        assert_eq!(completed, total, "every resumable run completes despite the faults: {by_status:?} {errors:?}");
    }

    // At most one complete per run, seq from 1 without gaps, nothing after it.
    for (_, run) in &runs {
        let j = assert_journal_sound(pool, *run).await;
        assert_eq!(j.last().map(|(_, t)| t.as_str()), Some("complete"), "run {run} has its ending");
    }

    // No guest execution happened twice for one run. A resumable run's call
    // is answered from its log on resume; it reaches the receiver twice only
    // when it was in flight at a fault, on a run that was resumed.
    let starts = starts.lock().unwrap().clone();
    let resumed: HashSet<String> = sqlx::query_scalar("SELECT id::text FROM agent_run WHERE attempt > 1")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    eprintln!("runs resumed: {}", resumed.len());
    for (run, n) in &starts {
        match resumable && resumed.contains(run) {
            true => assert!(*n <= 2, "resumed run {run} sent its call {n} times"),
            false => assert_eq!(*n, 1, "run {run} was executed {n} times"),
        }
    }
    if !resumable {
        assert!(resumed.is_empty(), "at-most-once runs are never resumed: {resumed:?}");
    }
    let started: HashSet<RunId> = sqlx::query_scalar("SELECT id FROM agent_run WHERE started_at IS NOT NULL")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    for run in starts.keys() {
        assert!(started.contains(&run.parse::<RunId>().unwrap()), "an execution of a run never claimed: {run}");
    }

    // Never two runs of one conversation running at once.
    let audit: Vec<(Option<RunId>, ConversationId, String, String)> =
        sqlx::query_as("SELECT run_id, conversation_id, old, new FROM run_audit ORDER BY n")
            .fetch_all(pool)
            .await
            .unwrap();
    let mut running: HashMap<ConversationId, RunId> = HashMap::new();
    for (run, conv, old, new) in &audit {
        let run = run.unwrap();
        if old == "running" {
            assert_eq!(running.remove(conv), Some(run), "audit out of order for {run}");
        }
        if new == "running" {
            if let Some(other) = running.insert(*conv, run) {
                panic!("conversation {conv}: {run} started while {other} was running");
            }
        }
    }
    assert!(running.is_empty());

    // Every client's received stream equals the journal: no gap, no duplicate.
    for (run, got) in &streams {
        let journal = journal_payloads(pool, *run).await;
        assert_eq!(got, &journal, "client of {run} saw something other than the journal");
    }

    // The turns of each conversation ran and finished in their order, and
    // every completed run has its assistant message with the streamed text.
    for c in runs.chunks(TURNS) {
        let conv = c[0].0;
        let rows: Vec<(RunId, String, Option<Stamp>, Option<Stamp>)> = sqlx::query_as(
            "SELECT id, status, started_at, finished_at FROM agent_run
                 WHERE conversation_id = $1 ORDER BY queue_pos",
        )
        .bind(conv)
        .fetch_all(pool)
        .await
        .unwrap();
        assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), c.iter().map(|(_, r)| *r).collect::<Vec<_>>());
        let finished: Vec<_> = rows.iter().map(|r| r.3.unwrap()).collect();
        assert!(finished.windows(2).all(|w| w[0] <= w[1]), "conversation {conv} finished out of order: {rows:?}");
        let begun: Vec<_> = rows.iter().filter_map(|r| r.2).collect();
        assert!(begun.windows(2).all(|w| w[0] <= w[1]), "conversation {conv} started out of order: {rows:?}");
        for (run, status, _, _) in &rows {
            if status != "completed" {
                continue;
            }
            let answer: Option<(String, String)> =
                sqlx::query_as("SELECT content, status FROM message WHERE run_id = $1 AND role = 'assistant'")
                    .bind(run)
                    .fetch_optional(pool)
                    .await
                    .unwrap();
            let streamed = deltas_text(&journal_payloads(pool, *run).await);
            assert_eq!(answer, Some((streamed, "complete".to_string())), "run {run}'s answer");
        }
    }
    assert_no_orphans(pool).await;
    drop(hosts);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A claim commits without waiting for its WAL flush; the run's first
/// durable write makes it durable, and every effect outside the database
/// waits for one (a tool call's `tool_call_started` is acknowledged after
/// its commit). So a crash of PostgreSQL (an immediate stop: nothing flushed
/// that was not already) while a tool call is under way cannot forget the
/// claim and run the call again: the run is not back in the queue after
/// crash recovery, and the tool ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_of_the_database_during_a_tool_call_never_forgets_the_claim() {
    use agent_host::agent::{Agent, AgentError, AgentRegistry, HostError, RunHost, RunInput};
    use agent_host::run::manifest::Manifest;
    use agent_host::tools::{EventSink, Tool, ToolCall, ToolRegistry};
    use async_trait::async_trait;

    /// The effect outside the database: counts its calls, and crashes the
    /// database under the run while the call is under way.
    struct Crash(Arc<std::sync::atomic::AtomicU32>, Arc<tokio::sync::Notify>);
    #[async_trait]
    impl Tool for Crash {
        async fn call(&self, _call: &ToolCall<'_>, _sink: &dyn EventSink) -> Result<Value, HostError> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let crashed = tokio::task::spawn_blocking(crash_postgres).await.unwrap();
            eprintln!("PostgreSQL crashed and recovered: {crashed}");
            self.1.notify_one();
            Ok(json!({}))
        }
        fn timeout(&self) -> Duration {
            Duration::from_secs(120)
        }
    }
    /// Calls the tool once, at once.
    struct CallsOnce;
    #[async_trait]
    impl Agent for CallsOnce {
        async fn run(&self, host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
            host.call_tool("crash", "{}").await?;
            Ok("done".into())
        }
    }

    let _one = ONE_AT_A_TIME.lock().await;
    let mut db = TestDb::new().await;
    // The test cluster trades durability for speed (synchronous_commit off);
    // this database keeps the default, as a production server does. (fsync
    // stays off: an immediate stop loses what PostgreSQL had not written,
    // not what the operating system holds.)
    let name: String = sqlx::query_scalar("SELECT current_database()").fetch_one(&db.pool).await.unwrap();
    sqlx::query(&format!("ALTER DATABASE {name} SET synchronous_commit = on")).execute(&db.pool).await.unwrap();
    db.pool = db.pool(20).await;
    let durable: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&db.pool).await.unwrap();
    assert_eq!(durable, "on");
    let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let mut tools = ToolRegistry::default();
    let recovered = Arc::new(tokio::sync::Notify::new());
    tools.insert("crash", Arc::new(Crash(calls.clone(), recovered.clone())));
    let mut agents = AgentRegistry::default().with_tools(tools);
    let granted = Manifest::parse(&json!({ "tools": ["crash"] })).unwrap();
    agents.insert_with_manifest("calls-once", Arc::new(CallsOnce), granted);
    let w = start_worker_with(&db, agents, fast_config("crash")).await;
    let run = enqueue(&db.pool, None, "calls-once", json!({})).await.run_id;
    // No reads while the database is down: the crash is the tool's.
    tokio::time::timeout(Duration::from_secs(120), recovered.notified()).await.expect("the tool crashed the database");
    let status = wait_terminal(&db.pool, run, Duration::from_secs(120)).await;
    w.drain().await;
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1, "the tool ran again after the crash");
    let (attempt, started): (i32, bool) =
        sqlx::query_as("SELECT attempt, started_at IS NOT NULL FROM agent_run WHERE id = $1")
            .bind(run)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((attempt, started), (1, true), "the claim was forgotten ({status})");
    let journal = journal(&db.pool, run).await;
    assert_eq!(journal.iter().filter(|(_, k)| k == "run_started").count(), 1, "{journal:?}");
    assert!(journal.iter().any(|(_, k)| k == "tool_call_started"), "{journal:?}");
}

/// The finisher and the waker each keep a connection of their own
/// (`db::OwnConnection`), outside the pool. A database restart between two
/// runs leaves both dead: the next run's ending must still be written (the
/// idle connection is pinged, found dead and made anew), so the run ends
/// completed, not failed for want of a connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_between_runs_fails_no_ending() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = TestDb::new().await;
    let w = start_worker(&db, fast_config("restart")).await;
    let before = enqueue(&db.pool, None, "noop", json!({})).await.run_id;
    assert_eq!(wait_terminal(&db.pool, before, LONG).await, "completed");
    if !restart_postgres() {
        eprintln!("DATABASE_URL's server is not ours to restart; nothing to show");
        w.drain().await;
        return;
    }
    let mut after = Vec::new();
    for _ in 0..3 {
        after.push(enqueue(&db.pool, None, "noop", json!({})).await.run_id);
    }
    for run in after {
        let status = wait_terminal(&db.pool, run, LONG).await;
        assert_eq!(status, "completed", "{}", run_error(&db.pool, run).await);
    }
    w.drain().await;
}
