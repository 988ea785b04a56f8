//! Sub-agents with real processes: a parent's agent starts child runs
//! (`agent:<plugin>`), awaits them suspended with nothing held
//! (`await-agents`), and is woken by the ending of the child that joins
//! them. The host holding the parent is SIGKILLed while its children run:
//! every child completes once, the parent resumes on the other host, joins
//! them and completes, and no child is started twice. A stop of the parent
//! reaches its children, their partial texts kept.

use std::sync::{Arc, Mutex};

use crate::support::durable::*;
use crate::support::process::HostProcess;
use crate::support::*;
use agent_host::db::{plugins, RunId};
use nix::sys::signal::Signal;
use serde_json::{json, Value};

/// A database with `boss` (the fixtures' `fanout` parent, granted
/// `agent:kid`) and `kid` (the fixtures as a resumable child, granted the
/// receiver's `record`).
async fn env() -> Env {
    let boss = json!({ "tools": ["agent:kid"], "durability": "resume", "limits": { "children_active_max": 20 } });
    let env = Env::with_manifest("boss", "fixtures", &boss, true, &[]).await;
    let kid = json!({ "tools": ["record"], "durability": "resume" });
    plugins::put(&env.db.pool, "kid", &plugin_wasm("fixtures"), &kid).await.unwrap();
    env
}

async fn children(env: &Env, parent: RunId) -> Vec<(RunId, String)> {
    sqlx::query_as("SELECT id, status FROM agent_run WHERE parent_run_id = $1 ORDER BY parent_call")
        .bind(parent)
        .fetch_all(&env.db.pool)
        .await
        .unwrap()
}

async fn status_of(env: &Env, run: RunId) -> String {
    scalar(&env.db, "SELECT status FROM agent_run WHERE id = $1", run).await
}

