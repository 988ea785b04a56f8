//! Stop means stop: conversation stops in one transaction, cancels over the
//! NOTIFY fast path and the heartbeat's re-read, guests interrupted past the
//! cancel grace, and disconnects that are not stops.

use std::time::{Duration, Instant};

use crate::support::http::TestHost;
use crate::support::sse::SseClient;
use crate::support::*;
use agent_host::agent::AgentRegistry;
use agent_host::db::{plugins, tokens, ConversationId, RunId};
use agent_host::hub::Hub;
use agent_host::sandbox::Sandbox;
use agent_host::worker::WorkerConfig;
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

async fn conversation(host: &TestHost) -> ConversationId {
    let (code, v) = host.call("POST", "/v1/conversations", None).await;
    assert_eq!(code, StatusCode::CREATED, "{v}");
    v["id"].as_str().unwrap().parse().unwrap()
}

async fn post_turn(host: &TestHost, conv: ConversationId, plugin: &str, content: &str, config: Value) -> RunId {
    let body = json!({ "content": content, "plugin": plugin, "config": config });
    let (code, v) = host.call("POST", &format!("/v1/conversations/{conv}/runs"), Some(body)).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{v}");
    v["run_id"].as_str().unwrap().parse().unwrap()
}

async fn wait_delta(pool: &PgPool, run: RunId) {
    wait_for(&format!("run {run} to stream"), LONG, || async {
        journal(pool, run).await.iter().any(|(_, t)| t == "content_delta")
    })
    .await;
}

async fn started(pool: &PgPool, run: RunId) -> bool {
    sqlx::query_scalar::<_, Option<chrono::DateTime<chrono::Utc>>>("SELECT started_at FROM agent_run WHERE id = $1")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap()
        .is_some()
}

