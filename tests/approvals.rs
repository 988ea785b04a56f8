//! A person in the loop, with real processes: a resumable run whose agent
//! calls a tool that needs approval waits (status `waiting`) with nothing
//! held, across restarts of every host; a decision puts it back in the queue
//! and it resumes by replay; the approved tool runs exactly once (with the
//! edited arguments when edited), a rejection answers the agent `denied`;
//! decisions are made once; timeouts reject; a stop cancels at once; the
//! conversation's next turn waits; the durable `wait` tool suspends the same
//! way and wakes on time.

use std::time::{Duration, Instant};

use crate::support::durable::*;
use crate::support::process::HostProcess;
use crate::support::*;
use agent_host::db::RunId;
use nix::sys::signal::Signal;
use serde_json::{json, Value};

/// The chat plugin over the offline model (which calls the first offered
/// tool with `{"input": <the message>}`), its `send` tool needing approval.
async fn chat_env(approval_timeout_ms: u64, extra: &[&str]) -> Env {
    let manifest = json!({
        "tools": ["llm", "send"],
        "durability": "resume",
        "approval": { "send": "always" },
        "limits": { "approval_timeout_ms": approval_timeout_ms },
    });
    Env::with_manifest("chat", "chat", &manifest, true, extra).await
}

fn send_offered() -> Value {
    json!({ "tools": [{ "name": "send", "description": "send it", "parameters": { "type": "object" } }] })
}

async fn decide(env: &Env, host: &HostProcess, run: RunId, call: i64, body: Value) -> (u16, Value) {
    env.request(host, reqwest::Method::POST, &format!("/v1/runs/{run}/approvals/{call}"), Some(body)).await
}

async fn wait_waiting(env: &Env, host: &HostProcess, run: RunId) -> Value {
    wait_status(&env.db.pool, run, "waiting", LONG).await;
    let view = env.view(host, run).await;
    assert_eq!(view["status"], "waiting", "{view}");
    view["pending_approval"].clone()
}

async fn metric(host: &HostProcess, name: &str) -> f64 {
    let text = reqwest::get(format!("http://{}/metrics", host.addr)).await.unwrap().text().await.unwrap();
    let line = text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name}: {text}"));
    line.split(' ').nth(1).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approved_and_edited_calls_run_once_after_every_host_restarted() {
    let env = chat_env(3_600_000, &[]).await;
    let a = env.spawn("A");
    let approve = env.post(&a, "chat", "send the report", send_offered()).await;
    let edit = env.post(&a, "chat", "send the draft", send_offered()).await;
    let pending = wait_waiting(&env, &a, approve).await;
    assert_eq!(pending["tool"], "send");
    assert_eq!(pending["args"], json!({ "input": "send the report" }));
    let call = pending["call_id"].as_i64().unwrap();
    wait_waiting(&env, &a, edit).await;
    // Nothing is held while they wait (a run task counts its outcome, then
    // lets its run go, just after the status changed).
    wait_for("no run held", LONG, || async { metric(&a, "agent_host_runs_in_flight").await == 0.0 }).await;
    assert_eq!(metric(&a, "agent_host_sandboxes_live").await, 0.0);
    assert_eq!(metric(&a, "agent_host_runs_waiting").await, 2.0);
    assert_eq!(metric(&a, "agent_host_runs_suspended_total").await, 2.0);
    assert_eq!(metric(&a, "agent_host_fence_trips_total").await, 0.0, "a suspension is not a lost run");
    let listed = env.get(&a, "/v1/approvals").await;
    assert_eq!(listed["approvals"].as_array().unwrap().len(), 2, "{listed}");
    assert!(env.receiver.args.lock().unwrap().is_empty(), "nothing was sent before the approval");

    // Every host process goes; new ones come.
    a.signal(Signal::SIGKILL);
    drop(a);
    let b = env.spawn("B");
    let c = env.spawn("C");
    let (code, body) = decide(&env, &b, approve, call, json!({ "decision": "approve" })).await;
    assert_eq!(code, 200, "{body}");
    let edited = json!({ "input": "send the final version" });
    let (code, body) = decide(&env, &c, edit, call, json!({ "decision": "edit", "args": edited })).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(wait_terminal(&env.db.pool, approve, LONG).await, "completed");
    assert_eq!(wait_terminal(&env.db.pool, edit, LONG).await, "completed");

    let sent = env.receiver.args.lock().unwrap().clone();
    assert_eq!(sent.len(), 2, "each approved call ran exactly once: {sent:?}");
    assert!(sent.contains(&("send".to_string(), json!({ "input": "send the report" }))), "{sent:?}");
    assert!(sent.contains(&("send".to_string(), edited.clone())), "{sent:?}");
    let answer = env.assistant(approve).await;
    assert!(answer.starts_with("Offline reply to: send the report") && answer.contains("Tool send said"), "{answer}");
    let view = env.view(&b, approve).await;
    assert_eq!(view["attempt"], 2);
    assert_eq!(view["pending_approval"], Value::Null);
    let kinds: Vec<String> = journal(&env.db.pool, edit).await.into_iter().map(|(_, k)| k).collect();
    let at = |k: &str| kinds.iter().position(|x| x == k).unwrap_or_else(|| panic!("{k} in {kinds:?}"));
    assert!(at("approval_requested") < at("approval_decided") && at("approval_decided") < at("run_resumed"));
    let decided = journal_payloads(&env.db.pool, edit).await.into_iter().find(|e| e.1 == "approval_decided").unwrap().2;
    assert_eq!((decided["decision"].clone(), decided["args"].clone()), (json!("edit"), edited));
    assert_journal_sound(&env.db.pool, approve).await;
    assert_journal_sound(&env.db.pool, edit).await;
}

