//! Process failures with real processes: SIGKILL, SIGSTOP, SIGTERM, and a
//! restart after every process died.

use std::time::{Duration, Instant};

use crate::support::process::{HostProcess, FAST};
use crate::support::*;
use nix::sys::signal::Signal;
use serde_json::json;

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
            .args(args)
            .arg("--data-dir")
            .arg(&dir)
            .env_remove("DATABASE_URL")
            .output()
            .unwrap()
    };
    // A one-shot command makes no cluster: it refuses, naming where it looked.
    let first = run(&["migrate"]);
    assert!(!first.status.success());
    let said = String::from_utf8_lossy(&first.stderr).to_string();
    assert!(said.contains(&format!("no agent-host database in {}", dir.display())), "{said}");
    assert!(!dir.join("pg").exists(), "a one-shot command made a cluster");

    // `serve` makes it, and stops it when it drains on SIGTERM.
    let mut host = std::process::Command::new(bin)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(&dir)
        .env_remove("DATABASE_URL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(host.stdout.take().unwrap()), &mut line).unwrap();
    assert!(line.starts_with("agent-host listening on"), "{line}");
    assert!(dir.join("pg/PG_VERSION").exists());
    assert!(dir.join("pg/postmaster.pid").exists());
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(host.id() as i32), Signal::SIGTERM).unwrap();
    let status = host.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!dir.join("pg/postmaster.pid").exists(), "the cluster outlived the host");

    // Reused by the next commands, each saying which database it used, and
    // stopped again when each exits.
    let migrated = run(&["migrate"]);
    assert!(migrated.status.success(), "{}", String::from_utf8_lossy(&migrated.stderr));
    assert!(String::from_utf8_lossy(&migrated.stdout).contains("migrations applied"));
    let said = String::from_utf8_lossy(&migrated.stderr).to_string();
    assert!(said.contains(&format!("database: the private cluster in {}", dir.display())), "{said}");
    assert!(!dir.join("pg/postmaster.pid").exists(), "the cluster outlived the command");
    let token = run(&["tokens", "create", "--user", "u", "--tenant", "t"]);
    assert!(token.status.success(), "{}", String::from_utf8_lossy(&token.stderr));
    assert!(String::from_utf8_lossy(&token.stdout).starts_with("ah_"));
    assert!(!dir.join("pg/postmaster.pid").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_postgres_binaries_name_the_package_to_install() {
    let dir = std::env::temp_dir().join(format!("agent-host-nobin-{}", uuid::Uuid::new_v4().simple()));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(&dir)
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
    let mut client = crate::support::sse::SseClient::connect(&url, &token, None).await;
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
            .args(["plugins"])
            .args(args)
            .args(["--database-url", &db.url, "--cache-dir"])
            .arg(dir.join("cache"))
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

    // Read back: one run, the caller's runs and conversations, as lines and as JSON.
    let out = cli(&["runs", "get", &id]).await.unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("status\tcompleted"), "{}", text(&out.stdout));
    let out = cli(&["runs", "get", &id, "--json"]).await.unwrap();
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((got["id"].as_str(), got["status"].as_str()), (Some(id.as_str()), Some("completed")));
    let out = cli(&["runs", "list", "--status", "completed", "--json"]).await.unwrap();
    let listed: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(listed.len(), 1, "{}", text(&out.stdout));
    assert_eq!(listed[0]["id"].as_str(), Some(id.as_str()));
    let out = cli(&["runs", "list", "--status", "nope"]).await.unwrap();
    assert!(!out.status.success() && text(&out.stderr).contains("400"), "{}", text(&out.stderr));
    let out = cli(&["conversations", "list"]).await.unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains(&id), "the conversation's latest run: {}", text(&out.stdout));

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
    // The cancelled run's turn again: a new run, queued.
    let out = cli(&["runs", "retry", &id.to_string()]).await.unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let retried: agent_host::db::RunId = text(&out.stdout).trim().parse().unwrap();
    assert_ne!(retried, id);
    let out = cli(&["runs", "cancel", &retried.to_string()]).await.unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = cli(&["runs", "tail", "not-a-run"]).await.unwrap();
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("400"), "{}", text(&out.stderr));

    // A tenant admin uploads a plugin over HTTP; a user who is not one may not.
    let echo = std::env::temp_dir().join(format!("agent-host-upload-{}.wasm", std::process::id()));
    std::fs::write(&echo, plugin_wasm("echo")).unwrap();
    let out = cli(&["plugins", "upload", "mine", echo.to_str().unwrap()]).await.unwrap();
    assert!(!out.status.success() && text(&out.stderr).contains("403"), "{}", text(&out.stderr));
    let admin = agent_host::db::tokens::create(&db.pool, "ada", "acme", true).await.unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .args(["plugins", "upload", "mine", echo.to_str().unwrap(), "--url", &url, "--token", &admin])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("mine -> sha256:") && text(&out.stdout).contains("tenant acme"),
        "{}",
        text(&out.stdout)
    );
    let _ = std::fs::remove_file(&echo);
    let out = cli(&["runs", "create", "--plugin", "mine", "uploaded"]).await.unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "uploaded");
    let out = cli(&["runs", "create", "--plugin", "nope", "hi"]).await.unwrap();
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("422"), "{}", text(&out.stderr));
    drop(host);
}