/// A run's messages as (role, status, content).
async fn messages_of(pool: &PgPool, run: RunId) -> Vec<(String, String, String)> {
    sqlx::query_as(
        "SELECT m.role, m.status, m.content FROM message m JOIN agent_run r ON r.id = $1
         WHERE m.id = r.user_message_id OR (m.run_id = r.id AND m.role = 'assistant')
         ORDER BY m.role DESC",
    )
    .bind(run)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Proves the dispatcher has run claim rounds since now: a run in another
/// conversation is enqueued and completes. A queued turn of a stopped
/// conversation, had it been claimable, would have been claimed first (FIFO).
async fn dispatcher_passed(host: &TestHost, pool: &PgPool) {
    let other = conversation(host).await;
    let sentinel = post_turn(host, other, "noop", "sentinel", json!({})).await;
    assert_eq!(wait_terminal(pool, sentinel, LONG).await, "completed");
}

/// A cancelled run that had streamed: its partial text is kept, equal to the journal.
async fn assert_partial_kept(pool: &PgPool, run: RunId) {
    let streamed = deltas_text(&journal_payloads(pool, run).await);
    assert!(!streamed.is_empty(), "run {run} streamed before the stop");
    let msgs = messages_of(pool, run).await;
    assert_eq!(msgs.len(), 2, "{msgs:?}");
    assert_eq!(msgs[1].0, "assistant");
    assert_eq!((msgs[1].1.as_str(), msgs[1].2.as_str()), ("partial", streamed.as_str()));
}

fn ids(v: &Value) -> Vec<RunId> {
    v.as_array().unwrap().iter().map(|x| x.as_str().unwrap().parse().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_cancels_the_queue_with_drafts_and_the_running_turn_keeps_its_partial_text() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let hub = Hub::start(db.url.clone());
    let host = TestHost::start(&db, Some(hub), AgentRegistry::with_builtins(), fast_config("w")).await;
    let conv = conversation(&host).await;
    let running = post_turn(&host, conv, "sleep", "first", json!({ "steps": 10_000, "step_ms": 20 })).await;
    let mut queued = Vec::new();
    for content in ["second", "third", "fourth"] {
        queued.push(post_turn(&host, conv, "sleep", content, json!({ "steps": 1 })).await);
    }
    wait_delta(pool, running).await;

    let (code, v) = host.call("POST", &format!("/v1/conversations/{conv}/stop"), None).await;
    assert_eq!(code, StatusCode::OK, "{v}");
    assert_eq!(ids(&v["cancelled"]), queued);
    assert_eq!(ids(&v["cancelling"]), vec![running]);
    let drafts: Vec<&str> = v["drafts"].as_array().unwrap().iter().map(|d| d["content"].as_str().unwrap()).collect();
    assert_eq!(drafts, ["second", "third", "fourth"]);

    assert_eq!(wait_terminal(pool, running, LONG).await, "cancelled");
    assert_eq!(run_error(pool, running).await, "", "a cooperative stop is not an error");
    assert_partial_kept(pool, running).await;
    for run in &queued {
        assert_eq!(status(pool, *run).await, "cancelled");
        let j = journal_payloads(pool, *run).await;
        let kinds: Vec<&str> = j.iter().map(|(_, t, _)| t.as_str()).collect();
        assert_eq!(kinds, ["user_message_created", "run_queued", "complete"], "a queued turn never started");
        assert_eq!(j[2].2, json!({ "status": "cancelled" }));
        let msgs = messages_of(pool, *run).await;
        assert_eq!(msgs.len(), 1, "no answer for a turn that never ran: {msgs:?}");
        assert_eq!(msgs[0].1, "draft");
    }
    dispatcher_passed(&host, pool).await;
    for run in &queued {
        assert!(!started(pool, *run).await, "nothing starts in a stopped conversation");
    }
    // Stopping again finds nothing to do.
    let (code, v) = host.call("POST", &format!("/v1/conversations/{conv}/stop"), None).await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(v, json!({ "cancelled": [], "cancelling": [], "drafts": [] }));
    host.stop().await;
}

/// The article's gap: the running turn finishes (and knocks for the next) at
/// the instant of the stop. Whatever the interleaving, no turn starts after
/// the stop commits: every turn but the first either never started or was
/// already running when the stop took it (then it is in `cancelling`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_racing_the_running_turns_end_never_lets_a_new_turn_start() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let hub = Hub::start(db.url.clone());
    let host = TestHost::start(&db, Some(hub), AgentRegistry::with_builtins(), fast_config("w")).await;
    let (mut first_completed, mut first_cancelled) = (0, 0);
    for i in 0..30u64 {
        let conv = conversation(&host).await;
        // The first turn ends on its own about when the stop lands.
        let step_ms = 10 + (i * 7) % 30;
        let first = post_turn(&host, conv, "sleep", "first", json!({ "steps": 1, "step_ms": step_ms })).await;
        let rest = [
            post_turn(&host, conv, "sleep", "second", json!({ "steps": 1, "step_ms": 30 })).await,
            post_turn(&host, conv, "sleep", "third", json!({ "steps": 1, "step_ms": 30 })).await,
        ];
        // Started (it may already have ended: a short first turn is the point).
        wait_for("the first turn to start", LONG, || async move { started(pool, first).await }).await;
        // Jitter, not synchronisation: it varies which side of the finish the stop lands on.
        tokio::time::sleep(Duration::from_millis((i * 11) % 40)).await;
        let (code, v) = host.call("POST", &format!("/v1/conversations/{conv}/stop"), None).await;
        assert_eq!(code, StatusCode::OK, "{v}");
        let (cancelled, cancelling) = (ids(&v["cancelled"]), ids(&v["cancelling"]));
        let answered: chrono::DateTime<chrono::Utc> =
            sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(pool).await.unwrap();
        match wait_terminal(pool, first, LONG).await.as_str() {
            "completed" => first_completed += 1,
            "cancelled" => first_cancelled += 1,
            other => panic!("first turn ended {other}"),
        }
        for run in rest {
            let state = wait_terminal(pool, run, LONG).await;
            if cancelled.contains(&run) {
                assert_eq!(state, "cancelled");
                assert!(!journal(pool, run).await.iter().any(|(_, t)| t == "run_started"), "iteration {i}");
            } else if !cancelling.contains(&run) {
                // Neither queued nor running when the stop locked the
                // conversation: it had already ended.
                let finished: chrono::DateTime<chrono::Utc> =
                    sqlx::query_scalar("SELECT finished_at FROM agent_run WHERE id = $1")
                        .bind(run)
                        .fetch_one(pool)
                        .await
                        .unwrap();
                assert!(finished < answered, "iteration {i}: run {run} escaped the stop: {v}");
            }
            assert_journal_sound(pool, run).await;
        }
        assert_journal_sound(pool, first).await;
        dispatcher_passed(&host, pool).await;
        for run in rest {
            if cancelled.contains(&run) {
                assert!(!started(pool, run).await, "iteration {i}: a turn started after the stop");
            }
        }
    }
    eprintln!("first turn completed {first_completed} times, cancelled {first_cancelled} times");
    host.stop().await;
}

fn slow_heartbeat() -> WorkerConfig {
    WorkerConfig {
        lease: Duration::from_secs(30),
        heartbeat: Duration::from_secs(10),
        reap_grace: Duration::from_secs(30),
        ..fast_config("w")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_reaches_the_worker_by_notify_long_before_a_heartbeat() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let hub = Hub::start(db.url.clone());
    let host = TestHost::start(&db, Some(hub), AgentRegistry::with_builtins(), slow_heartbeat()).await;
    let conv = conversation(&host).await;
    let run = post_turn(&host, conv, "sleep", "long", json!({ "steps": 10_000, "step_ms": 20 })).await;
    wait_delta(pool, run).await;
    let (code, v) = host.call("POST", &format!("/v1/runs/{run}/cancel"), None).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{v}");
    assert_eq!((v["status"].as_str(), v["cancel_requested"].as_bool()), (Some("running"), Some(true)));
    // The heartbeat is 10 s away: only the NOTIFY can end it this soon.
    assert_eq!(wait_terminal(pool, run, Duration::from_secs(3)).await, "cancelled");
    assert_partial_kept(pool, run).await;
    // Idempotent: a cancel of a terminal run changes nothing.
    let (code, v) = host.call("POST", &format!("/v1/runs/{run}/cancel"), None).await;
    assert_eq!(code, StatusCode::OK, "{v}");
    assert_eq!(v["status"], "cancelled");
    assert_journal_sound(pool, run).await;
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_whose_notify_is_lost_stops_the_run_within_a_heartbeat() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    // The hub is down: no NOTIFY reaches this process.
    let dead = Hub::start("postgres://postgres@127.0.0.1:1/nowhere".into());
    let config = fast_config("w");
    let heartbeat = config.heartbeat;
    let host = TestHost::start(&db, Some(dead), AgentRegistry::with_builtins(), config).await;
    let conv = conversation(&host).await;
    let run = post_turn(&host, conv, "sleep", "long", json!({ "steps": 10_000, "step_ms": 20 })).await;
    wait_delta(pool, run).await;
    let (code, _) = host.call("POST", &format!("/v1/runs/{run}/cancel"), None).await;
    assert_eq!(code, StatusCode::ACCEPTED);
    assert_eq!(wait_terminal(pool, run, heartbeat + Duration::from_secs(1)).await, "cancelled");
    assert_partial_kept(pool, run).await;
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_answers_for_queued_terminal_foreign_and_malformed_runs() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let host = TestHost::builtins(&db).await;
    let conv = conversation(&host).await;
    let a = post_turn(&host, conv, "sleep", "a", json!({ "steps": 10_000, "step_ms": 20 })).await;
    let b = post_turn(&host, conv, "sleep", "b", json!({ "steps": 1 })).await;
    let c = post_turn(&host, conv, "echo", "c says hi", json!({})).await;
    wait_status(pool, a, "running", LONG).await;

    // A queued turn is cancelled outright and handed back as a draft.
    let (code, v) = host.call("POST", &format!("/v1/runs/{b}/cancel"), None).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{v}");
    assert_eq!(v["status"], "cancelled");
    assert_eq!(messages_of(pool, b).await, [("user".into(), "draft".into(), "b".into())]);
    let (code, v) = host.call("POST", &format!("/v1/runs/{b}/cancel"), None).await;
    assert_eq!((code, &v["status"]), (StatusCode::OK, &json!("cancelled")));

    // Someone else's run is not found; a malformed id is a bad request.
    let mallory = tokens::create(pool, "mallory", "acme", false).await.unwrap();
    let (code, v) = host.call_as(&mallory, "POST", &format!("/v1/runs/{a}/cancel"), None).await;
    assert_eq!(code, StatusCode::NOT_FOUND, "{v}");
    let (code, _) = host.call_as(&mallory, "POST", &format!("/v1/conversations/{conv}/stop"), None).await;
    assert_eq!(code, StatusCode::NOT_FOUND);
    let (code, v) = host.call("POST", "/v1/runs/not-a-uuid/cancel", None).await;
    assert_eq!((code, v["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("bad_request")), "{v}");
    let (code, _) = host.call("POST", &format!("/v1/runs/{}/cancel", RunId::new()), None).await;
    assert_eq!(code, StatusCode::NOT_FOUND);
    assert_eq!(status(pool, a).await, "running", "refused cancels changed nothing");

    // Cancelling the running turn frees the turn behind the cancelled one.
    let (code, _) = host.call("POST", &format!("/v1/runs/{a}/cancel"), None).await;
    assert_eq!(code, StatusCode::ACCEPTED);
    assert_eq!(wait_terminal(pool, a, LONG).await, "cancelled");
    assert_eq!(wait_terminal(pool, c, LONG).await, "completed");
    let (code, v) = host.call("POST", &format!("/v1/runs/{c}/cancel"), None).await;
    assert_eq!((code, &v["status"]), (StatusCode::OK, &json!("completed")));
    for run in [a, b, c] {
        assert_journal_sound(pool, run).await;
    }
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_clients_all_disconnect_runs_to_completion() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let host = TestHost::builtins(&db).await;
    let conv = conversation(&host).await;
    let run = post_turn(&host, conv, "sleep", "watch me", json!({ "steps": 8, "step_ms": 50 })).await;
    for _ in 0..3 {
        let mut client = SseClient::connect(&host.events_url(run), &host.token, None).await;
        assert!(client.next(LONG).await.is_some());
        drop(client);
    }
    assert_eq!(wait_terminal(pool, run, LONG).await, "completed");
    let flagged: bool = sqlx::query_scalar("SELECT cancel_requested FROM agent_run WHERE id = $1")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(!flagged, "a closed stream is not a stop");
    let msgs = messages_of(pool, run).await;
    assert_eq!(
        (msgs[1].1.as_str(), msgs[1].2.as_str()),
        ("complete", deltas_text(&journal_payloads(pool, run).await).as_str())
    );
    host.stop().await;
}

/// Guests run by the sandbox: one that honours the stop, one that never looks
/// at it, and one that keeps emitting through the refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guests_stop_cooperatively_or_are_interrupted_after_the_grace() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let cache = std::env::temp_dir().join(format!("agent-host-cache-{}", std::process::id()));
    let sandbox = Sandbox::new(pool.clone(), Some(cache)).unwrap();
    for (name, wasm) in [("echo", "echo"), ("fixtures", "fixtures")] {
        plugins::put(pool, name, &plugin_wasm(wasm), &json!({})).await.unwrap();
    }
    let agents = AgentRegistry::with_builtins().with_sandbox(sandbox);
    let config = fast_config("w");
    let grace = config.cancel_grace;
    let host = TestHost::start(&db, Some(Hub::start(db.url.clone())), agents, config).await;

    let words = "word ".repeat(10_000);
    let cases = [
        ("echo", words.as_str(), json!({ "delay_ms": 20 }), false),
        ("fixtures", "x", json!({ "mode": "narrate" }), true),
        ("fixtures", "x", json!({ "mode": "ignore-cancel" }), true),
    ];
    for (plugin, content, config, forced) in cases {
        let conv = conversation(&host).await;
        let run = post_turn(&host, conv, plugin, content, config.clone()).await;
        wait_status(pool, run, "running", LONG).await;
        if !forced || config["mode"] == "narrate" {
            wait_delta(pool, run).await;
        }
        let asked = Instant::now();
        let (code, _) = host.call("POST", &format!("/v1/runs/{run}/cancel"), None).await;
        assert_eq!(code, StatusCode::ACCEPTED);
        let within = if forced { grace + Duration::from_secs(1) } else { Duration::from_secs(1) };
        assert_eq!(wait_terminal(pool, run, within).await, "cancelled", "{plugin} {config}");
        let took = asked.elapsed();
        let error = run_error(pool, run).await;
        if forced {
            assert!(took >= grace, "{config}: interrupted before the grace ({took:?})");
            assert!(error.contains("interrupted"), "{config}: {error}");
        } else {
            assert_eq!(error, "", "a cooperative guest's stop is not an error");
        }
        if config["mode"] != "ignore-cancel" {
            assert_partial_kept(pool, run).await;
        }
        assert_journal_sound(pool, run).await;
        eprintln!("{plugin} {config}: cancel to terminal {took:?}");
    }
    host.stop().await;
}

/// The retry a person asks for: a new run for the same message, only for a
/// failed or cancelled latest turn; the conversation reads show it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_reruns_the_latest_stopped_turn_and_conversation_reads_show_it() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let host = TestHost::builtins(&db).await;
    let conv = conversation(&host).await;
    let done = post_turn(&host, conv, "echo", "one", json!({})).await;
    assert_eq!(wait_terminal(pool, done, LONG).await, "completed");
    let long = post_turn(&host, conv, "sleep", "two", json!({ "steps": 10_000, "step_ms": 20 })).await;
    wait_status(pool, long, "running", LONG).await;
    let queued = post_turn(&host, conv, "echo", "three", json!({})).await;

    let (code, v) = host.call("GET", &format!("/v1/conversations/{conv}"), None).await;
    assert_eq!(code, StatusCode::OK, "{v}");
    assert_eq!(v["active_run_id"], json!(long.to_string()));
    assert_eq!(v["queued_run_ids"], json!([queued.to_string()]));

    // Not terminal, not latest: refused with reasons.
    let (code, v) = host.call("POST", &format!("/v1/runs/{long}/retry"), None).await;
    assert_eq!(code, StatusCode::CONFLICT, "{v}");
    let (code, v) = host.call("POST", &format!("/v1/runs/{done}/retry"), None).await;
    assert_eq!(code, StatusCode::CONFLICT, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("failed or cancelled"), "{v}");

    // Stopped once it has streamed: its partial answer is part of the transcript.
    wait_delta(pool, long).await;
    let (code, _) = host.call("POST", &format!("/v1/conversations/{conv}/stop"), None).await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(wait_terminal(pool, long, LONG).await, "cancelled");
    // `long` is no longer the latest turn (`queued` came after it).
    let (code, _) = host.call("POST", &format!("/v1/runs/{long}/retry"), None).await;
    assert_eq!(code, StatusCode::CONFLICT);
    // The cancelled queued turn is: retry it, concurrently, twice.
    let path = format!("/v1/runs/{queued}/retry");
    let (a, b) = tokio::join!(host.call("POST", &path, None), host.call("POST", &path, None));
    let mut codes = [a.0, b.0];
    codes.sort();
    assert_eq!(codes, [StatusCode::ACCEPTED, StatusCode::CONFLICT], "exactly one retry wins: {a:?} {b:?}");
    let retried = if a.0 == StatusCode::ACCEPTED { a.1 } else { b.1 };
    let again: RunId = retried["run_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(retried["status"], "queued");
    assert_eq!(wait_terminal(pool, again, LONG).await, "completed");

    let (code, v) = host.call("GET", &format!("/v1/conversations/{conv}/messages"), None).await;
    assert_eq!(code, StatusCode::OK, "{v}");
    let transcript: Vec<(String, String, String)> = v["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().into(),
                m["status"].as_str().unwrap().into(),
                m["content"].as_str().unwrap().into(),
            )
        })
        .collect();
    let partial = deltas_text(&journal_payloads(pool, long).await);
    let want: Vec<(String, String, String)> = [
        ("user", "complete", "one"),
        ("assistant", "complete", "one"),
        ("user", "complete", "two"),
        ("assistant", "partial", partial.as_str()),
        ("user", "complete", "three"),
        ("assistant", "complete", "three"),
    ]
    .iter()
    .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
    .collect();
    assert_eq!(transcript, want);
    // The history the third turn's agent sees: every earlier turn with its
    // answer, though "three" was posted before "two" had answered.
    let three: agent_host::db::MessageId = retried["user_message_id"].as_str().unwrap().parse().unwrap();
    let history = agent_host::db::conversations::history(pool, conv, three, 200).await.unwrap();
    let want_history: Vec<(String, String)> = want[..4].iter().map(|(r, _, c)| (r.clone(), c.clone())).collect();
    assert_eq!(history, want_history);
    let mallory = tokens::create(pool, "mallory", "acme", false).await.unwrap();
    for path in [format!("/v1/conversations/{conv}"), format!("/v1/conversations/{conv}/messages")] {
        assert_eq!(host.call_as(&mallory, "GET", &path, None).await.0, StatusCode::NOT_FOUND);
    }
    assert_eq!(host.call_as(&mallory, "POST", &path, None).await.0, StatusCode::NOT_FOUND);
    host.stop().await;
}
