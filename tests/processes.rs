//! Process failures with real processes: SIGKILL, SIGSTOP, SIGTERM, and a
//! restart after every process died.

mod support;

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::json;
use support::process::{HostProcess, FAST};
use support::*;

const FOREVER: &str = r#"{"steps": 100000, "step_ms": 50}"#;

async fn worker_of(db: &TestDb, id: agent_host::db::RunId) -> Option<String> {
    sqlx::query_scalar("SELECT worker_id FROM agent_run WHERE id = $1").bind(id).fetch_one(&db.pool).await.unwrap()
}

async fn completes(db: &TestDb, id: agent_host::db::RunId) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM run_event WHERE run_id = $1 AND type = 'complete'")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_run_ends_it_failed_and_the_next_turn_runs() {
    let db = TestDb::new().await;
    let a = HostProcess::spawn(&db.url, "A", FAST);
    let t1 = enqueue(&db.pool, None, "sleep", serde_json::from_str(FOREVER).unwrap()).await;
    let t2 = enqueue(&db.pool, Some(t1.conversation_id), "echo", json!({})).await;
    wait_status(&db.pool, t1.run_id, "running", LONG).await;
    assert_eq!(worker_of(&db, t1.run_id).await.as_deref(), Some("A"));
    let b = HostProcess::spawn(&db.url, "B", FAST);

    a.signal(Signal::SIGKILL);
    let killed = Instant::now();
    // lease 1 s + grace 0.3 s + reap interval 0.1 s, plus room for a busy machine.
    wait_status(&db.pool, t1.run_id, "failed", Duration::from_secs(15)).await;
    let took = killed.elapsed();
    eprintln!("SIGKILL to failed: {took:?}");
    assert!(took >= Duration::from_millis(300), "reaped before the lease could lapse: {took:?}");
    assert_eq!(completes(&db, t1.run_id).await, 1);
    assert_journal_sound(&db.pool, t1.run_id).await;

    // The wake chain: the conversation's next turn runs on B.
    wait_status(&db.pool, t2.run_id, "completed", LONG).await;
    assert_eq!(worker_of(&db, t2.run_id).await.as_deref(), Some("B"));
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_worker_is_reaped_and_its_writes_after_resuming_change_nothing() {
    let db = TestDb::new().await;
    let a = HostProcess::spawn(&db.url, "A", FAST);
    let run = enqueue(&db.pool, None, "sleep", json!({ "steps": 100000, "step_ms": 20 })).await;
    wait_status(&db.pool, run.run_id, "running", LONG).await;
    // Let it narrate a little, so it has writes in flight when paused.
    let pool = db.pool.clone();
    wait_for("a few deltas", LONG, || {
        let pool = pool.clone();
        async move { journal(&pool, run.run_id).await.len() >= 6 }
    })
    .await;

    a.signal(Signal::SIGSTOP);
    let b = HostProcess::spawn(&db.url, "B", FAST);
    wait_status(&db.pool, run.run_id, "failed", Duration::from_secs(15)).await;
    let ended = journal(&db.pool, run.run_id).await;

    a.signal(Signal::SIGCONT);
    // A learns from its fence (a refused append or its heartbeat) and stands down.
    a.wait_log("standing down", LONG).await;
    assert_eq!(journal(&db.pool, run.run_id).await, ended, "a zombie's write changed the journal");
    assert_eq!(status(&db.pool, run.run_id).await, "failed");
    assert_eq!(completes(&db, run.run_id).await, 1);
    assert_journal_sound(&db.pool, run.run_id).await;

    // A is healthy again and takes new work.
    let next = enqueue(&db.pool, None, "echo", json!({})).await;
    wait_status(&db.pool, next.run_id, "completed", LONG).await;
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_runs_within_the_budget() {
    let db = TestDb::new().await;
    let mut args = FAST.to_vec();
    args.extend(["--drain-timeout-ms", "2000"]);
    let mut a = HostProcess::spawn(&db.url, "A", &args);
    let short = enqueue(&db.pool, None, "sleep", json!({ "steps": 8, "step_ms": 100 })).await;
    let long = enqueue(&db.pool, None, "sleep", serde_json::from_str(FOREVER).unwrap()).await;
    wait_status(&db.pool, short.run_id, "running", LONG).await;
    wait_status(&db.pool, long.run_id, "running", LONG).await;

    let started = Instant::now();
    a.signal(Signal::SIGTERM);
    let exit = a.wait_exit(LONG).await;
    let took = started.elapsed();
    assert!(exit.success(), "exit {exit:?}; log:\n{}", a.log());
    assert!(took < Duration::from_secs(10), "drain took {took:?}");
    assert_eq!(status(&db.pool, short.run_id).await, "completed");
    assert_eq!(status(&db.pool, long.run_id).await, "failed");
    let error = run_error(&db.pool, long.run_id).await;
    assert!(error.contains("drain timeout"), "{error}");
    let running: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE status = 'running'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(running, 0);
    // Phase 1 stopped claiming before the drain: nothing new was taken.
    assert_journal_sound(&db.pool, long.run_id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_after_every_process_died_leaves_no_run_running() {
    let db = TestDb::new().await;
    let a = HostProcess::spawn(&db.url, "A", FAST);
    let b = HostProcess::spawn(&db.url, "B", FAST);
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(enqueue(&db.pool, None, "sleep", serde_json::from_str(FOREVER).unwrap()).await.run_id);
    }
    for id in &ids {
        wait_status(&db.pool, *id, "running", LONG).await;
    }
    a.signal(Signal::SIGKILL);
    b.signal(Signal::SIGKILL);
    drop((a, b));
    // Every lease lapses past the grace with no process left to notice.
    let pool = db.pool.clone();
    wait_for("all leases to lapse past the grace", LONG, || {
        let pool = pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM agent_run WHERE status = 'running' AND claim_expires_at < now() - interval '300 ms'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            n == 4
        }
    })
    .await;

    // The reborn process's loop would not sweep for an hour: only the boot
    // reconciler can end the orphans before it reports ready.
    let mut args = FAST.to_vec();
    args.extend(["--reap-interval-ms", "3600000", "--no-dispatch"]);
    let c = HostProcess::spawn(&db.url, "C", &args);
    for id in &ids {
        assert_eq!(status(&db.pool, *id).await, "failed");
        assert_eq!(completes(&db, *id).await, 1);
    }
    drop(c);
}

/// Without DATABASE_URL the host runs its own cluster: created on first use,
/// reused on the next start, stopped when the host exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_cluster_starts_is_reused_and_stops_with_the_host() {
    let dir = std::env::temp_dir().join(format!("agent-host-private-{}", uuid::Uuid::new_v4().simple()));
    let bin = env!("CARGO_BIN_EXE_agent-host");
    let run = |args: &[&str]| {
        std::process::Command::new(bin)
            .arg("--data-dir")
            .arg(&dir)
            .args(args)
            .env_remove("DATABASE_URL")
            .output()
            .unwrap()
    };
    let first = run(&["migrate"]);
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    assert!(String::from_utf8_lossy(&first.stdout).contains("migrations applied"));
    assert!(dir.join("pg/PG_VERSION").exists());
    // Stopped on exit: no postmaster left behind.
    assert!(!dir.join("pg/postmaster.pid").exists(), "the cluster outlived the host");

    // Reused: the same cluster (and its data) on the next start.
    let token = run(&["tokens", "create", "--user", "u", "--tenant", "t"]);
    assert!(token.status.success(), "{}", String::from_utf8_lossy(&token.stderr));
    assert!(String::from_utf8_lossy(&token.stdout).starts_with("ah_"));
    assert!(!dir.join("pg/postmaster.pid").exists());

    // A served host stops its cluster when it drains on SIGTERM.
    let mut host = std::process::Command::new(bin)
        .arg("--data-dir")
        .arg(&dir)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env_remove("DATABASE_URL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(host.stdout.take().unwrap()), &mut line).unwrap();
    assert!(line.starts_with("agent-host listening on"), "{line}");
    assert!(dir.join("pg/postmaster.pid").exists());
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(host.id() as i32), Signal::SIGTERM).unwrap();
    let status = host.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!dir.join("pg/postmaster.pid").exists(), "the cluster outlived the host");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_postgres_binaries_name_the_package_to_install() {
    let dir = std::env::temp_dir().join(format!("agent-host-nobin-{}", uuid::Uuid::new_v4().simple()));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .arg("--data-dir")
        .arg(&dir)
        .arg("migrate")
        .env_remove("DATABASE_URL")
        .env("AGENT_HOST_PG_BIN", "/nonexistent")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("apt-get install postgresql"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Any process serves any tail: a run executed by A, streamed from B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tail_served_by_one_process_for_a_run_executed_by_another() {
    let db = TestDb::new().await;
    let a = HostProcess::spawn(&db.url, "A", FAST);
    let mut args = FAST.to_vec();
    args.push("--no-dispatch");
    let b = HostProcess::spawn(&db.url, "B", &args);
    let token = agent_host::db::tokens::create(&db.pool, "alice", "acme", false).await.unwrap();
    let run = enqueue(&db.pool, None, "sleep", json!({ "steps": 15, "step_ms": 30 })).await;
    let url = format!("http://{}/v1/runs/{}/events", b.addr, run.run_id);
    let mut client = support::sse::SseClient::connect(&url, &token, None).await;
    let frames = client.collect(LONG).await;
    assert_eq!(worker_of(&db, run.run_id).await.as_deref(), Some("A"));
    let seqs: Vec<i32> = frames.iter().map(|f| f.data["seq"].as_i64().unwrap() as i32).collect();
    let j: Vec<i32> = journal(&db.pool, run.run_id).await.into_iter().map(|(s, _)| s).collect();
    assert_eq!(seqs, j, "the stream from B equals the journal A wrote");
    assert_eq!(frames.last().unwrap().event, "complete");
    drop((a, b));
}

/// A stop posted to one process reaches the run another process executes:
/// the flag and the NOTIFY cross processes through PostgreSQL. A's heartbeat
/// is 10 s, so only the NOTIFY explains an ending this soon.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_posted_to_one_process_stops_a_run_executing_in_another() {
    let db = TestDb::new().await;
    let a = HostProcess::spawn(&db.url, "A", &["--lease-ms", "30000", "--heartbeat-ms", "10000"]);
    let b = HostProcess::spawn(&db.url, "B", &["--no-dispatch"]);
    let token = agent_host::db::tokens::create(&db.pool, "alice", "acme", false).await.unwrap();
    let run = enqueue(&db.pool, None, "sleep", serde_json::from_str(FOREVER).unwrap()).await;
    let pool = db.pool.clone();
    wait_for("the run to stream", LONG, || {
        let pool = pool.clone();
        async move { journal(&pool, run.run_id).await.iter().any(|(_, t)| t == "content_delta") }
    })
    .await;
    let res = reqwest::Client::new()
        .post(format!("http://{}/v1/runs/{}/cancel", b.addr, run.run_id))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), reqwest::StatusCode::ACCEPTED);
    let asked = Instant::now();
    wait_status(&db.pool, run.run_id, "cancelled", Duration::from_secs(5)).await;
    eprintln!("cancel via B to cancelled on A: {:?}", asked.elapsed());
    assert_eq!(worker_of(&db, run.run_id).await.as_deref(), Some("A"));
    assert_eq!(completes(&db, run.run_id).await, 1);
    assert_journal_sound(&db.pool, run.run_id).await;
    drop((a, b));
}