/// Posts a run over HTTP as `token`; its id.
async fn post_run(host: &HostProcess, token: &str, plugin: &str, config: serde_json::Value) -> agent_host::db::RunId {
    let answer = reqwest::Client::new()
        .post(format!("http://{}/v1/runs", host.addr))
        .bearer_auth(token)
        .json(&json!({ "content": "hello", "plugin": plugin, "config": config }))
        .send()
        .await
        .unwrap();
    let status = answer.status();
    let body: serde_json::Value = answer.json().await.unwrap();
    assert_eq!(status, 202, "{body}");
    serde_json::from_value(body["run_id"].clone()).unwrap()
}

/// Enqueue to start, by the database's clock, in seconds.
async fn pickup_s(db: &TestDb, run: agent_host::db::RunId) -> f64 {
    sqlx::query_scalar("SELECT extract(epoch FROM started_at - created_at)::float8 FROM agent_run WHERE id = $1")
        .bind(run)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// `n` turns of `good`, one after the other, posted to each host in turn:
/// their pickups, sorted.
async fn trickle(db: &TestDb, hosts: &[&HostProcess], token: &str, n: usize) -> Vec<f64> {
    let mut pickups = Vec::new();
    for i in 0..n {
        let run = post_run(hosts[i % hosts.len()], token, "echo", json!({})).await;
        assert_eq!(wait_terminal(&db.pool, run, LONG).await, "completed");
        pickups.push(pickup_s(db, run).await);
    }
    pickups.sort_by(f64::total_cmp);
    pickups
}

/// Runs of tenant `evil` in `status`.
async fn evil_runs(db: &TestDb, status: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE tenant_id = 'evil' AND status = $1")
        .bind(status)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Prints `good`'s pickups (sorted) unattacked and under attack, and checks
/// the worst under attack stays within two seconds: woken by its enqueue,
/// and the poll tick (0.5 s) bounds a lost wake.
fn report_pickups(what: &str, calm: &[f64], attacked: &[f64]) {
    let (mid, worst) = (|v: &[f64]| v[v.len() / 2] * 1e3, |v: &[f64]| v[v.len() - 1] * 1e3);
    eprintln!(
        "{what}: good's pickup median and worst, unattacked {:.0} / {:.0} ms, under attack {:.0} / {:.0} ms",
        mid(calm),
        worst(calm),
        mid(attacked),
        worst(attacked)
    );
    assert!(attacked[attacked.len() - 1] < 2.0, "good waited for a slot under attack: {attacked:?}");
}

/// Issue 40, the first attack, with real processes at the default share:
/// tenant `evil` posts more runs that never end than two processes have
/// slots. Each process keeps a quarter of its slots from any one tenant, so
/// evil holds 3 of each process's 4 and the rest of its runs wait queued,
/// while tenant `good`'s turns keep starting at once: their pickups under
/// attack stay within a bound (one poll tick and some), beside the same
/// trickle unattacked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_flooding_every_process_with_endless_runs_leaves_room_for_another() {
    let db = TestDb::new().await;
    let args = [FAST, &["--max-runs", "4"]].concat();
    let a = HostProcess::spawn_sharing(&db.url, "A", &args);
    let b = HostProcess::spawn_sharing(&db.url, "B", &args);
    let evil = agent_host::db::tokens::create(&db.pool, "mallory", "evil", false).await.unwrap();
    let good = agent_host::db::tokens::create(&db.pool, "alice", "good", false).await.unwrap();

    let calm = trickle(&db, &[&a, &b], &good, 6).await;

    let endless = json!({ "steps": 100_000, "step_ms": 3_600_000 });
    let mut flood = Vec::new();
    for i in 0..12 {
        flood.push(post_run([&a, &b][i % 2], &evil, "sleep", endless.clone()).await);
    }
    wait_for("evil to hold 3 slots of each process", LONG, || async { evil_runs(&db, "running").await == 6 }).await;

    let attacked = trickle(&db, &[&a, &b], &good, 6).await;
    report_pickups("slot flood", &calm, &attacked);
    let by_worker: Vec<(String, i64)> = sqlx::query_as(
        "SELECT worker_id, count(*) FROM agent_run WHERE tenant_id = 'evil' AND status = 'running'
         GROUP BY worker_id ORDER BY worker_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(by_worker, vec![("A".to_string(), 3), ("B".to_string(), 3)], "evil passed its share of a process");
    assert_eq!(evil_runs(&db, "queued").await, 6, "the rest of the flood waits in the queue");

    for run in &flood {
        let answer = reqwest::Client::new()
            .post(format!("http://{}/v1/runs/{run}/cancel", a.addr))
            .bearer_auth(&evil)
            .send()
            .await
            .unwrap();
        assert!(answer.status().is_success(), "{}", answer.status());
    }
    for run in flood {
        assert_eq!(wait_terminal(&db.pool, run, LONG).await, "cancelled");
    }
    drop((a, b));
}

/// Built-in agents are the operator's to offer: a host started without
/// --builtin-agents refuses a run of `sleep` as an unknown plugin (422).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn built_in_agents_are_off_unless_the_operator_offers_them() {
    let db = TestDb::new().await;
    let (mut host, addr) = serve_child(&["--database-url".as_ref(), db.url.as_ref()]).await;
    let token = agent_host::db::tokens::create(&db.pool, "mallory", "evil", false).await.unwrap();
    let answer = reqwest::Client::new()
        .post(format!("http://{addr}/v1/runs"))
        .bearer_auth(&token)
        .json(&json!({ "content": "hello", "plugin": "sleep", "config": {} }))
        .send()
        .await
        .unwrap();
    let status = answer.status();
    let body: serde_json::Value = answer.json().await.unwrap();
    assert_eq!(status, 422, "{body}");
    assert!(body["error"]["message"].as_str().unwrap_or("").contains("unknown plugin \"sleep\""), "{body}");
    let _ = host.start_kill();
    let _ = host.wait().await;
}

/// The README's first command, `cargo run --release -- serve --demo`, on a
/// fresh machine: the host starts a private cluster (no DATABASE_URL), builds
/// and registers the example `chat` plugin, and its demo turn completes; the
/// demo prints that line. (The same binary, unoptimised: CI's clean clone
/// checks `cargo run` resolves to it in scripts/test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_demo_on_a_private_cluster_completes_its_demo_turn() {
    let dir = std::env::temp_dir().join(format!("agent-host-demo-{}", uuid::Uuid::new_v4().simple()));
    let cache = dir.join("cache");
    let global = ["--data-dir".as_ref(), dir.as_os_str(), "--cache-dir".as_ref(), cache.as_os_str()];
    let (mut host, _, mut lines) = serve_child_with(&global, &["--demo"]).await;
    let mut said = Vec::new();
    let ending = tokio::time::timeout(Duration::from_secs(300), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            said.push(line.clone());
            if line.starts_with("demo: chat run ") {
                return line;
            }
        }
        panic!("the demo ended without its run's ending:\n{}", said.join("\n"));
    })
    .await
    .expect("the demo run did not end within 300 s");
    assert!(ending.contains(" completed: "), "{ending}");
    // The offline model calls the clock tool and says what it answered.
    assert!(ending.contains("UTC"), "{ending}");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(host.id().unwrap() as i32), Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(LONG, host.wait()).await.unwrap().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!dir.join("pg/postmaster.pid").exists(), "the cluster outlived the host");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The port in a running cluster's postmaster.pid (its fourth line).
