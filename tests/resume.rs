//! Durable resume with real processes: a resumable run (its plugin's manifest
//! says `"durability": "resume"`) survives SIGKILL, SIGSTOP and a SIGTERM past
//! the drain budget by replaying its recorded host calls on another process;
//! no completed tool or model call is made again, a call in flight at the
//! crash is re-sent with the same key only when the tool is idempotent, the
//! client's stream (rejoined across the crash) has no gap and no repeat, and
//! the attempts are bounded. A replay that diverges ends the run failed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::durable::*;
use crate::support::*;
use agent_host::agent::{Agent, AgentError, AgentRegistry, RunHost, RunInput};
use agent_host::db::RunId;
use agent_host::tools::{LlmConfig, ToolRegistry};
use nix::sys::signal::Signal;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_tool_calls_resumes_elsewhere_and_repeats_nothing() {
    let env = Env::new("durable", "fixtures", &["record"], true, &[]).await;
    let a = env.spawn("A");
    let hosts = Arc::new(Mutex::new(vec![a.addr.clone()]));
    let config = json!({ "mode": "durable", "steps": 6, "step_ms": 400 });
    let run = env.post(&a, "durable", "go", config).await;
    let client = start_following(&env, &hosts, run);
    // The conversation's next turn, queued behind it: it must wait for the
    // resumed run, which is its conversation's head again.
    let conversation = env.view(&a, run).await["conversation_id"].as_str().unwrap().to_string();
    let body = json!({ "plugin": "durable", "content": "next", "config": { "mode": "durable", "steps": 1 } });
    let next = env.post_turn(&a, &format!("/v1/conversations/{conversation}/runs"), body).await;
    env.wait_tool_calls(run, 3).await;
    // Between calls: the third answer is recorded and the guest sleeps before the fourth.
    a.signal(Signal::SIGKILL);
    let killed = Instant::now();
    let b = env.spawn("B");
    hosts.lock().unwrap().push(b.addr.clone());
    let followed = client.await.unwrap();
    eprintln!("SIGKILL to completed: {:?}; client rejoined {} times", killed.elapsed(), followed.rejoins);

    let view = env.view(&b, run).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["attempt"], 2, "{view}");
    let answer = env.assistant(run).await;
    assert_eq!(followed.text, answer, "the client's text is the final answer");
    assert!(answer.starts_with("0 1 2 3 4 5 | wall="), "{answer}");
    // The clocks and the random number replayed: what attempt 1 journaled
    // is what attempt 2 answered with.
    let observed = followed.events.iter().find(|e| e.1 == "observed").expect("observed").2["observed"].clone();
    assert_eq!(answer.split("| ").nth(1), observed.as_str(), "{answer} vs {observed}");
    assert_eq!(count(&followed.events, "observed"), 1);
    assert_eq!(count(&followed.events, "run_resumed"), 1);
    let resumed = &followed.events.iter().find(|e| e.1 == "run_resumed").unwrap().2;
    assert_eq!(resumed["attempt"], 2);
    assert_eq!(resumed["worker_id"], "B");
    assert!(resumed["replayed_calls"].as_u64().unwrap() >= 5, "{resumed}");
    assert_eq!(count(&followed.events, "tool_call_finished"), 6, "{:?}", followed.events);
    assert_keys_at_most_once_but_the_one_in_flight(&env.receiver.keys("record"), 6, run);
    assert_journal_sound(&env.db.pool, run).await;
    assert_eq!(wait_terminal(&env.db.pool, next, LONG).await, "completed");
    let (first_end, next_start): (Stamp, Stamp) = sqlx::query_as(
        "SELECT (SELECT finished_at FROM agent_run WHERE id = $1), (SELECT started_at FROM agent_run WHERE id = $2)",
    )
    .bind(run)
    .bind(next)
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    assert!(
        next_start > first_end,
        "the next turn started at {next_start} before the resumed one ended at {first_end}"
    );
    let metrics = reqwest::get(format!("http://{}/metrics", b.addr)).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("agent_host_resumes_total 1"), "{metrics}");
    let replayed = metrics.lines().find(|l| l.starts_with("agent_host_replayed_calls_total ")).unwrap();
    assert!(replayed.split(' ').nth(1).unwrap().parse::<u64>().unwrap() >= 5, "{replayed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_inside_a_slow_webhook_call_of_a_chat_run_resends_it_with_the_same_key() {
    let models = ModelLog::default();
    let model = model(models.clone()).await;
    let llm = format!("{model}/v1");
    let env = Env::new("chat", "chat", &["llm", "slow"], true, &["--llm-base-url", &llm]).await;
    let a = env.spawn("A");
    let hosts = Arc::new(Mutex::new(vec![a.addr.clone()]));
    let offered = json!([{ "name": "slow", "description": "slow", "parameters": { "type": "object" } }]);
    let run = env.post(&a, "chat", "use the slow tool", json!({ "tools": offered })).await;
    let client = start_following(&env, &hosts, run);
    env.wait_arrived("slow").await;
    a.signal(Signal::SIGKILL);
    let b = env.spawn("B");
    hosts.lock().unwrap().push(b.addr.clone());
    let followed = client.await.unwrap();

    let view = env.view(&b, run).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["attempt"], 2);
    let answer = env.assistant(run).await;
    assert_eq!(answer, "The slow tool answered.");
    // The model was asked once per recorded model call: the first answer
    // came from the log on B.
    assert_eq!(models.lock().unwrap().len(), 2, "model requests: {:?}", models.lock().unwrap());
    // The call in flight at the crash went again, with the same key.
    assert_eq!(env.receiver.keys("slow"), vec![format!("{run}:2"), format!("{run}:2")]);
    // The client's text has no repeat: the first model call's text, then the
    // second's. (The chat plugin answers with the last model call's text.)
    assert_eq!(followed.text, format!("Let me check. {answer}"));
    assert_eq!(count(&followed.events, "run_resumed"), 1);
    assert_journal_sound(&env.db.pool, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_model_stream_withdraws_the_partial_text_and_asks_again() {
    let models = ModelLog::default();
    let model = stalling_model(models.clone()).await;
    let llm = format!("{model}/v1");
    let env = Env::new("chat", "chat", &["llm"], true, &["--llm-base-url", &llm]).await;
    let a = env.spawn("A");
    let hosts = Arc::new(Mutex::new(vec![a.addr.clone()]));
    let run = env.post(&a, "chat", "answer me", json!({})).await;
    let client = start_following(&env, &hosts, run);
    let pool = env.db.pool.clone();
    wait_for("the partial text to be journaled", LONG, || {
        let pool = pool.clone();
        async move { deltas_text(&journal_payloads(&pool, run).await).contains("cut") }
    })
    .await;
    a.signal(Signal::SIGKILL);
    let b = env.spawn("B");
    hosts.lock().unwrap().push(b.addr.clone());
    let followed = client.await.unwrap();

    assert_eq!(env.view(&b, run).await["status"], "completed");
    let answer = env.assistant(run).await;
    assert_eq!(answer, "A complete answer.");
    // The cut call was asked again (it was in flight); nothing else was.
    assert_eq!(models.lock().unwrap().len(), 2);
    // The client saw the partial text, then the rollback, then the answer:
    // honouring the rollback, its text is the answer, with nothing repeated.
    let rollback = followed.events.iter().find(|e| e.1 == "content_rollback").expect("a rollback").2.clone();
    assert_eq!(rollback["keep_chars"], 0, "{rollback}");
    assert_eq!(rollback["call_index"], 1, "{rollback}");
    assert_eq!(followed.text, answer);
    assert_eq!(count(&followed.events, "content_rollback"), 1);
    // The JSON pages carry the same rollback.
    let page = env.get(&b, &format!("/v1/runs/{run}/events?from=0")).await;
    assert!(page.to_string().contains("content_rollback"), "{page}");
    assert_journal_sound(&env.db.pool, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_crashes_mid_model_stream_each_withdraw_exactly_their_text() {
    // Request 1 stalls; 2 asks for the `record` tool; 3 (after the tool's
    // result) stalls; 4 answers.
    fn script(n: usize, _has_result: bool) -> (Vec<&'static str>, Option<&'static str>, bool) {
        match n {
            1 => (vec!["First try ", "cut1"], None, true),
            2 => (vec!["Let me check. "], Some("record"), false),
            3 => (vec!["Second try ", "cut2"], None, true),
            _ => (vec!["The tool ", "answered."], None, false),
        }
    }
    let models = ModelLog::default();
    let model = scripted_model(models.clone(), script).await;
    let llm = format!("{model}/v1");
    let env = Env::new("chat", "chat", &["llm", "record"], true, &["--llm-base-url", &llm]).await;
    let offered = json!([{ "name": "record", "description": "record", "parameters": { "type": "object" } }]);
    let a = env.spawn("A");
    let hosts = Arc::new(Mutex::new(vec![a.addr.clone()]));
    let run = env.post(&a, "chat", "go", json!({ "tools": offered })).await;
    let client = start_following(&env, &hosts, run);
    let journaled = |needle: &'static str| {
        let pool = env.db.pool.clone();
        async move {
            wait_for(needle, LONG, || {
                let pool = pool.clone();
                async move { deltas_text(&journal_payloads(&pool, run).await).contains(needle) }
            })
            .await
        }
    };
    journaled("cut1").await;
    a.signal(Signal::SIGKILL);
    let b = env.spawn("B");
    hosts.lock().unwrap().push(b.addr.clone());
    journaled("cut2").await;
    b.signal(Signal::SIGKILL);
    let c = env.spawn("C");
    hosts.lock().unwrap().push(c.addr.clone());
    let followed = client.await.unwrap();

    assert_eq!(env.view(&c, run).await["status"], "completed");
    assert_eq!(env.attempt(run).await, 3);
    assert_eq!(env.assistant(run).await, "The tool answered.");
    // Each cut call was asked again; the completed ones never.
    assert_eq!(models.lock().unwrap().len(), 4);
    assert_eq!(env.receiver.keys("record"), vec![format!("{run}:2")]);
    let rollbacks: Vec<&Value> = followed.events.iter().filter(|e| e.1 == "content_rollback").map(|e| &e.2).collect();
    assert_eq!(rollbacks.len(), 2, "{:?}", followed.events);
    assert_eq!(rollbacks[0]["keep_chars"], 0);
    // The second keeps what the client holds before the cut call: the first
    // attempt's withdrawn text is not counted.
    assert_eq!(rollbacks[1]["keep_chars"], "Let me check. ".chars().count());
    assert_eq!(followed.text, "Let me check. The tool answered.");
    assert_journal_sound(&env.db.pool, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_idempotent_tool_in_flight_at_the_crash_ends_the_run_failed_naming_it() {
    let env = Env::new("durable", "fixtures", &["once"], true, &[]).await;
    let a = env.spawn("A");
    let run = env.post(&a, "durable", "go", json!({ "mode": "durable", "steps": 1, "tool": "once" })).await;
    env.wait_arrived("once").await;
    a.signal(Signal::SIGKILL);
    let b = env.spawn("B");
    assert_eq!(wait_terminal(&env.db.pool, run, LONG).await, "failed");
    let error = run_error(&env.db.pool, run).await;
    assert!(error.starts_with("unknown outcome: call 3 (tool call 1, \"once\")"), "{error}");
    assert!(error.contains("not idempotent"), "{error}");
    assert_eq!(env.receiver.keys("once").len(), 1, "the tool was called twice");
    assert_eq!(env.attempt(run).await, 2);
    assert_journal_sound(&env.db.pool, run).await;
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_past_the_drain_budget_hands_the_run_back_and_it_completes_elsewhere() {
    // A 60 s lease: the run must move on without waiting for one.
    let env = Env::new("durable", "fixtures", &["record"], false, &["--drain-timeout-ms", "300"]).await;
    let mut a = env.spawn("A");
    let hosts = Arc::new(Mutex::new(vec![a.addr.clone()]));
    let run = env.post(&a, "durable", "go", json!({ "mode": "durable", "steps": 6, "step_ms": 400 })).await;
    let client = start_following(&env, &hosts, run);
    env.wait_tool_calls(run, 2).await;
    let b = env.spawn("B");
    hosts.lock().unwrap().push(b.addr.clone());
    let started = Instant::now();
    a.signal(Signal::SIGTERM);
    let exit = a.wait_exit(LONG).await;
    assert!(exit.success(), "exit {exit:?}; log:\n{}", a.log());
    assert!(a.log().contains("handed back"), "{}", a.log());
    let followed = client.await.unwrap();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(20), "the run waited for something: {took:?}");
    let view = env.view(&b, run).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["attempt"], 2);
    assert_eq!(followed.text, env.assistant(run).await);
    assert_keys_at_most_once_but_the_one_in_flight(&env.receiver.keys("record"), 6, run);
    assert_journal_sound(&env.db.pool, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_past_the_lease_resumes_elsewhere_and_the_paused_process_writes_nothing() {
    let env = Env::new("durable", "fixtures", &["record"], true, &[]).await;
    let a = env.spawn("A");
    let run = env.post(&a, "durable", "go", json!({ "mode": "durable", "steps": 6, "step_ms": 300 })).await;
    env.wait_tool_calls(run, 2).await;
    a.signal(Signal::SIGSTOP);
    let b = env.spawn("B");
    assert_eq!(wait_terminal(&env.db.pool, run, LONG).await, "completed");
    let ended = journal(&env.db.pool, run).await;
    let calls: i64 = scalar(&env.db, "SELECT count(*) FROM run_call WHERE run_id = $1", run).await;
    a.signal(Signal::SIGCONT);
    a.wait_log("standing down", LONG).await;
    assert_eq!(journal(&env.db.pool, run).await, ended, "the paused process wrote to the journal");
    let after: i64 = scalar(&env.db, "SELECT count(*) FROM run_call WHERE run_id = $1", run).await;
    assert_eq!(after, calls, "the paused process wrote to the call log");
    assert_eq!(env.attempt(run).await, 2);
    assert_keys_at_most_once_but_the_one_in_flight(&env.receiver.keys("record"), 6, run);
    assert_journal_sound(&env.db.pool, run).await;
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_are_bounded_for_a_run_that_loses_its_host_every_time() {
    let env = Env::new("durable", "fixtures", &["record"], true, &["--resume-attempts", "2"]).await;
    let mut hosts = Vec::new();
    let first = env.spawn("H1");
    let run = env.post(&first, "durable", "go", json!({ "mode": "durable", "steps": 1000, "step_ms": 200 })).await;
    hosts.push(first);
    for n in 1..=2 {
        if n > 1 {
            hosts.push(env.spawn(&format!("H{n}")));
        }
        let worker = format!("H{n}");
        let pool = env.db.pool.clone();
        wait_for("the attempt to run", LONG, || {
            let (pool, worker) = (pool.clone(), worker.clone());
            async move {
                let (status, w, attempt): (String, Option<String>, i32) =
                    sqlx::query_as("SELECT status, worker_id, attempt FROM agent_run WHERE id = $1")
                        .bind(run)
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                status == "running" && w.as_deref() == Some(worker.as_str()) && attempt == n
            }
        })
        .await;
        hosts.last().unwrap().signal(Signal::SIGKILL);
    }
    let _reaper = env.spawn("H3");
    assert_eq!(wait_terminal(&env.db.pool, run, LONG).await, "failed");
    let error = run_error(&env.db.pool, run).await;
    assert!(error.starts_with("attempts exhausted: the run lost its worker on attempt 2 of 2"), "{error}");
    assert_journal_sound(&env.db.pool, run).await;
}

/// The built-ins, the offline `llm` tool, and `agent` as `name`.
fn with_llm(name: &str, agent: Arc<dyn Agent>) -> AgentRegistry {
    let tools = ToolRegistry::from_config(&LlmConfig::default(), &[]).unwrap();
    let mut agents = AgentRegistry::with_builtins().with_tools(tools);
    agents.insert(name, agent);
    agents
}

/// A built-in agent that behaves differently once it has run before: its
/// first execution asks the model one thing and then waits forever; later
/// ones ask another.
struct Fickle(AtomicBool);

#[async_trait::async_trait]
impl Agent for Fickle {
    async fn run(&self, host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        let again = self.0.swap(true, Ordering::SeqCst);
        let question = if again { "something else" } else { "first" };
        let args = json!({ "messages": [{ "role": "user", "content": question }] }).to_string();
        host.call_tool("llm", &args).await?;
        if !again {
            std::future::pending::<()>().await;
        }
        Ok("answered".into())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_diverges_ends_the_run_failed_naming_both_calls() {
    let db = TestDb::new().await;
    let agents = with_llm("fickle", Arc::new(Fickle(AtomicBool::new(false))));
    let manifest = json!({ "tools": ["llm"], "durability": "resume" });
    let run = enqueue_pinned(&db, "fickle", Some(&manifest), json!({})).await;
    // The drain runs out of budget: the run is handed back, not failed.
    handed_back(&db, &agents, run).await;
    let b = start_worker_with(&db, agents, fast_config("B")).await;
    assert_eq!(wait_terminal(&db.pool, run, LONG).await, "failed");
    let error = run_error(&db.pool, run).await;
    let first = agent_host::run::record::args_hash(
        &json!({ "messages": [{ "role": "user", "content": "first" }] }).to_string(),
    );
    let second = agent_host::run::record::args_hash(
        &json!({ "messages": [{ "role": "user", "content": "something else" }] }).to_string(),
    );
    assert_eq!(
        error,
        format!(
            "replay diverged: at call 1: the log has call-tool \"llm\" (args {first}) after 0 journal appends, \
             the agent made call-tool \"llm\" (args {second}) after 0 journal appends"
        )
    );
    assert_eq!(b.stats().divergences.load(Ordering::Relaxed), 1);
    assert_journal_sound(&db.pool, run).await;
    b.drain().await;
}

/// A built-in agent that checks for a stop `n` times (config), then answers.
struct Checker;

#[async_trait::async_trait]
impl Agent for Checker {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        let n = input.config["n"].as_u64().unwrap();
        for _ in 0..n {
            host.check_cancel();
        }
        Ok(format!("checked {n} times"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_call_log_is_bounded_by_the_manifest() {
    let db = TestDb::new().await;
    let mut agents = AgentRegistry::with_builtins();
    agents.insert("checker", Arc::new(Checker));
    let manifest = json!({ "durability": "resume", "limits": { "recorded_calls_max": 10 } });
    let mut runs = Vec::new();
    for n in [10, 11] {
        runs.push(enqueue_pinned(&db, "checker", Some(&manifest), json!({ "n": n })).await);
    }
    let w = start_worker_with(&db, agents, fast_config("W")).await;
    assert_eq!(wait_terminal(&db.pool, runs[0], LONG).await, "completed");
    assert_eq!(wait_terminal(&db.pool, runs[1], LONG).await, "failed");
    assert_eq!(run_error(&db.pool, runs[1]).await, "limit: more than 10 recorded calls");
    w.drain().await;
}

#[tokio::test]
async fn the_schema_admits_running_to_queued_only_as_the_hand_back_of_a_resumable_run() {
    let db = TestDb::new().await;
    let resumable = json!({ "durability": "resume" });
    let plain = enqueue_pinned(&db, "noop", None, json!({})).await;
    let durable = enqueue_pinned(&db, "noop", Some(&resumable), json!({})).await;
    for _ in 0..2 {
        claim_one(&db.pool, "W", Duration::from_secs(30)).await;
    }
    let requeue = |run: RunId, set: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(&format!("UPDATE agent_run SET status = 'queued', {set} WHERE id = $1"))
                .bind(run)
                .execute(&pool)
                .await
        }
    };
    let refused = |r: Result<sqlx::postgres::PgQueryResult, sqlx::Error>| match r {
        Err(sqlx::Error::Database(d)) => d.constraint() == Some("agent_run_status_transition"),
        other => panic!("not refused by the trigger: {other:?}"),
    };
    let raise = "attempt = attempt + 1, claim_expires_at = NULL";
    assert!(refused(requeue(plain, raise).await), "an at-most-once run is never re-queued");
    assert!(refused(requeue(durable, "claim_expires_at = NULL").await), "the attempt must be raised");
    assert!(refused(requeue(durable, "attempt = attempt + 1").await), "the lease must be cleared");
    assert!(refused(requeue(durable, "attempt = attempt + 2, claim_expires_at = NULL").await));
    requeue(durable, raise).await.unwrap();
    // A second claim takes it again, rotating the token; seq 3 is not written twice.
    let again = claim_one(&db.pool, "W2", Duration::from_secs(30)).await;
    assert_eq!((again.id, again.attempt), (durable, 2));
    let starts: i64 =
        scalar(&db, "SELECT count(*) FROM run_event WHERE run_id = $1 AND type = 'run_started'", durable).await;
    assert_eq!(starts, 1);
    // Terminal states stay sticky, resumable or not.
    update_run(&db.pool, durable, "status = 'failed', finished_at = now()").await;
    // With `finished_at` cleared as well, so no CHECK refuses it first (the
    // transition check is an AFTER trigger, migrations/0013).
    let raise_unfinished = "attempt = attempt + 1, claim_expires_at = NULL, finished_at = NULL";
    assert!(refused(requeue(durable, raise_unfinished).await), "a terminal run is never re-queued");
}

/// A built-in agent whose first execution asks the model and then waits
/// forever; later executions answer at once without asking.
struct Quitter(AtomicBool);

#[async_trait::async_trait]
impl Agent for Quitter {
    async fn run(&self, host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        if !self.0.swap(true, Ordering::SeqCst) {
            host.call_tool("llm", r#"{"messages": [{"role": "user", "content": "hi"}]}"#).await?;
            std::future::pending::<()>().await;
        }
        Ok("done early".into())
    }
}

/// Starts worker A on `agents`, lets `run` record one call, and drains A past
/// its budget: the run is handed back to the queue.
async fn handed_back(db: &TestDb, agents: &AgentRegistry, run: RunId) {
    let mut config = fast_config("A");
    config.drain_timeout = Duration::from_millis(50);
    let a = start_worker_with(db, agents.clone(), config).await;
    wait_for("a call to be recorded", LONG, || async {
        let n: i64 = scalar(db, "SELECT count(*) FROM run_call WHERE run_id = $1 AND outcome IS NOT NULL", run).await;
        n == 1
    })
    .await;
    assert_eq!(a.drain().await.aborted, 1);
    assert_eq!(status(&db.pool, run).await, "queued");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_ends_before_its_recorded_calls_diverges() {
    let db = TestDb::new().await;
    let agents = with_llm("quitter", Arc::new(Quitter(AtomicBool::new(false))));
    let manifest = json!({ "tools": ["llm"], "durability": "resume" });
    let run = enqueue_pinned(&db, "quitter", Some(&manifest), json!({})).await;
    handed_back(&db, &agents, run).await;
    let b = start_worker_with(&db, agents, fast_config("B")).await;
    assert_eq!(wait_terminal(&db.pool, run, LONG).await, "failed");
    let error = run_error(&db.pool, run).await;
    assert!(error.starts_with("replay diverged: at call 1: the log has call-tool \"llm\""), "{error}");
    assert!(error.ends_with("the agent made no more calls (1 recorded calls were not made)"), "{error}");
    b.drain().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_back_run_cancelled_in_the_queue_keeps_its_message_sent() {
    let db = TestDb::new().await;
    let agents = with_llm("quitter", Arc::new(Quitter(AtomicBool::new(false))));
    let manifest = json!({ "tools": ["llm"], "durability": "resume" });
    let run = enqueue_pinned(&db, "quitter", Some(&manifest), json!({})).await;
    handed_back(&db, &agents, run).await;
    let cancelled = agent_host::db::lifecycle::cancel(&db.pool, run, "alice").await.unwrap();
    assert_eq!(cancelled, Some(agent_host::db::lifecycle::Cancelled::Queued));
    assert_eq!(status(&db.pool, run).await, "cancelled");
    // It had started: its message is no draft.
    let message: String =
        scalar(&db, "SELECT m.status FROM message m JOIN agent_run r ON m.id = r.user_message_id WHERE r.id = $1", run)
            .await;
    assert_eq!(message, "complete");
    assert_journal_sound(&db.pool, run).await;
}
