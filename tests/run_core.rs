//! The run core against a real PostgreSQL: enqueue, claim, fence, heartbeat,
//! reaper, backstop, wake chain, drain. Each test reproduces a failure the
//! reference article names and shows the mechanism holds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;
use agent_host::agent::{Agent, AgentError, AgentRegistry, RunHost, RunInput};
use agent_host::db::enqueue;
use agent_host::db::journal;
use agent_host::db::lifecycle::{self, Claim, Finish};
use agent_host::db::notify::RUN_ENQUEUED;
use agent_host::db::{MessageStatus, RunId, RunStatus};
use agent_host::hub::Hub;
use agent_host::worker::{self, Worker, WorkerConfig, WorkerStats};
use async_trait::async_trait;
use serde_json::json;
use sqlx::postgres::PgListener;

#[tokio::test]
async fn enqueue_commits_message_run_journal_and_wake_together() {
    let db = TestDb::new().await;
    let mut listener = PgListener::connect(&db.url).await.unwrap();
    listener.listen(RUN_ENQUEUED).await.unwrap();

    let e = enqueue(&db.pool, None, "noop", json!({})).await;
    assert_eq!(e.status, RunStatus::Queued);

    let n = tokio::time::timeout(LONG, listener.recv()).await.unwrap().unwrap();
    assert_eq!(n.payload(), e.conversation_id.to_string());
    let (status, snapshot): (String, serde_json::Value) =
        sqlx::query_as("SELECT status, request FROM agent_run WHERE id = $1")
            .bind(e.run_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(status, "queued");
    assert_eq!(snapshot["plugin"], "noop");
    let msg: (String, String) = sqlx::query_as("SELECT role, status FROM message WHERE id = $1")
        .bind(e.user_message_id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(msg, ("user".into(), "queued".into()));
    assert_eq!(journal(&db.pool, e.run_id).await, vec![(1, "user_message_created".into()), (2, "run_queued".into())]);
}

/// A turn posted to a conversation that is not the poster's (or does not
/// exist) is refused as not found and writes nothing: the enqueue's one
/// statement finds no conversation to write into. A new turn of the
/// owner's conversation follows its first.
#[tokio::test]
async fn a_turn_for_another_users_conversation_is_not_found_and_writes_nothing() {
    let db = TestDb::new().await;
    let first = enqueue(&db.pool, None, "noop", json!({})).await;
    let bob = enqueue::Owner { user_id: "bob".into(), tenant_id: "acme".into() };
    let missing = agent_host::db::ConversationId::new();
    for conversation in [first.conversation_id, missing] {
        match try_enqueue_as(&db.pool, &bob, Some(conversation), "noop", json!({})).await {
            Err(enqueue::EnqueueError::ConversationNotFound(c)) => assert_eq!(c, conversation),
            other => panic!("{other:?}"),
        }
    }
    for (table, rows) in [("conversation", 1), ("message", 1), ("agent_run", 1), ("run_event", 2)] {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}")).fetch_one(&db.pool).await.unwrap();
        assert_eq!(n, rows, "{table}");
    }
    let second = enqueue(&db.pool, Some(first.conversation_id), "noop", json!({})).await;
    assert_eq!(second.conversation_id, first.conversation_id);
    let turns: Vec<RunId> =
        sqlx::query_scalar("SELECT id FROM agent_run WHERE conversation_id = $1 ORDER BY queue_pos")
            .bind(first.conversation_id)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(turns, vec![first.run_id, second.run_id]);
    assert_eq!(
        journal(&db.pool, second.run_id).await,
        vec![(1, "user_message_created".into()), (2, "run_queued".into())]
    );
}

#[tokio::test]
async fn failed_enqueue_leaves_nothing_and_wakes_nobody() {
    let db = TestDb::new().await;
    // Make the last insert of the enqueue transaction fail.
    fail_inserts(&db.pool, "fail_insert", "fail_journal", "run_event", "injected failure").await;
    let mut listener = PgListener::connect(&db.url).await.unwrap();
    listener.listen(RUN_ENQUEUED).await.unwrap();

    let owner = owner();
    let config = json!({});
    let err = enqueue::enqueue(
        &db.pool,
        &enqueue::NewRun {
            owner: &owner,
            conversation_id: None,
            content: "lost",
            plugin: "noop",
            plugin_digest: None,
            plugin_manifest: None,
            config: &config,
            request: &config,
            idempotency_key: None,
            webhook: None,
            parent: None,
        },
    )
    .await;
    assert!(err.is_err());
    for table in ["conversation", "message", "agent_run", "run_event"] {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}")).fetch_one(&db.pool).await.unwrap();
        assert_eq!(n, 0, "{table} kept a row of a rolled-back enqueue");
    }
    // Notifications arrive in commit order: if the failed enqueue had woken
    // anyone, its wake would come before this one.
    sqlx::raw_sql("DROP TRIGGER fail_journal ON run_event").execute(&db.pool).await.unwrap();
    let ok = enqueue(&db.pool, None, "noop", json!({})).await;
    let n = tokio::time::timeout(LONG, listener.recv()).await.unwrap().unwrap();
    assert_eq!(n.payload(), ok.conversation_id.to_string());
}