/// The parent's journal: (seq, type, payload).
async fn journal(env: &Env, run: RunId) -> Vec<(i32, String, Value)> {
    sqlx::query_as("SELECT seq, type, payload FROM run_event WHERE run_id = $1 ORDER BY seq")
        .bind(run)
        .fetch_all(&env.db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_killed_while_its_children_run_resumes_elsewhere_and_joins_each_child_once() {
    let env = env().await;
    // A holds three runs at most: the parent and two children; B, started
    // later, takes the rest.
    let mut a_args = env.args.clone();
    a_args.extend(["--max-runs".to_string(), "3".to_string()]);
    let a = HostProcess::spawn(&env.db.url, "A", &a_args.iter().map(String::as_str).collect::<Vec<_>>());
    let hosts = Arc::new(Mutex::new(vec![a.addr.clone()]));
    let child = json!({ "mode": "durable", "steps": 4, "step_ms": 400 });
    let config = json!({ "mode": "fanout", "children": 5, "plugin": "kid", "hold_ms": 8000, "child": child });
    let parent = env.post(&a, "boss", "fan out", config).await;
    let client = start_following(&env, &hosts, parent);
    wait_for("the parent to start its five children", LONG, || async { children(&env, parent).await.len() == 5 }).await;
    let b = env.spawn("B");
    hosts.lock().unwrap().push(b.addr.clone());
    // Every child claimed (two on A, three on B) and each one's first tool
    // call made: the children run while the parent still holds its slot on A.
    wait_for("every child to make a tool call", LONG, || async {
        let kids = children(&env, parent).await;
        let mut all = true;
        for (kid, _) in &kids {
            all &= env.completed_tool_calls(*kid).await >= 1;
        }
        all
    })
    .await;
    let holder: Option<String> = sqlx::query_scalar(
        "SELECT payload ->> 'worker_id' FROM run_event WHERE run_id = $1 AND type = 'run_started' ORDER BY seq LIMIT 1",
    )
    .bind(parent)
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    assert_eq!(holder.as_deref(), Some("A"));
    assert_eq!(status_of(&env, parent).await, "running", "the parent must be held by A when A dies");
    let on_a: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM agent_run c WHERE c.parent_run_id = $1 AND c.status = 'running'
           AND (SELECT payload ->> 'worker_id' FROM run_event e WHERE e.run_id = c.id AND e.type = 'run_started'
                ORDER BY seq DESC LIMIT 1) = 'A'",
    )
    .bind(parent)
    .fetch_one(&env.db.pool)
    .await
    .unwrap();
    a.signal(Signal::SIGKILL);

    let followed = client.await.unwrap();
    assert_eq!(wait_terminal(&env.db.pool, parent, LONG).await, "completed");
    let kids = children(&env, parent).await;
    assert_eq!(kids.len(), 5, "no child was started twice: {kids:?}");
    for (kid, status) in &kids {
        assert_eq!(status, "completed", "child {kid}");
        // Each child's four tool calls reached the receiver once (the one in
        // flight at the kill, if any, twice).
        assert_keys_at_most_once_but_the_one_in_flight(&env.receiver.keys("record"), 4, *kid);
        assert_journal_sound(&env.db.pool, *kid).await;
    }
    let view = env.view(&b, parent).await;
    assert!(view["attempt"].as_i64().unwrap() >= 2, "the parent was resumed: {view}");
    let listed: Vec<&str> =
        view["children"].as_array().unwrap().iter().map(|c| c["run_id"].as_str().unwrap()).collect();
    let ids: Vec<String> = kids.iter().map(|k| k.0.to_string()).collect();
    assert_eq!(listed, ids.iter().map(String::as_str).collect::<Vec<_>>(), "{view}");
    let kid_view = env.view(&b, kids[0].0).await;
    assert_eq!(kid_view["parent_run_id"], json!(parent.to_string()), "{kid_view}");
    // The answer joins every child's own answer.
    let answer = env.assistant(parent).await;
    let lines: Vec<&str> = answer.lines().collect();
    assert_eq!(lines.len(), 5, "{answer}");
    for (line, (kid, _)) in lines.iter().zip(&kids) {
        assert_eq!(*line, format!("completed:{}", env.assistant(*kid).await), "{answer}");
        assert!(line.starts_with("completed:0 1 2 3 | wall="), "{line}");
    }
    // The parent's stream showed each child's start and end once, across
    // the crash (the client rejoined without a gap or a repeat).
    let events = journal(&env, parent).await;
    assert_eq!(count(&events, "agent_started"), 5, "{events:?}");
    assert_eq!(count(&events, "agent_finished"), 5, "{events:?}");
    assert_eq!(count(&followed.events, "agent_started"), 5);
    assert_eq!(count(&followed.events, "run_resumed"), 1, "{:?}", followed.events);
    // The one delta the parent streamed reached the client once.
    assert_eq!(followed.text, "started 5\n");
    assert_journal_sound(&env.db.pool, parent).await;
    eprintln!("children on A at the kill: {on_a}; parent attempts: {}", view["attempt"]);
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_a_waiting_parent_stops_its_children_and_keeps_their_partial_text() {
    let env = env().await;
    let a = env.spawn("A");
    let child = json!({ "mode": "work", "steps": 600, "step_ms": 50 });
    let config = json!({ "mode": "fanout", "children": 3, "plugin": "kid", "child": child });
    let parent = env.post(&a, "boss", "fan out", config).await;
    // The parent waits for its children (nothing held), which stream.
    wait_for("the parent to wait and every child to stream", LONG, || async {
        let kids = children(&env, parent).await;
        if kids.len() != 3 || status_of(&env, parent).await != "waiting" {
            return false;
        }
        let mut all = true;
        for (kid, _) in &kids {
            let deltas: i64 =
                scalar(&env.db, "SELECT count(*) FROM run_event WHERE run_id = $1 AND type = 'content_delta'", *kid)
                    .await;
            all &= deltas >= 3;
        }
        all
    })
    .await;
    let (code, answer) =
        env.request(&a, reqwest::Method::POST, &format!("/v1/runs/{parent}/cancel"), Some(json!({}))).await;
    assert_eq!(code, 202, "{answer}");
    assert_eq!(wait_terminal(&env.db.pool, parent, LONG).await, "cancelled");
    let kids = children(&env, parent).await;
    assert_eq!(kids.len(), 3);
    for (kid, _) in &kids {
        assert_eq!(wait_terminal(&env.db.pool, *kid, LONG).await, "cancelled", "child {kid}");
        let (content, status): (String, String) =
            sqlx::query_as("SELECT content, status FROM message WHERE run_id = $1 AND role = 'assistant'")
                .bind(kid)
                .fetch_one(&env.db.pool)
                .await
                .unwrap();
        assert_eq!(status, "partial");
        assert!(content.starts_with("0 1 2 "), "{content}");
    }
    // Nothing started after: no other child, and the parent never resumed.
    assert_eq!(children(&env, parent).await.len(), 3);
    assert_eq!(env.attempt(parent).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_child_is_a_value_in_its_parent_and_any_wakes_on_the_first_end() {
    let env = env().await;
    let a = env.spawn("A");
    // Three children that trap: the parent awaits any, then answers.
    let config = json!({ "mode": "fanout", "children": 3, "plugin": "kid", "any": true, "child": { "mode": "trap" } });
    let parent = env.post(&a, "boss", "fan out", config).await;
    assert_eq!(wait_terminal(&env.db.pool, parent, LONG).await, "completed");
    let answer = env.assistant(parent).await;
    assert!(answer.lines().count() == 3 && answer.contains("failed:"), "{answer}");
    // Past the manifest's bound, a start is refused as a value too.
    let config = json!({ "mode": "fanout", "children": 17, "plugin": "kid", "child": { "mode": "record" } });
    let over = env.post(&a, "boss", "too many", config).await;
    assert_eq!(wait_terminal(&env.db.pool, over, LONG).await, "failed");
    let error: String = scalar(&env.db, "SELECT error FROM agent_run WHERE id = $1", over).await;
    assert!(error.contains("limits.children_max"), "{error}");
    assert_eq!(children(&env, over).await.len(), 16);
    // An ungranted agent is denied.
    let config = json!({ "mode": "fanout", "children": 1, "plugin": "boss" });
    let denied = env.post(&a, "boss", "not granted", config).await;
    assert_eq!(wait_terminal(&env.db.pool, denied, LONG).await, "failed");
    let error: String = scalar(&env.db, "SELECT error FROM agent_run WHERE id = $1", denied).await;
    assert!(error.contains("agent:boss") && error.contains("not granted"), "{error}");
}