/// A suspension clears the run's claim itself. A heartbeat that reads the
/// claim gone between the suspension's commit and the run task's next look
/// must not make the run a lost one: with a heartbeat every millisecond that
/// window is hit often (this failed with the suspension unguarded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_racing_a_suspension_never_makes_it_a_lost_run() {
    const RUNS: usize = 40;
    let env = chat_env(3_600_000, &["--heartbeat-ms", "1", "--max-runs", "8"]).await;
    let a = env.spawn("A");
    let mut runs = Vec::new();
    for i in 0..RUNS {
        runs.push(env.post(&a, "chat", &format!("send {i}"), send_offered()).await);
    }
    for run in &runs {
        wait_waiting(&env, &a, *run).await;
    }
    // A run task counts its outcome before it lets its run go.
    wait_for("no run held", LONG, || async { metric(&a, "agent_host_runs_in_flight").await == 0.0 }).await;
    assert_eq!(metric(&a, "agent_host_fence_trips_total").await, 0.0, "a suspension is not a lost run");
    assert_eq!(metric(&a, "agent_host_runs_suspended_total").await, RUNS as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_call_answers_denied_and_the_agent_finishes() {
    let env = chat_env(3_600_000, &[]).await;
    let a = env.spawn("A");
    let run = env.post(&a, "chat", "send it", send_offered()).await;
    let call = wait_waiting(&env, &a, run).await["call_id"].as_i64().unwrap();
    let (code, body) = decide(&env, &a, run, call, json!({ "decision": "reject", "reason": "not today" })).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(wait_terminal(&env.db.pool, run, LONG).await, "completed");
    let answer = env.assistant(run).await;
    assert!(answer.contains("denied") && answer.contains("not today"), "{answer}");
    assert!(env.receiver.args.lock().unwrap().is_empty(), "a rejected call is never made");
    // One audit row: the decision and the call, not the reason's text.
    let rows = decided_rows(&env.db.pool).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].0, format!("{run}/{call}"));
    assert_eq!(rows[0].1["decision"], "reject");
    assert!(!rows[0].1.to_string().contains("not today"), "{rows:?}");
}