/// A run enqueued, claimed and completed with an answer ("done").
async fn completed_run(db: &TestDb) -> enqueue::Enqueued {
    let e = enqueue(&db.pool, None, "noop", json!({})).await;
    let claimed = lifecycle::claim(&db.pool, &claim_args("w", 1, true)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    let finish = Finish {
        status: RunStatus::Completed,
        error: None,
        assistant: Some(("done", MessageStatus::Complete)),
        usage: None,
    };
    assert!(lifecycle::finish(&db.pool, e.run_id, claimed[0].claim_token, &finish).await.unwrap());
    e
}

#[tokio::test]
async fn terminal_states_are_sticky_in_the_schema() {
    let db = TestDb::new().await;
    let e = completed_run(&db).await;
    // Each refused by the schema: a terminal -> terminal change by the
    // transition trigger; running and queued already by the CHECK that ties
    // `finished_at` to a terminal status (it runs before the AFTER trigger,
    // migrations/0013). The same change with `finished_at` cleared, which
    // passes every CHECK, is refused by the trigger.
    for (to, set, refused_by) in [
        ("running", "", "agent_run_check1"),
        ("queued", "", "agent_run_check1"),
        ("failed", "", "agent_run_status_transition"),
        ("cancelled", "", "agent_run_status_transition"),
        ("running", ", finished_at = NULL", "agent_run_status_transition"),
        (
            "queued",
            ", finished_at = NULL, claim_expires_at = NULL, attempt = attempt + 1",
            "agent_run_status_transition",
        ),
    ] {
        let r = sqlx::query(&format!("UPDATE agent_run SET status = $2{set} WHERE id = $1"))
            .bind(e.run_id)
            .bind(to)
            .execute(&db.pool)
            .await;
        match r {
            Err(sqlx::Error::Database(d)) => {
                assert_eq!(d.code().as_deref(), Some("23514"), "{to}{set}: {d}");
                assert_eq!(d.constraint(), Some(refused_by), "{to}{set}: {d}");
            }
            other => panic!("leaving a terminal state for {to}{set} must fail: {other:?}"),
        }
    }
    let (status, finished): (String, bool) =
        sqlx::query_as("SELECT status, finished_at IS NOT NULL FROM agent_run WHERE id = $1")
            .bind(e.run_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((status.as_str(), finished), ("completed", true));
    // A second ending cannot be written even by hand.
    let r = sqlx::query("INSERT INTO run_event (run_id, seq, type, payload) VALUES ($1, 99, 'complete', '{}')")
        .bind(e.run_id)
        .execute(&db.pool)
        .await;
    assert!(r.is_err());
}

/// The journal's and the transcript's inserts run no foreign-key check
/// (migrations/0014): what keeps an event from outliving its run, or a
/// message its conversation, is that neither parent is ever deleted, and the
/// schema refuses the DELETE, whatever its WHERE.
#[tokio::test]
async fn runs_and_conversations_are_never_deleted_so_no_event_or_message_is_orphaned() {
    let db = TestDb::new().await;
    let e = completed_run(&db).await;
    for (sql, table) in [
        ("DELETE FROM agent_run WHERE id = $1", "agent_run"),
        ("DELETE FROM agent_run WHERE id <> $1", "agent_run"),
        ("DELETE FROM conversation WHERE id = (SELECT conversation_id FROM agent_run WHERE id = $1)", "conversation"),
    ] {
        match sqlx::query(sql).bind(e.run_id).execute(&db.pool).await {
            Err(sqlx::Error::Database(d)) => {
                assert_eq!(d.code().as_deref(), Some("23001"), "{sql}: {d}");
                assert!(d.message().starts_with(&format!("{table}: rows are never deleted")), "{sql}: {d}");
            }
            other => panic!("{sql} must be refused: {other:?}"),
        }
    }
    let journal = assert_journal_sound(&db.pool, e.run_id).await;
    assert_eq!(journal.last().map(|(_, t)| t.as_str()), Some("complete"));
    let messages: i64 = sqlx::query_scalar("SELECT count(*) FROM message WHERE conversation_id = $1")
        .bind(e.conversation_id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(messages, 2, "the question and the answer");
    assert_no_orphans(&db.pool).await;
}

#[tokio::test]
async fn claim_stamps_the_lease_and_journals_run_started() {
    let db = TestDb::new().await;
    let e = enqueue(&db.pool, None, "noop", json!({"k": 1})).await;
    let claimed = lifecycle::claim(&db.pool, &claim_args("w1", 5, true)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    let c = &claimed[0];
    assert_eq!((c.id, c.content.as_str(), c.config["k"].as_i64()), (e.run_id, "hello agent", Some(1)));
    let (worker, lease_s, msg_status): (String, f64, String) = sqlx::query_as(
        "SELECT r.worker_id, extract(epoch FROM r.claim_expires_at - r.last_heartbeat_at)::float8, m.status
         FROM agent_run r JOIN message m ON m.id = r.user_message_id WHERE r.id = $1",
    )
    .bind(e.run_id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(worker, "w1");
    assert!((lease_s - 30.0).abs() < 0.01, "lease {lease_s}");
    assert_eq!(msg_status, "complete");
    assert_eq!(journal(&db.pool, e.run_id).await.last().unwrap(), &(3, "run_started".to_string()));
    // Nothing left to claim.
    assert!(lifecycle::claim(&db.pool, &claim_args("w2", 5, true)).await.unwrap().is_empty());
}

#[tokio::test]
async fn two_turns_of_one_conversation_never_run_together() {
    let db = TestDb::new().await;
    let t1 = enqueue(&db.pool, None, "noop", json!({})).await;
    let t2 = enqueue(&db.pool, Some(t1.conversation_id), "noop", json!({})).await;

    // Turn 1 is claimed; turn 2 waits behind it whatever the claimer does.
    let first = lifecycle::claim(&db.pool, &claim_args("a", 10, true)).await.unwrap();
    assert_eq!(first.iter().map(|c| c.id).collect::<Vec<_>>(), vec![t1.run_id]);
    assert!(lifecycle::claim(&db.pool, &claim_args("b", 10, true)).await.unwrap().is_empty());

    // Without the pre-filter, the claimer reaches for turn 2 and the partial
    // unique index turns it away: "claimed nothing this round", not a second
    // running turn.
    let err = lifecycle::claim(&db.pool, &claim_args("c", 10, false)).await.unwrap_err();
    assert!(lifecycle::is_running_conflict(&err), "{err}");
    assert_eq!(status(&db.pool, t2.run_id).await, "queued");

    // Once turn 1 ends, turn 2 is claimable.
    let finish = Finish { status: RunStatus::Completed, error: None, assistant: None, usage: None };
    assert!(lifecycle::finish(&db.pool, t1.run_id, first[0].claim_token, &finish).await.unwrap());
    let next = lifecycle::claim(&db.pool, &claim_args("b", 10, false)).await.unwrap();
    assert_eq!(next.iter().map(|c| c.id).collect::<Vec<_>>(), vec![t2.run_id]);
}

/// Many claimers racing without the pre-filter over conversations of several
/// turns: the index alone keeps one running turn per conversation, and turns
/// run in their order.
#[tokio::test]
async fn racing_claimers_without_prefilter_keep_one_turn_per_conversation() {
    let db = TestDb::new().await;
    let mut order: HashMap<RunId, (uuid::Uuid, usize)> = HashMap::new();
    for _ in 0..20 {
        let mut conv = None;
        for turn in 0..4 {
            let e = enqueue(&db.pool, conv, "noop", json!({})).await;
            conv = Some(e.conversation_id);
            order.insert(e.run_id, (e.conversation_id.0, turn));
        }
    }
    let running: Arc<Mutex<HashMap<uuid::Uuid, RunId>>> = Default::default();
    let finished: Arc<Mutex<Vec<RunId>>> = Default::default();
    let conflicts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..6 {
        let pool = db.pool(2).await;
        let (running, finished, conflicts) = (running.clone(), finished.clone(), conflicts.clone());
        tasks.push(tokio::spawn(async move {
            let id = format!("w{w}");
            let mut empty_rounds = 0;
            while empty_rounds < 50 {
                let claimed = match lifecycle::claim(&pool, &claim_args(&id, 3, false)).await {
                    Ok(c) => c,
                    Err(e) if lifecycle::is_running_conflict(&e) => {
                        conflicts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        continue;
                    }
                    Err(e) => panic!("{e}"),
                };
                if claimed.is_empty() {
                    empty_rounds += 1;
                    tokio::task::yield_now().await;
                    continue;
                }
                empty_rounds = 0;
                for c in &claimed {
                    let prev = running.lock().unwrap().insert(c.conversation_id.0, c.id);
                    assert!(prev.is_none(), "two running turns in conversation {}", c.conversation_id);
                }
                for c in claimed {
                    running.lock().unwrap().remove(&c.conversation_id.0);
                    finished.lock().unwrap().push(c.id);
                    let finish = Finish { status: RunStatus::Completed, error: None, assistant: None, usage: None };
                    assert!(lifecycle::finish(&pool, c.id, c.claim_token, &finish).await.unwrap());
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let finished = finished.lock().unwrap().clone();
    assert_eq!(finished.len(), order.len(), "every run claimed exactly once");
    // Turns finished in their order within each conversation.
    let mut last_turn: HashMap<uuid::Uuid, usize> = HashMap::new();
    let rows: Vec<(RunId,)> =
        sqlx::query_as("SELECT id FROM agent_run ORDER BY finished_at, started_at").fetch_all(&db.pool).await.unwrap();
    for (id,) in rows {
        let (conv, turn) = order[&id];
        if let Some(prev) = last_turn.insert(conv, turn) {
            assert!(prev < turn, "turn {turn} of {conv} finished before turn {prev}");
        }
    }
}

/// Counts executions per run, so a double claim would show.
struct Counting(Arc<Mutex<HashMap<RunId, usize>>>);

#[async_trait]
impl Agent for Counting {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        *self.0.lock().unwrap().entry(input.run_id).or_default() += 1;
        host.emit_delta("x").await?;
        Ok("done".into())
    }
}

#[tokio::test]
async fn racing_dispatchers_execute_every_run_exactly_once() {
    let db = TestDb::new().await;
    let counts: Arc<Mutex<HashMap<RunId, usize>>> = Default::default();
    let mut agents = AgentRegistry::with_builtins();
    agents.insert("count", Arc::new(Counting(counts.clone())));
    let mut ids = Vec::new();
    for i in 0..300 {
        // 100 conversations of three turns each.
        let conv = if i % 3 == 0 { None } else { Some(ids.last().map(|(_, c)| *c).unwrap()) };
        let e = enqueue(&db.pool, conv, "count", json!({})).await;
        ids.push((e.run_id, e.conversation_id));
    }
    let mut workers = Vec::new();
    for w in 0..4 {
        let pool = db.pool(6).await;
        let hub = Hub::start(db.url.clone());
        workers.push(Worker::start(pool, Some(hub), agents.clone(), fast_config(&format!("w{w}"))).await.unwrap());
    }
    let pool = db.pool.clone();
    wait_for("every run to complete", Duration::from_secs(60), || {
        let pool = pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE status = 'completed'")
                .fetch_one(&pool)
                .await
                .unwrap();
            n == 300
        }
    })
    .await;
    let claimed: u64 = workers.iter().map(|w| w.stats().claimed.load(std::sync::atomic::Ordering::Relaxed)).sum();
    for w in workers {
        w.drain().await;
    }
    let counts = counts.lock().unwrap().clone();
    assert_eq!(counts.len(), 300);
    assert!(counts.values().all(|&n| n == 1), "a run executed twice: {counts:?}");
    assert_eq!(claimed, 300);
    for (id, _) in &ids {
        let j = assert_journal_sound(&db.pool, *id).await;
        assert_eq!(j.last().unwrap().1, "complete");
    }
    let assistant: i64 =
        sqlx::query_scalar("SELECT count(*) FROM message WHERE role = 'assistant' AND status = 'complete'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(assistant, 300);
}

/// The second zombie, made deterministic: the reaper reads the orphan list,
/// then the worker's heartbeat lands, then the reap fires. The reap re-checks
/// the lease in its write and changes nothing.
#[tokio::test]
async fn heartbeat_between_reaper_read_and_write_keeps_the_run() {
    let db = TestDb::new().await;
    let e = enqueue(&db.pool, None, "noop", json!({})).await;
    // A lease of zero: expired the moment it is written.
    let c = claim_one(&db.pool, "slow", Duration::ZERO).await;
    let expired = lifecycle::find_expired(&db.pool, Duration::ZERO, 10).await.unwrap();
    assert_eq!(expired.iter().map(|x| x.id).collect::<Vec<_>>(), vec![e.run_id]);

    // The worker comes back from its pause: its heartbeat lands.
    let alive = lifecycle::heartbeat(&db.pool, &[(c.id, c.claim_token)], Duration::from_secs(30)).await.unwrap();
    assert_eq!(alive, vec![(c.id, false)]);

    // The reap built on the stale read is a no-op.
    assert!(!lifecycle::reap(&db.pool, expired[0], Duration::ZERO).await.unwrap());
    assert_eq!(status(&db.pool, e.run_id).await, "running");
    let finish = Finish {
        status: RunStatus::Completed,
        error: None,
        assistant: Some(("ok", MessageStatus::Complete)),
        usage: None,
    };
    assert!(lifecycle::finish(&db.pool, c.id, c.claim_token, &finish).await.unwrap());
    assert_eq!(journal(&db.pool, e.run_id).await.iter().filter(|(_, t)| t == "complete").count(), 1);
}

/// A beat never waits on a row another transaction holds (an ending in
/// flight, a stop): it skips the row this time, reports it held as its
/// snapshot sees it, and renews it on a later beat. The ending takes no
/// explicit row locks, in no particular order; a beat that waited on it could
/// deadlock with it. A journal append in flight (its foreign-key check holds
/// the run's row in KEY SHARE) does not make the beat skip.
#[tokio::test]
async fn a_heartbeat_skips_a_row_an_ending_holds_and_never_waits_for_it() {
    let db = TestDb::new().await;
    enqueue(&db.pool, None, "noop", json!({})).await;
    enqueue(&db.pool, None, "noop", json!({})).await;
    let ending = claim_one(&db.pool, "w", Duration::from_secs(30)).await;
    let streaming = claim_one(&db.pool, "w", Duration::from_secs(30)).await;
    let held = [(ending.id, ending.claim_token), (streaming.id, streaming.claim_token)];
    // Leases renewed by a beat reach ten minutes ahead; the claims' reach 30 s.
    let renewed = |pool: sqlx::PgPool| async move {
        let rows: Vec<(RunId, bool)> = sqlx::query_as(
            "SELECT id, claim_expires_at > now() + interval '300 seconds' FROM agent_run
             WHERE status = 'running' ORDER BY id",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        rows.into_iter().collect::<HashMap<_, _>>()
    };
    // A transaction that wrote `sql` for the run `id` and stays open.
    let in_flight = |sql: &'static str, id: RunId| {
        let pool = db.pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query(sql).bind(id).execute(&mut *tx).await.unwrap();
            tx
        }
    };
    // An ending in flight: an update of the row, not committed.
    let end_tx = in_flight("UPDATE agent_run SET error = error WHERE id = $1", ending.id).await;
    // A journal append in flight on the other run.
    let append_tx = in_flight(
        "INSERT INTO run_event (run_id, seq, type, payload) VALUES ($1, 4, 'content_delta', '{}')",
        streaming.id,
    )
    .await;

    let beat = lifecycle::heartbeat(&db.pool, &held, Duration::from_secs(600));
    // Well inside the pool's idle-in-transaction timeout (10 s), which would
    // end the two transactions and free a beat that waited.
    let mut alive =
        tokio::time::timeout(Duration::from_secs(5), beat).await.expect("a beat waited on a held row").unwrap();
    alive.sort();
    let mut both = vec![(ending.id, false), (streaming.id, false)];
    both.sort();
    assert_eq!(alive, both, "a skipped row is still reported held");
    let leases = renewed(db.pool.clone()).await;
    assert!(!leases[&ending.id], "the row the ending holds is skipped this beat");
    assert!(leases[&streaming.id], "a journal append does not make the beat skip");

    end_tx.rollback().await.unwrap();
    append_tx.rollback().await.unwrap();
    let mut alive = lifecycle::heartbeat(&db.pool, &held, Duration::from_secs(600)).await.unwrap();
    alive.sort();
    assert_eq!(alive, both);
    assert!(renewed(db.pool.clone()).await.values().all(|r| *r), "the next beat renews it");
}

/// The first zombie: a worker reaped while paused wakes and tries to narrate
/// and to finish. Every write is fenced: nothing changes, one ending.
#[tokio::test]
async fn reaped_worker_writes_change_nothing() {
    let db = TestDb::new().await;
    let e = enqueue(&db.pool, None, "noop", json!({})).await;
    let c = claim_one(&db.pool, "zombie", Duration::ZERO).await;
    assert!(journal::append_events(
        &db.pool,
        c.id,
        c.claim_token,
        4,
        &[("content_delta", json!({"delta": "a"}))],
        None
    )
    .await
    .unwrap());
    let expired = lifecycle::find_expired(&db.pool, Duration::ZERO, 10).await.unwrap();
    assert!(lifecycle::reap(&db.pool, expired[0], Duration::ZERO).await.unwrap());
    let after_reap = journal(&db.pool, e.run_id).await;
    assert_eq!(after_reap.last().unwrap(), &(5, "complete".to_string()));

    // The zombie resumes.
    assert!(!journal::append_events(
        &db.pool,
        c.id,
        c.claim_token,
        5,
        &[("content_delta", json!({"delta": "b"}))],
        None
    )
    .await
    .unwrap());
    assert!(lifecycle::heartbeat(&db.pool, &[(c.id, c.claim_token)], Duration::from_secs(30))
        .await
        .unwrap()
        .is_empty());
    let finish = Finish {
        status: RunStatus::Completed,
        error: None,
        assistant: Some(("late", MessageStatus::Complete)),
        usage: None,
    };
    assert!(!lifecycle::finish(&db.pool, c.id, c.claim_token, &finish).await.unwrap());

    assert_eq!(status(&db.pool, e.run_id).await, "failed");
    assert_eq!(journal(&db.pool, e.run_id).await, after_reap);
    let assistant: i64 =
        sqlx::query_scalar("SELECT count(*) FROM message WHERE role = 'assistant'").fetch_one(&db.pool).await.unwrap();
    assert_eq!(assistant, 0);
    let error = run_error(&db.pool, e.run_id).await;
    assert!(error.contains("worker lost") && error.contains("zombie"), "{error}");
}

/// A worker whose run is reaped under it learns from its next heartbeat and
/// stops the run at once, writing nothing more.
#[tokio::test]
async fn worker_stops_a_run_whose_claim_was_lost() {
    let db = TestDb::new().await;
    let e = enqueue(&db.pool, None, "sleep", json!({ "steps": 10_000, "step_ms": 20 })).await;
    let mut config = fast_config("victim");
    config.reap_interval = Duration::from_secs(3600); // only the test reaps here
    let w = Worker::start(db.pool.clone(), None, AgentRegistry::with_builtins(), config).await.unwrap();
    wait_status(&db.pool, e.run_id, "running", LONG).await;

    // Someone decided the worker was dead: its lease is forced into the past
    // and another process's reaper ends the run.
    update_run(&db.pool, e.run_id, "claim_expires_at = now() - interval '1 hour'").await;
    let stats = WorkerStats::default();
    assert_eq!(
        worker::reap_sweep(
            &db.pool,
            &worker::WorkerConfig { reap_grace: Duration::ZERO, ..Default::default() },
            &stats
        )
        .await
        .unwrap(),
        1
    );

    wait_fenced(&w, "the worker to stand down").await;
    assert_eq!(status(&db.pool, e.run_id).await, "failed");
    assert_journal_sound(&db.pool, e.run_id).await;
    w.drain().await;
}

struct Panics;

#[async_trait]
impl Agent for Panics {
    async fn run(&self, _host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        panic!("agent bug");
    }
}

struct Fails;

#[async_trait]
impl Agent for Fails {
    async fn run(&self, host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        host.emit_delta("partial ").await?;
        Err(AgentError::failed(agent_host::error::FailReason::Agent, "model unavailable"))
    }
}

#[tokio::test]
async fn backstop_ends_a_panicked_run_failed_and_errors_keep_partial_text() {
    let db = TestDb::new().await;
    let mut agents = AgentRegistry::with_builtins();
    agents.insert("panics", Arc::new(Panics));
    agents.insert("fails", Arc::new(Fails));
    let p = enqueue(&db.pool, None, "panics", json!({})).await;
    let f = enqueue(&db.pool, None, "fails", json!({})).await;
    let w = start_worker_with(&db, agents, fast_config("w")).await;
    wait_status(&db.pool, p.run_id, "failed", LONG).await;
    wait_status(&db.pool, f.run_id, "failed", LONG).await;
    let panicked = run_error(&db.pool, p.run_id).await;
    assert!(panicked.contains("panicked"), "{panicked}");
    assert!(run_error(&db.pool, f.run_id).await.contains("model unavailable"));
    assert_eq!(w.stats().backstopped.load(std::sync::atomic::Ordering::Relaxed), 1);
    let partial: (String, String) =
        sqlx::query_as("SELECT content, status FROM message WHERE run_id = $1 AND role = 'assistant'")
            .bind(f.run_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(partial, ("partial ".into(), "partial".into()));
    for id in [p.run_id, f.run_id] {
        let j = assert_journal_sound(&db.pool, id).await;
        assert_eq!(j.last().unwrap().1, "complete");
    }
    w.drain().await;
}

/// Every terminal path knocks on the queue: the next turn of a conversation
/// starts on the wake, not on the poll tick (set to a minute here).
#[tokio::test]
async fn wake_chain_starts_the_next_turn_without_waiting_for_the_tick() {
    let db = TestDb::new().await;
    let mut config = fast_config("w");
    config.poll_tick = Duration::from_secs(60);
    let w = start_worker(&db, config).await;
    let t1 = enqueue(&db.pool, None, "sleep", json!({ "steps": 2, "step_ms": 50 })).await;
    let t2 = enqueue(&db.pool, Some(t1.conversation_id), "echo", json!({})).await;
    let t3 = enqueue(&db.pool, Some(t1.conversation_id), "echo", json!({})).await;
    // Far below the one-minute tick: only the wake chain can do this.
    wait_status(&db.pool, t3.run_id, "completed", Duration::from_secs(10)).await;
    for id in [t1.run_id, t2.run_id] {
        assert_eq!(status(&db.pool, id).await, "completed");
    }
    w.drain().await;
}

#[tokio::test]
async fn drain_lets_short_runs_finish_and_ends_long_ones_failed() {
    let db = TestDb::new().await;
    let mut config = fast_config("w");
    config.drain_timeout = Duration::from_millis(1_500);
    let w = start_worker(&db, config).await;
    let short = enqueue(&db.pool, None, "sleep", json!({ "steps": 5, "step_ms": 100 })).await;
    let long = enqueue(&db.pool, None, "sleep", json!({ "steps": 1000, "step_ms": 100 })).await;
    wait_status(&db.pool, short.run_id, "running", LONG).await;
    wait_status(&db.pool, long.run_id, "running", LONG).await;
    let report = w.drain().await;
    assert!(!report.finished_in_budget);
    assert_eq!(report.aborted, 1);
    assert_eq!(status(&db.pool, short.run_id).await, "completed");
    assert_eq!(status(&db.pool, long.run_id).await, "failed");
    let error = run_error(&db.pool, long.run_id).await;
    assert!(error.contains("drain timeout"), "{error}");
    // Phase 1 stopped claiming: a run queued now stays queued.
    let after = enqueue(&db.pool, None, "noop", json!({})).await;
    assert_eq!(status(&db.pool, after.run_id).await, "queued");
}

/// Restart after every process died: the boot sweep ends orphans before the
/// new process does anything else.
#[tokio::test]
async fn boot_reconciler_ends_orphans_of_a_dead_cluster() {
    let db = TestDb::new().await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(enqueue(&db.pool, None, "noop", json!({})).await.run_id);
    }
    // Claimed by processes that no longer exist, with leases long lapsed.
    lifecycle::claim(
        &db.pool,
        &Claim {
            limit: 3,
            lease: Duration::ZERO,
            worker_id: "gone",
            prefilter: true,
            tenant_max_running: None,
            rooms: Default::default(),
        },
    )
    .await
    .unwrap();
    let mut config = fast_config("reborn");
    config.reap_interval = Duration::from_secs(3600);
    config.reap_grace = Duration::ZERO;
    config.dispatch = false;
    let w = Worker::start(db.pool.clone(), None, AgentRegistry::with_builtins(), config).await.unwrap();
    for id in &ids {
        assert_eq!(status(&db.pool, *id).await, "failed");
        assert_journal_sound(&db.pool, *id).await;
    }
    w.drain().await;
}

#[test]
fn config_is_validated() {
    let mut c = WorkerConfig::default();
    c.validate().unwrap();
    c.heartbeat = c.lease;
    assert!(matches!(c.validate(), Err(worker::ConfigError::HeartbeatNotBelowLease { .. })));
    let c = WorkerConfig { max_runs: 0, ..WorkerConfig::default() };
    assert!(c.validate().is_err());
}

/// The wake chain's race, made deterministic: the next turn's enqueue commits
/// after the finishing run's terminal write took its snapshot but before it
/// committed. The next turn's own wake finds its conversation still running,
/// and the terminal write could not see it: only the post-commit wake starts
/// it before the (one-minute) tick.
#[tokio::test]
async fn next_turn_enqueued_during_the_terminal_write_still_starts_at_once() {
    let db = TestDb::new().await;
    let mut config = fast_config("w");
    config.poll_tick = Duration::from_secs(60);
    config.heartbeat = Duration::from_millis(900); // keep the heartbeat out of the way
    let w = start_worker(&db, config).await;
    let t1 = enqueue(&db.pool, None, "sleep", json!({ "steps": 3, "step_ms": 100 })).await;
    wait_status(&db.pool, t1.run_id, "running", LONG).await;

    // Hold the run's row so its terminal write blocks after taking its snapshot.
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM agent_run WHERE id = $1 FOR SHARE").bind(t1.run_id).execute(&mut *holder).await.unwrap();
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *holder).await.unwrap();
    // The one session waiting on our lock is the terminal write (the run's
    // own appends are done: the sleep agent has returned once it waits).
    let pool = db.pool.clone();
    wait_for("the terminal write to block", LONG, || {
        let pool = pool.clone();
        async move {
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))")
                    .bind(holder_pid)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            n == 1
        }
    })
    .await;
    let stats = w.stats();
    let rounds = stats.claim_rounds.load(std::sync::atomic::Ordering::SeqCst);
    let t2 = enqueue(&db.pool, Some(t1.conversation_id), "echo", json!({})).await;
    // t2's own wake reached the dispatcher, whose claim found its conversation busy.
    wait_for("the dispatcher to answer t2's wake", LONG, || {
        let stats = stats.clone();
        async move { stats.claim_rounds.load(std::sync::atomic::Ordering::SeqCst) > rounds }
    })
    .await;
    assert_eq!(status(&db.pool, t2.run_id).await, "queued");
    holder.commit().await.unwrap();

    wait_status(&db.pool, t1.run_id, "completed", LONG).await;

    wait_status(&db.pool, t2.run_id, "completed", Duration::from_secs(10)).await;
    w.drain().await;
}

async fn wait_all(pool: &sqlx::PgPool, ids: &[RunId], want: &str) {
    for id in ids {
        wait_status(pool, *id, want, Duration::from_secs(60)).await;
    }
}

/// One busy tenant cannot starve another: runs of a trickle tenant, enqueued
/// behind a flood, start within a bounded number of claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_cannot_starve_a_trickle() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let quick = json!({ "steps": 1, "step_ms": 10 });
    let mut flood = Vec::new();
    for _ in 0..200 {
        flood.push(enqueue_as(pool, &tenant("flood"), None, "sleep", quick.clone()).await.run_id);
    }
    let config = WorkerConfig { max_runs: 2, ..fast_config("w") };
    let w = start_worker(&db, config).await;
    wait_all(pool, &flood[..10], "completed").await;
    let mut trickle = Vec::new();
    for _ in 0..5 {
        trickle.push(enqueue_as(pool, &tenant("trickle"), None, "sleep", quick.clone()).await.run_id);
    }
    wait_all(pool, &trickle, "completed").await;
    // Starts after the trickle arrived, in claim order.
    let order: Vec<(RunId, String)> = sqlx::query_as(
        "SELECT id, tenant_id FROM agent_run
         WHERE started_at >= (SELECT min(created_at) FROM agent_run WHERE tenant_id = 'trickle')
         ORDER BY started_at, queue_pos",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let last = order.iter().rposition(|(_, t)| t == "trickle").unwrap();
    eprintln!("the trickle's 5 runs started within the first {} starts after it arrived", last + 1);
    // Least-loaded tenant first: with two slots the tenants alternate, so the
    // trickle is through in about twice its own length, not behind 190 runs.
    assert!(last < 13, "trickle starved: {:?}", order.iter().map(|(_, t)| t.as_str()).collect::<Vec<_>>());
    let waiting: i64 =
        sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE status = 'queued'").fetch_one(pool).await.unwrap();
    assert!(waiting > 100, "the flood was still queued while the trickle ran ({waiting} left)");
    w.drain().await;
}

/// The per-tenant cap: a tenant never has more than N running, while other
/// tenants use the free slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cap_bounds_its_running_runs_and_others_use_the_slots() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let step = json!({ "steps": 2, "step_ms": 20 });
    let mut capped = Vec::new();
    let mut other = Vec::new();
    for _ in 0..6 {
        capped.push(enqueue_as(pool, &tenant("capped"), None, "sleep", step.clone()).await.run_id);
    }
    for _ in 0..4 {
        other.push(enqueue_as(pool, &tenant("other"), None, "sleep", step.clone()).await.run_id);
    }
    let config = WorkerConfig { max_runs: 4, tenant_max_running: Some(1), ..fast_config("w") };
    let w = start_worker(&db, config).await;
    wait_all(pool, &capped, "completed").await;
    wait_all(pool, &other, "completed").await;
    type Span = (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>);
    let spans = |t: &'static str| async move {
        sqlx::query_as::<_, Span>(
            "SELECT started_at, finished_at FROM agent_run WHERE tenant_id = $1 ORDER BY started_at",
        )
        .bind(t)
        .fetch_all(pool)
        .await
        .unwrap()
    };
    let capped_spans = spans("capped").await;
    for pair in capped_spans.windows(2) {
        assert!(pair[1].0 >= pair[0].1, "two runs of a tenant capped at 1 overlapped: {pair:?}");
    }
    // The other tenant (capped too, at 1) ran beside it, not after it.
    let other_spans = spans("other").await;
    assert!(other_spans[0].0 < capped_spans.last().unwrap().0, "the cap held the other tenant back");
    w.drain().await;
}

/// Runs of `tenant` in `status`.
async fn count_of(pool: &sqlx::PgPool, tenant: &str, status: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE tenant_id = $1 AND status = $2")
        .bind(tenant)
        .bind(status)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Issue 40: one tenant's long runs cannot hold every slot. At the default
/// share (75% of 4 slots: 3), a tenant posting more long runs than slots
/// holds 3 and its fourth waits queued; a tenant arriving next starts at
/// the next claim (its wake), not when a long run ends. An operator's share
/// for the tenant (`tenants share`, read on the heartbeat) lets it fill the
/// process again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_share_of_the_slots_leaves_room_for_a_newcomer() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let hub = connected_hub(&db).await;
    let config =
        WorkerConfig { max_runs: 4, tenant_slot_share_pct: worker::TENANT_SLOT_SHARE_PCT_DEFAULT, ..fast_config("w") };
    let w = Worker::start(pool.clone(), Some(hub), AgentRegistry::with_builtins(), config).await.unwrap();
    let long = json!({ "steps": 100_000, "step_ms": 3_600_000 });
    let mut evil = Vec::new();
    for _ in 0..5 {
        evil.push(enqueue_as(pool, &tenant("evil"), None, "sleep", long.clone()).await.run_id);
    }
    wait_for("evil to hold its share", LONG, || async { count_of(pool, "evil", "running").await == 3 }).await;

    let good = enqueue_as(pool, &tenant("good"), None, "echo", json!({})).await.run_id;
    wait_status(pool, good, "completed", LONG).await;
    let pickup_s: f64 =
        sqlx::query_scalar("SELECT extract(epoch FROM started_at - created_at)::float8 FROM agent_run WHERE id = $1")
            .bind(good)
            .fetch_one(pool)
            .await
            .unwrap();
    eprintln!("good's pickup with evil at its share: {:.0} ms", pickup_s * 1000.0);
    // Woken by its enqueue's NOTIFY; the poll tick (0.5 s) bounds a lost wake.
    assert!(pickup_s < 2.0, "good waited {pickup_s} s for a slot");
    assert_eq!(count_of(pool, "evil", "running").await, 3, "evil took the slot left for others");
    assert_eq!(count_of(pool, "evil", "queued").await, 2);

    // The operator gives evil the whole process: it fills the fourth slot.
    agent_host::db::tenants::set_share(&mut *pool.acquire().await.unwrap(), "evil", Some(100)).await.unwrap();
    wait_for("evil to fill the process", LONG, || async { count_of(pool, "evil", "running").await == 4 }).await;
    assert_eq!(count_of(pool, "evil", "queued").await, 1, "never more than the process's slots");

    for id in evil {
        lifecycle::cancel(pool, id, "evil-user").await.unwrap();
    }
    w.drain().await;
}

/// A built-in agent has a wall time too (the manifest's, as a Wasm guest
/// has): a turn that would sleep past it ends failed with the limit named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_builtin_agent_past_its_wall_time_ends_failed() {
    let db = TestDb::new().await;
    let mut agents = AgentRegistry::with_builtins();
    let manifest = agent_host::run::manifest::Manifest::parse(&json!({ "limits": { "wall_ms": 300 } })).unwrap();
    agents.insert_with_manifest("sleep", Arc::new(agent_host::agent::Sleep), manifest);
    let w = start_worker_with(&db, agents, fast_config("w")).await;
    let run = enqueue(&db.pool, None, "sleep", json!({ "steps": 100_000, "step_ms": 3_600_000 })).await.run_id;
    assert_eq!(wait_terminal(&db.pool, run, LONG).await, "failed");
    let error = run_error(&db.pool, run).await;
    assert!(error.contains("wall time of 300 ms exceeded"), "{error}");
    w.drain().await;
}

/// Answers with `config.bytes` bytes, or fails with an error that long
/// (`config.fail`).
struct Says;

#[async_trait]
impl Agent for Says {
    async fn run(&self, _host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        let n = input.config["bytes"].as_u64().unwrap_or(0) as usize;
        let text = "é".repeat(n / 2);
        match input.config["fail"].as_bool() {
            Some(true) => Err(AgentError::failed(agent_host::error::FailReason::Agent, text)),
            _ => Ok(text),
        }
    }
}

/// Issue 40: a final answer or an error of any size is stored bounded: cut
/// at a character boundary with a marker (never a failure of the store), so
/// neither the transcript, the run row, its `complete` event nor a later
/// turn's history carries megabytes a guest chose to return.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_answer_or_error_is_stored_cut_with_a_marker() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let mut agents = AgentRegistry::with_builtins();
    agents.insert("says", Arc::new(Says));
    let w = start_worker_with(&db, agents, fast_config("w")).await;
    let answer = enqueue(pool, None, "says", json!({ "bytes": 8 << 20 })).await;
    let error = enqueue(pool, None, "says", json!({ "bytes": 1 << 20, "fail": true })).await;
    assert_eq!(wait_terminal(pool, answer.run_id, LONG).await, "completed");
    assert_eq!(wait_terminal(pool, error.run_id, LONG).await, "failed");
    let stored: String = sqlx::query_scalar("SELECT content FROM message WHERE run_id = $1 AND role = 'assistant'")
        .bind(answer.run_id)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(stored.len() <= agent_host::text::ANSWER_BYTES_MAX, "{} bytes stored", stored.len());
    assert!(stored.len() > agent_host::text::ANSWER_BYTES_MAX - 100);
    assert!(stored.ends_with(" bytes cut]"), "{}", &stored[stored.len() - 40..]);
    let e = run_error(pool, error.run_id).await;
    assert!(e.len() <= agent_host::text::ERROR_BYTES_MAX, "{} bytes of error stored", e.len());
    assert!(e.ends_with(" bytes cut]"), "{}", &e[e.len() - 40..]);
    let complete: serde_json::Value =
        sqlx::query_scalar("SELECT payload FROM run_event WHERE run_id = $1 AND type = 'complete'")
            .bind(error.run_id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(complete["error"].as_str(), Some(e.as_str()), "the complete event carries the same cut error");
    w.drain().await;
}

/// Issue 40: a run's journal has a budget in bytes (`journal_bytes_max`),
/// not only a count of events: a run streaming past it ends failed with the
/// limit named, and its journal stays within the budget (and one event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_past_its_journal_budget_ends_failed() {
    let db = TestDb::new().await;
    let mut agents = AgentRegistry::with_builtins();
    let budget = 4_000;
    let manifest =
        agent_host::run::manifest::Manifest::parse(&json!({ "limits": { "journal_bytes_max": budget } })).unwrap();
    agents.insert_with_manifest("sleep", Arc::new(agent_host::agent::Sleep), manifest);
    let w = start_worker_with(&db, agents, fast_config("w")).await;
    let run = enqueue(&db.pool, None, "sleep", json!({ "steps": 100_000, "step_ms": 0 })).await.run_id;
    assert_eq!(wait_terminal(&db.pool, run, LONG).await, "failed");
    let error = run_error(&db.pool, run).await;
    assert!(error.contains(&format!("journal budget of {budget} bytes spent")), "{error}");
    let written: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(length(type) + length(payload::text)), 0) FROM run_event
         WHERE run_id = $1 AND type = 'content_delta'",
    )
    .bind(run)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(written <= budget + 200, "{written} bytes of deltas journaled past a budget of {budget}");
    w.drain().await;
}