/// `plugins add` validates against the world before it stores anything;
/// `plugins list` shows what names point at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_cli_validates_stores_and_lists() {
    let db = TestDb::new().await;
    let dir = std::env::temp_dir().join(format!("agent-host-cli-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let echo = dir.join("echo.wasm");
    std::fs::write(&echo, plugin_wasm("echo")).unwrap();
    let junk = dir.join("junk.wasm");
    std::fs::write(&junk, b"not a component").unwrap();
    let manifest = dir.join("manifest.json");
    std::fs::write(&manifest, r#"{"tools": [], "limits": {"cpu_ms": 1000}}"#).unwrap();
    let cli = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
            .args(["--database-url", &db.url, "--cache-dir"])
            .arg(dir.join("cache"))
            .args(["plugins"])
            .args(args)
            .output()
            .unwrap()
    };
    let out = cli(&["add", "bad", junk.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not a component"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cli(&["add", "echo", echo.to_str().unwrap(), "--manifest", manifest.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let added = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(added.starts_with("echo -> sha256:"), "{added}");
    let out = cli(&["list"]);
    let listed = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(listed.contains("echo\tsha256:") && listed.contains("\"cpu_ms\":1000"), "{listed}");
    assert!(!listed.contains("bad"));
    let out = cli(&["add", "Bad Name", echo.to_str().unwrap()]);
    assert!(!out.status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The CLI a person uses, over the HTTP API of a real host: `runs create`
/// prints the stream as it arrives, `runs tail` replays it from a cursor,
/// `runs cancel` and `conversations stop` stop runs, and exit codes tell.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runs_cli_streams_tails_cancels_and_stops_over_http() {
    let db = TestDb::new().await;
    let host = HostProcess::spawn(&db.url, "A", FAST);
    let token = agent_host::db::tokens::create(&db.pool, "alice", "acme", false).await.unwrap();
    let url = format!("http://{}", host.addr);
    let cli = |args: &[&str]| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
            .env("AGENT_HOST_URL", &url)
            .env("AGENT_HOST_TOKEN", &token)
            .args(args)
            .kill_on_drop(true)
            .output()
    };
    let text = |b: &[u8]| String::from_utf8_lossy(b).to_string();

    let out = cli(&["runs", "create", "--plugin", "echo", "hello there, world"]).await.unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hello there, world");
    let stderr = text(&out.stderr);
    assert!(stderr.contains("[completed]"), "{stderr}");
    let id = stderr.split_whitespace().nth(1).unwrap().to_string();

    // Replaying from a cursor prints only what came after it.
    let out = cli(&["runs", "tail", &id]).await.unwrap();
    assert_eq!(text(&out.stdout), "hello there, world");
    let run: agent_host::db::RunId = id.parse().unwrap();
    let j = journal_payloads(&db.pool, run).await;
    let (first_seq, _, first) = j.iter().find(|(_, t, _)| t == "content_delta").unwrap();
    let rest = "hello there, world".strip_prefix(first["delta"].as_str().unwrap()).unwrap();
    let out = cli(&["runs", "tail", &id, "--from", &first_seq.to_string()]).await.unwrap();
    assert!(out.status.success());
    assert_eq!(text(&out.stdout), rest);

    // A long run, cancelled from a second CLI while the first streams it.
    let streaming = cli(&["runs", "create", "--plugin", "sleep", "--config", FOREVER, "count"]);
    let watcher = tokio::spawn(streaming);
    let pool = db.pool.clone();
    wait_for("the CLI's run to stream", LONG, || {
        let pool = pool.clone();
        async move {
            let id: Option<agent_host::db::RunId> = sqlx::query_scalar(
                "SELECT r.id FROM agent_run r JOIN run_event e ON e.run_id = r.id
                 WHERE r.plugin = 'sleep' AND e.type = 'content_delta' LIMIT 1",
            )
            .fetch_optional(&pool)
            .await
            .unwrap();
            id.is_some()
        }
    })
    .await;
    let id: agent_host::db::RunId =
        sqlx::query_scalar("SELECT id FROM agent_run WHERE plugin = 'sleep'").fetch_one(&db.pool).await.unwrap();
    let out = cli(&["runs", "cancel", &id.to_string()]).await.unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("\"cancel_requested\":true"), "{}", text(&out.stdout));
    let watched = watcher.await.unwrap().unwrap();
    assert_eq!(watched.status.code(), Some(1), "a cancelled run is not a success");
    assert!(text(&watched.stderr).contains("[cancelled]"), "{}", text(&watched.stderr));
    assert!(text(&watched.stdout).starts_with("step 0. "), "{}", text(&watched.stdout));

    // Stop a conversation; refusals are explained, not panicked.
    let conversation: agent_host::db::ConversationId =
        sqlx::query_scalar("SELECT conversation_id FROM agent_run WHERE id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let out = cli(&["conversations", "stop", &conversation.to_string()]).await.unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("\"drafts\":[]"), "{}", text(&out.stdout));
    let out = cli(&["runs", "tail", "not-a-run"]).await.unwrap();
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("400"), "{}", text(&out.stderr));
    let out = cli(&["runs", "create", "--plugin", "nope", "hi"]).await.unwrap();
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("422"), "{}", text(&out.stderr));
    drop(host);
}