fn cluster_port(dir: &std::path::Path) -> u16 {
    let pid = std::fs::read_to_string(dir.join("pg/postmaster.pid")).unwrap();
    pid.lines().nth(3).unwrap().trim().parse().unwrap()
}

/// Starts `serve` on the private cluster in `dir`; the host and its address.
async fn serve_private(dir: &std::path::Path) -> (tokio::process::Child, String) {
    serve_child(&["--data-dir".as_ref(), dir.as_os_str()]).await
}

/// Starts `agent-host serve <global>` at the host's defaults (no built-in
/// agents); the host and its address, once it listens.
async fn serve_child(global: &[&std::ffi::OsStr]) -> (tokio::process::Child, String) {
    let (host, addr, _) = serve_child_with(global, &[]).await;
    (host, addr)
}

/// The rest of a child's standard output, line by line.
type Lines = tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>;

/// [`serve_child`] with `serve`'s own `args`, and the lines it prints after
/// the one saying where it listens.
async fn serve_child_with(global: &[&std::ffi::OsStr], args: &[&str]) -> (tokio::process::Child, String, Lines) {
    let mut host = tokio::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(global)
        .args(args)
        .env_remove("DATABASE_URL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(host.stdout.take().unwrap()));
    let line = tokio::time::timeout(LONG, lines.next_line()).await.unwrap().unwrap().unwrap();
    let addr = line.strip_prefix("agent-host listening on http://").expect(&line).to_string();
    (host, addr, lines)
}

async fn stop_host(mut host: tokio::process::Child) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(host.id().unwrap() as i32), Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(LONG, host.wait()).await.unwrap().unwrap();
    assert!(status.success(), "{status:?}");
}