/// The `approval.decided` audit rows: (target, detail).
async fn decided_rows(pool: &sqlx::PgPool) -> Vec<(String, Value)> {
    sqlx::query_as("SELECT target, detail FROM audit_event WHERE action = 'approval.decided' ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_concurrent_decisions_on_one_call_one_wins_the_other_gets_409_with_it() {
    let env = chat_env(3_600_000, &[]).await;
    let a = env.spawn("A");
    let run = env.post(&a, "chat", "send it", send_offered()).await;
    let call = wait_waiting(&env, &a, run).await["call_id"].as_i64().unwrap();
    let (approve, reject) = tokio::join!(
        decide(&env, &a, run, call, json!({ "decision": "approve" })),
        decide(&env, &a, run, call, json!({ "decision": "reject", "reason": "no" })),
    );
    let mut codes = [approve.0, reject.0];
    codes.sort();
    assert_eq!(codes, [200, 409], "{approve:?} {reject:?}");
    let (won, lost) = if approve.0 == 200 { (approve, reject) } else { (reject, approve) };
    assert_eq!(lost.1["decision"]["decision"], won.1["decision"]["decision"], "the 409 carries the first: {lost:?}");
    assert_eq!(lost.1["error"]["code"], "conflict");
    assert_eq!(decided_rows(&env.db.pool).await.len(), 1, "the losing decision is not audited");
    assert_eq!(wait_terminal(&env.db.pool, run, LONG).await, "completed");
    // And once more, after the run ended: still the first decision.
    let (code, again) = decide(&env, &a, run, call, json!({ "decision": "approve" })).await;
    assert_eq!((code, again["decision"]["decision"].clone()), (409, won.1["decision"]["decision"].clone()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_that_never_comes_times_out_as_a_rejection() {
    let env = chat_env(500, &[]).await;
    let a = env.spawn("A");
    let run = env.post(&a, "chat", "send it", send_offered()).await;
    assert_eq!(wait_terminal(&env.db.pool, run, LONG).await, "completed");
    let answer = env.assistant(run).await;
    assert!(answer.contains("the approval timed out"), "{answer}");
    let decided = journal_payloads(&env.db.pool, run).await.into_iter().find(|e| e.1 == "approval_decided").unwrap().2;
    assert_eq!(decided["decision"], "reject");
    assert!(env.receiver.args.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_cancels_a_waiting_run_at_once_and_the_next_turn_waits_behind_a_waiting_one() {
    let env = chat_env(3_600_000, &[]).await;
    let a = env.spawn("A");
    let first = env.post(&a, "chat", "send one", send_offered()).await;
    wait_waiting(&env, &a, first).await;
    let conversation = env.view(&a, first).await["conversation_id"].as_str().unwrap().to_string();
    let body = json!({ "plugin": "chat", "content": "send two", "config": send_offered() });
    let next = env.post_turn(&a, &format!("/v1/conversations/{conversation}/runs"), body).await;
    // The waiting turn is the conversation's active one: the next stays queued.
    let started = Instant::now();
    wait_for("a few claim rounds", LONG, || async { metric(&a, "agent_host_claim_rounds_total").await >= 3.0 }).await;
    assert_eq!(status(&env.db.pool, next).await, "queued", "{:?} after the first waited", started.elapsed());

    // Approve the first: it completes, then the next starts (and waits in turn).
    let call = env.view(&a, first).await["pending_approval"]["call_id"].as_i64().unwrap();
    decide(&env, &a, first, call, json!({ "decision": "approve" })).await;
    assert_eq!(wait_terminal(&env.db.pool, first, LONG).await, "completed");
    wait_waiting(&env, &a, next).await;
    type Stamp = chrono::DateTime<chrono::Utc>;
    let (ended, began): (Stamp, Stamp) = sqlx::query_as(
        "SELECT (SELECT finished_at FROM agent_run WHERE id = $1), (SELECT started_at FROM agent_run WHERE id = $2)",
    )
    .bind(first)
    .bind(next)
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    assert!(began > ended, "the next turn started at {began}, before the first ended at {ended}");

    // A stop while waiting cancels at once: nobody holds the run.
    let (code, body) = env.request(&a, reqwest::Method::POST, &format!("/v1/runs/{next}/cancel"), None).await;
    assert_eq!(code, 202);
    assert_eq!(body["status"], "cancelled", "{body}");
    assert_eq!(status(&env.db.pool, next).await, "cancelled");
    assert_eq!(env.view(&a, next).await["pending_approval"], Value::Null);
    assert_journal_sound(&env.db.pool, next).await;
    assert!(env.receiver.args.lock().unwrap().len() == 1, "only the approved call ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_wait_survives_a_restart_of_every_host_and_wakes_on_time() {
    let manifest = json!({ "tools": ["wait"], "durability": "resume" });
    let env = Env::with_manifest("waiter", "fixtures", &manifest, true, &[]).await;
    let a = env.spawn("A");
    let run = env.post(&a, "waiter", "wait", json!({ "mode": "wait", "seconds": 2 })).await;
    wait_status(&env.db.pool, run, "waiting", LONG).await;
    let until: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT expires_at FROM run_suspension WHERE run_id = $1")
            .bind(run)
            .fetch_one(&env.db.pool)
            .await
            .unwrap();
    a.signal(Signal::SIGKILL);
    drop(a);
    let b = env.spawn("B");
    assert_eq!(wait_terminal(&env.db.pool, run, LONG).await, "completed");
    let (woke, resumed): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
        "SELECT (SELECT decided_at FROM run_suspension WHERE run_id = $1),
                (SELECT created_at FROM run_event WHERE run_id = $1 AND type = 'run_resumed')",
    )
    .bind(run)
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    let late = (woke - until).to_std().expect("woken after its time");
    eprintln!("woken {late:?} after its time; resumed {:?} after", (resumed - until).to_std().unwrap());
    // Within the reaper interval (100 ms here), with room for a busy machine.
    assert!(late < Duration::from_millis(1_000), "woken {late:?} late");
    let answer = env.assistant(run).await;
    // The clock readings replayed: the answer's "before" is the first attempt's.
    let times: Vec<f64> = answer.split(' ').filter_map(|w| w.parse().ok()).collect();
    assert_eq!(times.len(), 2, "{answer}");
    assert!(times[1] - times[0] >= 2.0, "{answer}");
    let kinds: Vec<String> = journal(&env.db.pool, run).await.into_iter().map(|(_, k)| k).collect();
    assert!(kinds.contains(&"wait_started".to_string()) && kinds.contains(&"wait_elapsed".to_string()), "{kinds:?}");
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_waiting_runs_hold_no_slot_no_sandbox_and_little_memory() {
    let env = chat_env(3_600_000, &["--max-runs", "32"]).await;
    let a = env.spawn("A");
    // Warm up with a full load of slots (32) through their wait and their
    // decision: idle is then the process as it is after working at capacity.
    let mut warm = Vec::new();
    for i in 0..32 {
        warm.push(env.post(&a, "chat", &format!("warm up {i}"), send_offered()).await);
    }
    for run in &warm {
        let call = wait_waiting(&env, &a, *run).await["call_id"].as_i64().unwrap();
        decide(&env, &a, *run, call, json!({ "decision": "approve" })).await;
    }
    for run in &warm {
        assert_eq!(wait_terminal(&env.db.pool, *run, LONG).await, "completed");
    }
    let idle = rss_bytes(&a);

    let mut runs = Vec::new();
    for i in 0..1000 {
        runs.push(env.post(&a, "chat", &format!("send {i}"), send_offered()).await);
    }
    wait_for("1,000 runs waiting", 2 * LONG, || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE status = 'waiting'")
            .fetch_one(&env.db.pool)
            .await
            .unwrap();
        n == 1000
    })
    .await;
    assert_eq!(metric(&a, "agent_host_runs_in_flight").await, 0.0);
    assert_eq!(metric(&a, "agent_host_sandboxes_live").await, 0.0);
    assert_eq!(metric(&a, "agent_host_runs_waiting").await, 1000.0);
    let waiting = rss_bytes(&a);
    eprintln!("resident memory: idle {idle} bytes, with 1,000 runs waiting {waiting} bytes");
    assert!(waiting as f64 <= idle as f64 * 1.10, "idle {idle} bytes, 1,000 waiting {waiting} bytes");
}

/// A process's resident memory.
fn rss_bytes(host: &HostProcess) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", host.child.id())).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_lists_approvals_and_approves_and_rejects() {
    let env = chat_env(3_600_000, &[]).await;
    let a = env.spawn("A");
    let url = format!("http://{}", a.addr);
    let cli = |args: Vec<String>| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
            .env("AGENT_HOST_URL", &url)
            .env("AGENT_HOST_TOKEN", &env.token)
            .args(args)
            .kill_on_drop(true)
            .output()
    };
    let text = |b: &[u8]| String::from_utf8_lossy(b).to_string();
    let yes = env.post(&a, "chat", "send yes", send_offered()).await;
    let no = env.post(&a, "chat", "send no", send_offered()).await;
    wait_waiting(&env, &a, yes).await;
    let call = wait_waiting(&env, &a, no).await["call_id"].to_string();

    let out = cli(vec!["approvals".into(), "list".into()]).await.unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listed = text(&out.stdout);
    assert_eq!(listed.lines().count(), 2, "{listed}");
    assert!(listed.contains(&format!("{yes}\t{call}\tsend\t{{\"input\":\"send yes\"}}")), "{listed}");

    let out = cli(vec!["runs".into(), "approve".into(), yes.to_string(), call.clone()]).await.unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = cli(vec!["runs".into(), "reject".into(), no.to_string(), call.clone(), "--reason".into(), "nope".into()])
        .await
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Once decided, again is refused with the first decision's word.
    let out = cli(vec!["runs".into(), "approve".into(), no.to_string(), call]).await.unwrap();
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("decided already"), "{}", text(&out.stderr));
    assert_eq!(wait_terminal(&env.db.pool, yes, LONG).await, "completed");
    assert_eq!(wait_terminal(&env.db.pool, no, LONG).await, "completed");
    assert!(env.assistant(no).await.contains("nope"));
    assert_eq!(env.receiver.args.lock().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approved_call_in_flight_at_a_crash_is_not_made_twice() {
    // `once` (not idempotent) holds its first request: the host dies inside it.
    let manifest = json!({ "tools": ["llm", "once"], "durability": "resume", "approval": { "once": "always" } });
    let env = Env::with_manifest("chat", "chat", &manifest, true, &[]).await;
    let a = env.spawn("A");
    let offered = json!({ "tools": [{ "name": "once", "description": "once", "parameters": { "type": "object" } }] });
    let run = env.post(&a, "chat", "do it once", offered).await;
    let call = wait_waiting(&env, &a, run).await["call_id"].as_i64().unwrap();
    let (code, _) = decide(&env, &a, run, call, json!({ "decision": "approve" })).await;
    assert_eq!(code, 200);
    env.wait_arrived("once").await;
    a.signal(Signal::SIGKILL);
    let b = env.spawn("B");
    assert_eq!(wait_terminal(&env.db.pool, run, LONG).await, "failed");
    let error = run_error(&env.db.pool, run).await;
    assert!(error.starts_with("unknown outcome:") && error.contains("was approved and in flight"), "{error}");
    assert_eq!(env.receiver.keys("once").len(), 1, "the approved call was made once");
    drop(b);
}

/// Issue 40: approvals can separate duties. With `--operator-approvals
/// admin --operator-approvals-no-edit`, a call of a tool the operator gates
/// (`approval = "always"` in the tools file) is not its requester's to
/// decide (403), nor may its arguments be edited; an admin of the tenant
/// sees it among the tenant's pending approvals and approves it, and the
/// run completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_gated_call_is_decided_by_an_admin_other_than_its_requester() {
    let manifest = json!({ "tools": ["llm", "gated"], "durability": "resume" });
    let extra = ["--operator-approvals", "admin", "--operator-approvals-no-edit"];
    let env = Env::with_manifest("chat", "chat", &manifest, true, &extra).await;
    let a = env.spawn("A");
    let offered = json!({ "tools": [{ "name": "gated", "description": "gated", "parameters": { "type": "object" } }] });
    let run = env.post(&a, "chat", "send it", offered).await;
    let call = wait_waiting(&env, &a, run).await["call_id"].as_i64().unwrap();
    let (code, body) = decide(&env, &a, run, call, json!({ "decision": "approve" })).await;
    assert_eq!(code, 403, "the requester approved its own gated call: {body}");
    let admin = agent_host::db::tokens::create(&env.db.pool, "ada", "acme", true).await.unwrap();
    let as_admin = |method: reqwest::Method, path: String, body: Option<Value>| {
        let mut req = reqwest::Client::new().request(method, format!("http://{}{path}", a.addr)).bearer_auth(&admin);
        if let Some(b) = body {
            req = req.json(&b);
        }
        async move {
            let res = req.send().await.unwrap();
            (res.status().as_u16(), res.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (code, listed) = as_admin(reqwest::Method::GET, "/v1/approvals?all=true".into(), None).await;
    assert_eq!(code, 200, "{listed}");
    assert_eq!(listed["approvals"][0]["run_id"], json!(run.to_string()), "{listed}");
    let path = format!("/v1/runs/{run}/approvals/{call}");
    let edit = json!({ "decision": "edit", "args": { "to": "elsewhere" } });
    let (code, body) = as_admin(reqwest::Method::POST, path.clone(), Some(edit)).await;
    assert_eq!(code, 403, "an edit of a gated call: {body}");
    let (code, body) = as_admin(reqwest::Method::POST, path, Some(json!({ "decision": "approve" }))).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(wait_terminal(&env.db.pool, run, LONG).await, "completed");
}