/// Whether `url` lets a connection in.
async fn admits(url: &str) -> Result<(), String> {
    use sqlx::Connection;
    match sqlx::PgConnection::connect(url).await {
        Ok(c) => {
            let _ = c.close().await;
            Ok(())
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Issue 40: the private cluster admits only the host. Any local process
/// could connect to a trust-authenticated cluster on 127.0.0.1 as its
/// superuser; now a connection without the password the host generated
/// (kept in `pg.password`, mode 0600) is refused. A cluster an earlier host
/// made with trust authentication gets its password when next opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_private_cluster_admits_only_the_host() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("agent-host-auth-{}", uuid::Uuid::new_v4().simple()));
    let (host, _) = serve_private(&dir).await;
    let port = cluster_port(&dir);
    let password_file = dir.join("pg.password");
    let mode = std::fs::metadata(&password_file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the password is the host's user's alone");
    let password = std::fs::read_to_string(&password_file).unwrap();
    let refused = admits(&format!("postgres://postgres@127.0.0.1:{port}/postgres")).await.unwrap_err();
    assert!(refused.contains("password"), "{refused}");
    admits(&format!("postgres://postgres:wrong@127.0.0.1:{port}/postgres")).await.unwrap_err();
    admits(&format!("postgres://postgres:{}@127.0.0.1:{port}/postgres", password.trim())).await.unwrap();
    stop_host(host).await;

    // As an earlier host left it: trust, and no password file.
    std::fs::write(dir.join("pg/pg_hba.conf"), "host all all 127.0.0.1/32 trust\n").unwrap();
    std::fs::remove_file(&password_file).unwrap();
    let (host, addr) = serve_private(&dir).await;
    let port = cluster_port(&dir);
    let refused = admits(&format!("postgres://postgres@127.0.0.1:{port}/postgres")).await.unwrap_err();
    assert!(refused.contains("password"), "{refused}");
    let password = std::fs::read_to_string(&password_file).unwrap();
    admits(&format!("postgres://postgres:{}@127.0.0.1:{port}/postgres", password.trim())).await.unwrap();
    // The host itself still reaches its database.
    let ready = reqwest::get(format!("http://{addr}/readyz")).await.unwrap();
    assert!(ready.status().is_success(), "{}", ready.status());
    stop_host(host).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 39: no trap in the command line. `plugins add` run from another
/// directory without --data-dir would once make an empty cluster there,
/// register the plugin in it and print success, while the serving host never
/// saw it. Now it refuses and names the directory it would have used; with
/// the host's --data-dir it reaches the serving host's database, says so,
/// and the host serves the plugin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_add_from_another_directory_reaches_the_host_or_refuses() {
    let dir = std::env::temp_dir().join(format!("agent-host-trap-{}", uuid::Uuid::new_v4().simple()));
    let elsewhere = std::env::temp_dir().join(format!("agent-host-elsewhere-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&elsewhere).unwrap();
    let echo = elsewhere.join("echo.wasm");
    std::fs::write(&echo, plugin_wasm("echo")).unwrap();
    let (host, addr) = serve_private(&dir).await;
    let add = |data_dir: Option<&std::path::Path>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"));
        cmd.current_dir(&elsewhere).env_remove("DATABASE_URL").env_remove("AGENT_HOST_DATA_DIR");
        cmd.args(["plugins", "add", "echo2"]).arg(&echo);
        cmd.arg("--cache-dir").arg(elsewhere.join("cache"));
        if let Some(d) = data_dir {
            cmd.arg("--data-dir").arg(d);
        }
        cmd.output().unwrap()
    };
    let refused = add(None);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr).to_string();
    let would = elsewhere.join(".agent-host");
    assert!(said.contains(&format!("no agent-host database in {}", would.display())), "{said}");
    assert!(!would.exists(), "a cluster was made in {}", would.display());

    let added = add(Some(&dir));
    let said = String::from_utf8_lossy(&added.stderr).to_string();
    assert!(added.status.success(), "{said}");
    assert!(said.contains(&format!("database: the private cluster in {}", dir.display())), "{said}");
    // The serving host sees it.
    let password = std::fs::read_to_string(dir.join("pg.password")).unwrap();
    let url = format!("postgres://postgres:{}@127.0.0.1:{}/agent_host", password.trim(), cluster_port(&dir));
    let pool = agent_host::db::connect(&url, 1).await.unwrap();
    let token = agent_host::db::tokens::create(&pool, "alice", "acme", false).await.unwrap();
    let listed: serde_json::Value = reqwest::Client::new()
        .get(format!("http://{addr}/v1/plugins"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(listed["plugins"].as_array().unwrap().iter().any(|p| p["name"] == "echo2"), "{listed}");
    pool.close().await;
    stop_host(host).await;
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&elsewhere);
}

/// Issue 40: a guest cannot forge the host's log lines. Its stdout goes to
/// the log as one escaped field: a line break it prints is written `\n`,
/// never a new line that looks like the host's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_cannot_forge_a_log_line() {
    let db = TestDb::new().await;
    let manifest = json!({});
    let digest =
        agent_host::db::plugins::put(&db.pool, "fixtures", &plugin_wasm("fixtures"), &manifest).await.unwrap().digest;
    let host = HostProcess::spawn(&db.url, "A", FAST);
    let request = json!({});
    let config = json!({ "mode": "forge" });
    let new = agent_host::db::enqueue::NewRun {
        owner: &owner(),
        conversation_id: None,
        content: "hello",
        plugin: "fixtures",
        plugin_digest: Some(&digest),
        plugin_manifest: Some(&manifest),
        config: &config,
        request: &request,
        idempotency_key: None,
        webhook: None,
        parent: None,
    };
    let run = agent_host::db::enqueue::enqueue(&db.pool, &new).await.unwrap().run_id;
    assert_eq!(wait_terminal(&db.pool, run, LONG).await, "completed");
    host.wait_log("guest output", LONG).await;
    let log = host.log();
    assert!(!log.lines().any(|l| l.contains("forged by a guest") && l.starts_with("2026-01-01")), "{log}");
    assert!(log.contains(r"ok\n2026-01-01T00:00:00.000000Z  INFO agent_host::worker: forged by a guest"), "{log}");
}

/// The hostile suite's bound on good's pickup under attack: at most this
/// many times its worst unattacked, and never less than two seconds (woken
/// by its enqueue; the poll tick, 0.5 s, bounds a lost wake).
const PICKUP_FACTOR: f64 = 3.0;
/// good's turns timed unattacked, and again under attack.
const PICKUP_SAMPLES: usize = 12;
/// The suite's queue quota (`--tenant-max-queued`): above anything good
/// queues, and just above what evil's flood and waits queue.
const HOSTILE_QUEUED_MAX: &str = "72";

/// Prints good's pickups (median, p99, worst) unattacked and under attack,
/// and asserts the p99 under attack (of twelve samples, the worst) stays
/// within max(2 s, [`PICKUP_FACTOR`] × the worst unattacked).
fn bound_pickups(calm: &[f64], attacked: &[f64]) {
    let at = |v: &[f64], q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1];
    let ms = |v: &[f64]| format!("{:.0} / {:.0} / {:.0} ms", at(v, 0.5) * 1e3, at(v, 0.99) * 1e3, at(v, 1.0) * 1e3);
    eprintln!(
        "hostile suite: good's pickup median / p99 / worst over {} turns, unattacked {}, under attack {}",
        attacked.len(),
        ms(calm),
        ms(attacked)
    );
    let bound = f64::max(2.0, PICKUP_FACTOR * at(calm, 1.0));
    assert!(
        at(attacked, 0.99) <= bound,
        "good's pickup p99 under attack passed max(2 s, {PICKUP_FACTOR} × worst unattacked) = {bound:.3} s: \
         unattacked {calm:?}, attacked {attacked:?}"
    );
}

/// Issue 40's hostile-tenant suite, with real processes (two hosts, one
/// database, the host's defaults but for four slots a process, the
/// operator's tools, `--operator-approvals admin` and a queue quota of 72
/// a tenant): tenant `evil` attacks on every front at once while tenant
/// `good` runs a steady trickle of turns. Each attack is refused with a
/// clear 4xx or contained:
/// - a final answer of 4 MiB is stored cut to 1 MiB with its marker;
/// - evil's user approving its own call of a tool the operator gates: 403;
/// - endless runs hold at most their share of each process's slots;
/// - a per-second schedule and the 101st schedule: 422;
/// - the 65th live stream of one user, and the 65th blocking
///   `POST /v1/responses` (and the first where its streams are open): 429,
///   before anything is enqueued;
/// - an upload granting the operator's tool or asking for limits above
///   evil's ceilings: 422;
/// - an anonymous `/metrics` scrape names neither tenant;
/// - evil's hundred schedules all due (an hour overdue) while its queue is
///   at its quota: the firings are held and back off, and good's schedule,
///   due after them, fires on the next tick.
///
/// Nothing of `good` is lost, and its pickup p99 under attack stays within
/// max(2 s, 3 × its worst unattacked), both measured here over 12 turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hostile_tenant_suite_on_two_hosts() {
    use agent_host::text::ANSWER_BYTES_MAX;
    use serde_json::Value;
    let db = TestDb::new().await;
    let dir = std::env::temp_dir().join(format!("agent-host-hostile-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let tools = dir.join("tools.toml");
    std::fs::write(
        &tools,
        "[[webhook]]\nname = \"ops\"\nurl = \"http://127.0.0.1:1/ops\"\n\
         headers = { Authorization = \"Bearer operator-credential\" }\n\n\
         [[webhook]]\nname = \"gated\"\nurl = \"http://127.0.0.1:1/gated\"\napproval = \"always\"\ntenants = [\"evil\"]\n",
    )
    .unwrap();
    let tools_arg = tools.to_string_lossy().into_owned();
    // Compiled components go to the suite's own directory, not the repository's.
    let cache_arg = dir.join("cache").to_string_lossy().into_owned();
    let extra = [
        "--cache-dir",
        &cache_arg,
        "--max-runs",
        "4",
        "--tools-file",
        &tools_arg,
        "--operator-approvals",
        "admin",
        "--tenant-max-queued",
        HOSTILE_QUEUED_MAX,
    ];
    let args = [FAST, &extra].concat();
    let a = HostProcess::spawn_sharing(&db.url, "A", &args);
    let b = HostProcess::spawn_sharing(&db.url, "B", &args);
    let create = |user: &'static str, tenant: &'static str, admin: bool| {
        let pool = db.pool.clone();
        async move { agent_host::db::tokens::create(&pool, user, tenant, admin).await.unwrap() }
    };
    let (evil, evil_admin, good) = (
        create("mallory", "evil", false).await,
        create("eve", "evil", true).await,
        create("alice", "good", false).await,
    );
    let http = reqwest::Client::new();
    let post = |host: &HostProcess, token: &str, path: &str, body: Value| {
        http.post(format!("http://{}{path}", host.addr)).bearer_auth(token.to_string()).json(&body).send()
    };
    let wasm = plugin_wasm("fixtures");
    let upload = |host: &HostProcess, name: &'static str, manifest: Value| {
        let (ct, body) = crate::support::http::multipart(&[
            ("name", name.as_bytes()),
            ("component", wasm.as_slice()),
            ("manifest", manifest.to_string().as_bytes()),
        ]);
        let request = http.post(format!("http://{}/v1/plugins", host.addr)).bearer_auth(&evil_admin);
        request.header("content-type", ct).body(body).send()
    };
    let calm = trickle(&db, &[&a, &b], &good, PICKUP_SAMPLES).await;

    // evil's own plugin (the fixtures), granted the tool the operator gates.
    let hoax = upload(&a, "hoax", json!({ "tools": ["gated"], "durability": "resume" })).await.unwrap();
    assert_eq!(hoax.status(), 201, "{}", hoax.text().await.unwrap());
    // A huge final answer: stored cut, with the marker, not a failed store.
    let huge = post_run(&a, &evil, "hoax", json!({ "mode": "huge", "bytes": 4 << 20 })).await;
    let ended = wait_terminal(&db.pool, huge, LONG).await;
    assert_eq!(ended, "completed", "{}", run_error(&db.pool, huge).await);
    let answer: String = sqlx::query_scalar("SELECT content FROM message WHERE run_id = $1 AND role = 'assistant'")
        .bind(huge)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(answer.len() <= ANSWER_BYTES_MAX && answer.len() > ANSWER_BYTES_MAX - 100, "{} bytes", answer.len());
    assert!(answer.ends_with(" bytes cut]"), "{}", &answer[answer.len() - 40..]);
    // Approvals: evil's user may not approve its own call of a tool the
    // operator gates (an admin other than the requester decides).
    let gated = post_run(&b, &evil, "hoax", json!({ "mode": "durable", "tool": "gated", "steps": 1 })).await;
    wait_status(&db.pool, gated, "waiting", LONG).await;
    let view: Value = http
        .get(format!("http://{}/v1/runs/{gated}", a.addr))
        .bearer_auth(&evil)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let call = view["pending_approval"]["call_id"].as_i64().unwrap_or_else(|| panic!("{view}"));
    let approve = json!({ "decision": "approve" });
    let decided = post(&a, &evil, &format!("/v1/runs/{gated}/approvals/{call}"), approve).await.unwrap();
    let refusal = (decided.status(), decided.text().await.unwrap());
    assert_eq!(refusal.0, 403, "evil's user approved its own operator-gated call: {}", refusal.1);
    assert_eq!(status(&db.pool, gated).await, "waiting", "the refused decision changed the run");

    // Slots: more endless runs than both processes have slots.
    let endless = json!({ "steps": 100_000, "step_ms": 3_600_000 });
    let mut flood = Vec::new();
    for i in 0..12 {
        flood.push(post_run([&a, &b][i % 2], &evil, "sleep", endless.clone()).await);
    }
    // Schedules: too often, then past the tenant's cap.
    let schedule = |cron: &str| json!({ "plugin": "echo", "content": "tick", "cron": cron });
    let every_second = post(&a, &evil, "/v1/schedules", schedule("* * * * * *")).await.unwrap();
    assert_eq!(every_second.status(), 422, "a per-second schedule");
    for i in 0..100 {
        let cron = format!("{} {} * * *", i % 60, i / 60);
        let created = post([&a, &b][i % 2], &evil, "/v1/schedules", schedule(&cron)).await.unwrap();
        assert_eq!(created.status(), 201, "schedule {i}");
    }
    let over = post(&b, &evil, "/v1/schedules", schedule("59 23 * * *")).await.unwrap();
    assert_eq!(over.status(), 422, "the 101st schedule");
    // Streams: one user's 64 live streams on a process, then a 429.
    let url = format!("http://{}/v1/runs/{}/events", a.addr, flood[0]);
    let mut streams = Vec::new();
    for _ in 0..64 {
        streams.push(crate::support::sse::SseClient::connect(&url, &evil, None).await);
    }
    let refused = http.get(&url).bearer_auth(&evil).header("Accept", "text/event-stream").send().await.unwrap();
    assert_eq!(refused.status(), 429, "the 65th stream");
    // Blocking Responses requests hold their user's places as streams do:
    // 64 waiting on B (each for an endless run of its own), then the 65th
    // is refused before it enqueues anything; on A, where the user's 64
    // streams are open, the first is.
    let respond = |host: &HostProcess| {
        let body = json!({ "model": "sleep", "input": "hold", "config": endless });
        http.post(format!("http://{}/v1/responses", host.addr)).bearer_auth(&evil).json(&body).send()
    };
    let waits: Vec<_> = (0..64).map(|_| tokio::spawn(respond(&b))).collect();
    let waiting = || async {
        let sql = "SELECT count(*) FROM agent_run WHERE tenant_id = 'evil' AND config ? 'responses'";
        sqlx::query_scalar::<_, i64>(sql).fetch_one(&db.pool).await.unwrap()
    };
    wait_for("evil's 64 blocking responses to wait", LONG, || async { waiting().await == 64 }).await;
    for (host, what) in [(&b, "the 65th blocking response"), (&a, "a blocking response beside 64 streams")] {
        let refused = tokio::time::timeout(LONG, respond(host)).await.unwrap_or_else(|_| panic!("{what} waited"));
        let refused = refused.unwrap();
        let status = refused.status();
        let body: Value = refused.json().await.unwrap();
        assert_eq!(status, 429, "{what}: {body}");
        assert_eq!(body["error"]["code"], "quota_exceeded", "{what}: {body}");
    }
    assert_eq!(waiting().await, 64, "a refused wait enqueued a run");
    // Grants: an upload granting the operator's webhook.
    let refused = upload(&b, "exfil", json!({ "tools": ["ops"] })).await.unwrap();
    assert_eq!(refused.status(), 422, "an upload granting the operator's tool");
    // Limits: an upload asking for more than the ceilings the operator set evil.
    let ceiling = std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .args(["tenants", "ceiling", "evil", "wall_ms=60000"])
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    assert!(ceiling.status.success(), "{}", String::from_utf8_lossy(&ceiling.stderr));
    let upload = upload(&a, "forever", json!({ "limits": { "wall_ms": 86_400_000 } })).await.unwrap();
    assert_eq!(upload.status(), 422, "an upload asking for limits above evil's ceilings");
    let refusal: Value = upload.json().await.unwrap();
    assert!(refusal["error"]["message"].as_str().unwrap().contains("wall_ms 86400000 > 60000"), "{refusal}");
    // Metrics: a scrape without a token names no tenant, though both
    // processes counted evil's refusals.
    for host in [&a, &b] {
        let text = reqwest::get(format!("http://{}/metrics", host.addr)).await.unwrap().text().await.unwrap();
        assert!(text.contains("agent_host_quota_refusals_total{tenant=\"*\",limit=\"user_streams\"}"), "{text}");
        let samples = text.lines().filter(|l| !l.starts_with('#'));
        let named: Vec<&str> = samples.filter(|l| l.contains("evil") || l.contains("good")).collect();
        assert!(named.is_empty(), "an anonymous scrape of {} names a tenant: {named:?}", host.worker_id);
    }

    // Schedules held by the queue quota: every one of evil's hundred due
    // (an hour overdue, ahead of good's), while evil's queue is at most a
    // few places short of its quota. The firings past it are held and back
    // off; good's schedule, due after them, fires at once all the same.
    let created = post(&a, &good, "/v1/schedules", schedule("0 0 1 1 *")).await.unwrap();
    assert_eq!(created.status(), 201);
    let good_schedule: uuid::Uuid = created.json::<Value>().await.unwrap()["id"].as_str().unwrap().parse().unwrap();
    let queued_before = evil_runs(&db, "queued").await;
    let quota: i64 = HOSTILE_QUEUED_MAX.parse().unwrap();
    assert!(queued_before <= quota, "{queued_before} queued");
    let due_at = Instant::now();
    sqlx::query(
        "UPDATE schedule SET next_fire_at = CASE tenant_id WHEN 'evil' THEN now() - interval '1 hour'
                                                           ELSE now() - interval '1 second' END",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let fired = || async {
        let sql = "SELECT last_run_id FROM schedule WHERE id = $1";
        sqlx::query_scalar::<_, Option<agent_host::db::RunId>>(sql)
            .bind(good_schedule)
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    wait_for("good's schedule to fire", LONG, || async { fired().await.is_some() }).await;
    let took = due_at.elapsed();
    let ticked = fired().await.unwrap();
    wait_for("evil's due firings to be fired or held", LONG, || async {
        let sql = "SELECT count(*) FROM schedule WHERE tenant_id = 'evil' AND next_fire_at <= now()";
        sqlx::query_scalar::<_, i64>(sql).fetch_one(&db.pool).await.unwrap() == 0
    })
    .await;
    let (evil_fired, backed_off): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE last_run_id IS NOT NULL),
                count(*) FILTER (WHERE last_run_id IS NULL AND next_fire_at > now()
                                       AND next_fire_at <= now() + interval '31 seconds')
         FROM schedule WHERE tenant_id = 'evil'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    eprintln!(
        "hostile suite: good's schedule fired {took:?} after it was due; evil's fired {evil_fired}, held {backed_off}"
    );
    assert!(took < Duration::from_secs(5), "good's schedule waited {took:?} behind evil's held ones");
    assert_eq!(evil_fired, quota - queued_before, "evil's firings past its queue quota");
    assert_eq!(evil_fired + backed_off, 100, "every held firing backs off (30 s), none is dropped or due");
    assert_eq!(wait_terminal(&db.pool, ticked, LONG).await, "completed");

    // good, meanwhile.
    wait_for("evil to hold its share of both processes", LONG, || async { evil_runs(&db, "running").await == 6 }).await;
    let attacked = trickle(&db, &[&a, &b], &good, PICKUP_SAMPLES).await;
    bound_pickups(&calm, &attacked);
    assert_eq!(evil_runs(&db, "running").await, 6, "evil passed its share");
    let lost: i64 =
        sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE tenant_id = 'good' AND status <> 'completed'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(lost, 0, "every turn of good completed");
    let done: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE tenant_id = 'good'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(done, 2 * PICKUP_SAMPLES as i64 + 1, "good's turns and its schedule's");

    // evil stops its own: the waits' runs first (each blocking request then
    // answers, cancelled), then the endless runs and the gated one.
    drop(streams);
    let held: Vec<agent_host::db::RunId> =
        sqlx::query_scalar("SELECT id FROM agent_run WHERE tenant_id = 'evil' AND config ? 'responses'")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    for run in held.iter().chain(&flood).chain([&gated]) {
        let answer =
            http.post(format!("http://{}/v1/runs/{run}/cancel", a.addr)).bearer_auth(&evil).send().await.unwrap();
        assert!(answer.status().is_success(), "{}", answer.status());
    }
    for wait in waits {
        let answer = tokio::time::timeout(LONG, wait).await.unwrap().unwrap().unwrap();
        assert_eq!(answer.status(), 200);
        let body: Value = answer.json().await.unwrap();
        assert_eq!(body["status"], "cancelled", "{body}");
    }
    for run in flood.into_iter().chain([gated]) {
        assert_eq!(wait_terminal(&db.pool, run, LONG).await, "cancelled");
    }
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}
