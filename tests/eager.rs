//! Eager start: a run posted to a process with a free slot, when nothing
//! else is queued, starts in its enqueue's statement, without a claim; never
//! in place of a queued run or a running turn, and a start meeting another
//! in its conversation is queued instead.

use std::time::Duration;

use crate::support::*;
use agent_host::agent::AgentRegistry;
use agent_host::db::enqueue;
use agent_host::db::lifecycle;
use agent_host::db::{RunId, RunStatus};
use agent_host::worker::WorkerConfig;
use serde_json::json;

/// The claim an enqueue makes for a worker named `worker_id`.
fn eager(worker_id: &str, tenant_max_running: Option<i64>) -> lifecycle::Eager<'_> {
    lifecycle::Eager { worker_id, lease: Duration::from_secs(30), tenant_max_running }
}

/// A run of `plugin` for `owner` in `conversation` (`None`: a new one),
/// its config its request snapshot.
fn new_run<'a>(
    owner: &'a enqueue::Owner,
    conversation: Option<agent_host::db::ConversationId>,
    plugin: &'a str,
    config: &'a serde_json::Value,
) -> enqueue::NewRun<'a> {
    crate::support::new_run(owner, conversation, plugin, config, config)
}

/// Waits until an enqueue (its statement's text) waits on a lock.
async fn wait_for_enqueue_lock_wait(pool: &sqlx::PgPool, what: &str) {
    wait_for(what, LONG, || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND query LIKE '%made AS%')",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    })
    .await;
}

/// A run's row as the claim left it: status, worker, token; its user
/// message's status; and the transactions that wrote its journal's first
/// three rows (with their seqs).
async fn eager_row(
    pool: &sqlx::PgPool,
    run: RunId,
) -> (String, Option<String>, Option<uuid::Uuid>, String, Vec<i32>, i64) {
    let (status, worker, token, message): (String, Option<String>, Option<uuid::Uuid>, String) = sqlx::query_as(
        "SELECT r.status, r.worker_id, r.claim_token, m.status FROM agent_run r
         JOIN message m ON m.id = r.user_message_id WHERE r.id = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    let (seqs, commits): (Vec<i32>, i64) = sqlx::query_as(
        "SELECT array_agg(seq ORDER BY seq), count(DISTINCT xmin::text) FROM run_event WHERE run_id = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    (status, worker, token, message, seqs, commits)
}

/// An enqueue with the queue empty starts its run in its own statement:
/// running, claimed by the worker named, fenced by the token it returns,
/// seq 1-3 (`run_started` too) and the user message `complete` in one
/// commit. It never takes another run's place: a turn of a conversation
/// whose turn is running is queued behind it (one running turn, FIFO); with
/// any run queued, a new run is queued too (the backlog's claim order and
/// tenant fairness hold); a tenant at its running cap is queued.
#[tokio::test]
async fn an_eager_start_never_takes_the_place_of_a_queued_run_or_a_running_turn() {
    let db = TestDb::new().await;
    let (acme, other) = (tenant("acme"), tenant("other"));
    let config = json!({});
    let e = eager("eager", None);

    // Nothing queued: it starts.
    let (first, started) =
        lifecycle::enqueue_eager(&db.pool, &new_run(&acme, None, "echo", &config), &e).await.unwrap();
    let claimed = started.expect("an empty queue: the run starts in its enqueue");
    assert_eq!((claimed.id, claimed.attempt, claimed.has_history), (first.run_id, 1, false));
    assert_eq!(first.status, RunStatus::Queued, "the answer names the state the run was accepted in");
    let (state, worker, token, message, seqs, commits) = eager_row(&db.pool, first.run_id).await;
    assert_eq!((state.as_str(), worker.as_deref(), token), ("running", Some("eager"), Some(claimed.claim_token.0)));
    assert_eq!((message.as_str(), seqs, commits), ("complete", vec![1, 2, 3], 1));
    assert_eq!(journal(&db.pool, first.run_id).await[2].1, "run_started");

    // The next turn of that conversation: its turn is running, so it queues.
    let (second, started) =
        lifecycle::enqueue_eager(&db.pool, &new_run(&acme, Some(first.conversation_id), "echo", &config), &e)
            .await
            .unwrap();
    assert!(started.is_none(), "a turn started beside its conversation's running turn");
    let (state, worker, _, message, seqs, _) = eager_row(&db.pool, second.run_id).await;
    assert_eq!((state.as_str(), worker, message.as_str(), seqs), ("queued", None, "queued", vec![1, 2]));

    // A run is queued (that second turn): a new conversation's run queues behind it.
    let (third, started) =
        lifecycle::enqueue_eager(&db.pool, &new_run(&other, None, "echo", &config), &e).await.unwrap();
    assert!(started.is_none(), "a run started ahead of a queued one");
    assert_eq!(status(&db.pool, third.run_id).await, "queued");

    // Both queued runs are the dispatcher's, in their order: the second
    // turn still waits for the first, so the third goes.
    let next = claim_one(&db.pool, "dispatcher", Duration::from_secs(30)).await;
    assert_eq!(next.id, third.run_id);

    // A tenant at its running cap queues, with nothing else queued.
    let db = TestDb::new().await;
    let capped = eager("eager", Some(1));
    let (_, started) =
        lifecycle::enqueue_eager(&db.pool, &new_run(&acme, None, "echo", &config), &capped).await.unwrap();
    assert!(started.is_some());
    let (at_cap, started) =
        lifecycle::enqueue_eager(&db.pool, &new_run(&acme, None, "echo", &config), &capped).await.unwrap();
    assert!(started.is_none(), "a tenant passed its running cap");
    assert_eq!(status(&db.pool, at_cap.run_id).await, "queued");
    assert_no_orphans(&db.pool).await;
}

/// Two eager starts in one conversation at the same instant: neither sees
/// the other's running row, the one-running index refuses the second, and
/// that enqueue is made again queued, with nothing of the refused attempt
/// left behind: on its own (the pool) and inside a caller's transaction
/// (a savepoint).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eager_start_meeting_another_in_its_conversation_is_queued_instead() {
    for in_transaction in [false, true] {
        eager_starts_meet(in_transaction).await;
    }
}

async fn eager_starts_meet(in_transaction: bool) {
    let db = TestDb::new().await;
    let acme = tenant("acme");
    let config = json!({});
    let (conversation, _) = enqueue::create_conversation(&db.pool, &acme).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let (first, started) =
        lifecycle::enqueue_eager_in(&mut tx, &new_run(&acme, Some(conversation), "echo", &config), &eager("a", None))
            .await
            .unwrap();
    assert!(started.is_some());
    // The second enqueue's snapshot cannot see the first, uncommitted: its
    // insert of a running row waits on the index for the first's outcome.
    let pool = db.pool.clone();
    let acme2 = acme.clone();
    let second = tokio::spawn(async move {
        let config = json!({});
        let new = new_run(&acme2, Some(conversation), "echo", &config);
        if !in_transaction {
            return lifecycle::enqueue_eager(&pool, &new, &eager("b", None)).await.unwrap();
        }
        let mut tx = pool.begin().await.unwrap();
        let done = lifecycle::enqueue_eager_in(&mut tx, &new, &eager("b", None)).await.unwrap();
        tx.commit().await.unwrap();
        done
    });
    wait_for_enqueue_lock_wait(&db.pool, "the second enqueue to wait on the first's index entry").await;
    tx.commit().await.unwrap();
    let (second, started) = second.await.unwrap();
    assert!(started.is_none(), "two turns of one conversation started");
    assert_eq!(status(&db.pool, first.run_id).await, "running");
    assert_eq!(status(&db.pool, second.run_id).await, "queued");
    assert_eq!(journal(&db.pool, second.run_id).await.len(), 2, "the refused start left events");
    let messages: i64 = sqlx::query_scalar("SELECT count(*) FROM message WHERE conversation_id = $1")
        .bind(conversation)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(messages, 2, "the refused start left a message");
    assert_no_orphans(&db.pool).await;
}

/// A run that started in its enqueue belongs to the process that enqueued
/// it; if that process dies before running it, its lease lapses and the
/// reaper ends it, as it ends a claimed run whose worker died.
#[tokio::test]
async fn a_run_started_in_its_enqueue_by_a_process_that_died_is_reaped() {
    let db = TestDb::new().await;
    let config = json!({});
    let ghost = lifecycle::Eager { worker_id: "ghost", lease: Duration::from_millis(500), tenant_max_running: None };
    let (run, started) =
        lifecycle::enqueue_eager(&db.pool, &new_run(&owner(), None, "echo", &config), &ghost).await.unwrap();
    assert!(started.is_some());
    drop(started); // the process died between its commit and its run task
    let w = start_worker(&db, WorkerConfig { eager_start: false, ..fast_config("reaper") }).await;
    assert_eq!(wait_terminal(&db.pool, run.run_id, LONG).await, "failed");
    let error = run_error(&db.pool, run.run_id).await;
    assert!(error.contains("lease expired") && error.contains("worker ghost"), "{error}");
    w.drain().await;
    assert_journal_sound(&db.pool, run.run_id).await;
}

/// Through the HTTP API of a process with a worker: runs posted one at a
/// time start in their enqueue and run to completion with no claim
/// statement; with eager start off, each is claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_posted_to_an_idle_host_start_in_their_enqueue_without_a_claim() {
    const RUNS: usize = 4;
    for on in [true, false] {
        let db = TestDb::new().await;
        // The hub connected first, so its connect is no wake; then the
        // worker's first look at the queue, its one claim before the runs.
        let hub = connected_hub(&db).await;
        let config = WorkerConfig { eager_start: on, poll_tick: Duration::from_secs(120), ..fast_config("w") };
        let host = crate::support::http::TestHost::start(&db, Some(hub), AgentRegistry::with_builtins(), config).await;
        let h = &host;
        wait_for("the worker's first look at the queue", LONG, || async move {
            h.scrape().await["agent_host_claim_rounds_total"] == 1.0
        })
        .await;
        let claims0 = 1.0;
        for _ in 0..RUNS {
            let (code, body) =
                host.call("POST", "/v1/runs", Some(json!({ "content": "hello", "plugin": "echo" }))).await;
            assert_eq!((code.as_u16(), body["status"].as_str()), (202, Some("queued")), "{body}");
            let run: RunId = serde_json::from_value(body["run_id"].clone()).unwrap();
            assert_eq!(wait_terminal(&db.pool, run, LONG).await, "completed");
            let kinds: Vec<String> = assert_journal_sound(&db.pool, run).await.into_iter().map(|(_, k)| k).collect();
            assert_eq!(&kinds[..3], ["user_message_created", "run_queued", "run_started"]);
            assert_eq!(kinds.last().map(String::as_str), Some("complete"));
        }
        let metrics = host.scrape().await;
        let (eager, claims) =
            (metrics["agent_host_eager_starts_total"], metrics["agent_host_claim_rounds_total"] - claims0);
        if on {
            assert_eq!((eager, claims), (RUNS as f64, 0.0), "eager starts, claim statements");
        } else {
            assert_eq!(eager, 0.0);
            assert!(claims >= RUNS as f64, "{claims} claim statements for {RUNS} claimed runs");
        }
        host.stop().await;
    }
}

/// A schedule's firing is a submission too: on a host whose worker has a
/// free slot, its run starts in the firing's enqueue, with no claim
/// statement and no wake, as a posted run's does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_firing_on_an_idle_host_starts_its_run_in_the_enqueue() {
    const FIRINGS: usize = 2;
    let db = TestDb::new().await;
    let hub = connected_hub(&db).await;
    let config = WorkerConfig {
        poll_tick: Duration::from_secs(120),
        schedule_tick: Duration::from_millis(100),
        ..fast_config("w")
    };
    // A schedule that fires every second.
    let schedules =
        agent_host::service::schedules::SchedulePolicy { min_interval: Duration::from_secs(1), ..Default::default() };
    let policy = std::sync::Arc::new(agent_host::service::submit::Policy { schedules, ..Default::default() });
    let host =
        crate::support::http::TestHost::start_with(&db, Some(hub), AgentRegistry::with_builtins(), config, |s| {
            s.policy = policy
        })
        .await;
    let h = &host;
    wait_for("the worker's first look at the queue", LONG, || async move {
        h.scrape().await["agent_host_claim_rounds_total"] == 1.0
    })
    .await;
    let (code, schedule) = host
        .call("POST", "/v1/schedules", Some(json!({ "plugin": "echo", "content": "tick", "cron": "* * * * * *" })))
        .await;
    assert_eq!(code.as_u16(), 201, "{schedule}");
    let key = format!("schedule-{}-%", schedule["id"].as_str().unwrap());
    let fired = || async {
        sqlx::query_scalar::<_, RunId>(
            "SELECT id FROM agent_run WHERE idempotency_key LIKE $1 AND status = 'completed' ORDER BY queue_pos",
        )
        .bind(&key)
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };
    wait_for("two firings' runs completed", LONG, || async { fired().await.len() >= FIRINGS }).await;
    let (code, _) = host.call("POST", &format!("/v1/schedules/{}/pause", schedule["id"].as_str().unwrap()), None).await;
    assert_eq!(code.as_u16(), 200);
    let runs = fired().await;
    for run in &runs {
        let kinds: Vec<String> = assert_journal_sound(&db.pool, *run).await.into_iter().map(|(_, k)| k).collect();
        assert_eq!(&kinds[..3], ["user_message_created", "run_queued", "run_started"]);
    }
    let metrics = host.scrape().await;
    assert!(
        metrics["agent_host_eager_starts_total"] >= runs.len() as f64,
        "{} eager starts for {} completed firings",
        metrics["agent_host_eager_starts_total"],
        runs.len()
    );
    assert_eq!(metrics["agent_host_claim_rounds_total"], 1.0, "a firing's run was claimed");
    host.stop().await;
}

/// An eager start racing a `reject` or `interrupt` enqueue, which holds
/// its conversation's row `FOR UPDATE` while it decides and then starts its
/// own run: the racing enqueue waits for that row before it writes
/// anything, so the two never deadlock (each waiting on the other: one for
/// the row, one for the one-running index); it then meets the started turn
/// in the index and is queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eager_start_racing_a_conversation_lock_waits_for_it_and_queues() {
    let db = TestDb::new().await;
    let acme = tenant("acme");
    let (conversation, _) = enqueue::create_conversation(&db.pool, &acme).await.unwrap();
    // The `reject` enqueue's first step, as `lifecycle::enqueue_with` takes it.
    let mut locker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM conversation WHERE id = $1 FOR UPDATE")
        .bind(conversation)
        .execute(&mut *locker)
        .await
        .unwrap();
    let pool = db.pool.clone();
    let acme2 = acme.clone();
    let racer = tokio::spawn(async move {
        let config = json!({});
        lifecycle::enqueue_eager(&pool, &new_run(&acme2, Some(conversation), "echo", &config), &eager("racer", None))
            .await
    });
    wait_for_enqueue_lock_wait(&db.pool, "the racing enqueue to wait for the conversation's row").await;
    let config = json!({});
    let (first, started) = lifecycle::enqueue_eager_in(
        &mut locker,
        &new_run(&acme, Some(conversation), "echo", &config),
        &eager("locker", None),
    )
    .await
    .unwrap();
    assert!(started.is_some());
    locker.commit().await.unwrap();
    let (second, started) = racer.await.unwrap().expect("the racing enqueue failed (a deadlock?)");
    assert!(started.is_none());
    assert_eq!(status(&db.pool, first.run_id).await, "running");
    assert_eq!(status(&db.pool, second.run_id).await, "queued");
    assert_no_orphans(&db.pool).await;
}

/// A drain that begins while an enqueue is starting a run on this worker
/// waits for that run: it is handed to its run task and ends, instead of
/// being left running in a process that stopped (for the reaper to fail).
/// The enqueue is held on its conversation's row while the drain begins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_waits_for_a_run_starting_in_its_enqueue() {
    let db = TestDb::new().await;
    let (conversation, _) = enqueue::create_conversation(&db.pool, &owner()).await.unwrap();
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM conversation WHERE id = $1 FOR UPDATE")
        .bind(conversation)
        .execute(&mut *holder)
        .await
        .unwrap();
    // No hub: nothing says the queue is busy, so the slot is given.
    let w = agent_host::worker::Worker::start(db.pool.clone(), None, AgentRegistry::with_builtins(), fast_config("d"))
        .await
        .unwrap();
    let slot =
        agent_host::service::submit::LocalWorker::start_slot(&w.observer(), "acme").expect("an idle worker's slot");
    let pool = db.pool.clone();
    let enqueue = tokio::spawn(async move {
        let config = json!({});
        let owner = owner();
        let (run, started) =
            lifecycle::enqueue_eager(&pool, &new_run(&owner, Some(conversation), "echo", &config), &slot.claim())
                .await
                .unwrap();
        slot.start(started.expect("an empty queue: the run starts in its enqueue"));
        run.run_id
    });
    let mut drain = tokio::spawn(w.drain());
    // A drain with nothing in flight ends in milliseconds; this one must not
    // end while the run is still on its way to the worker.
    let early = tokio::time::timeout(Duration::from_secs(1), &mut drain).await;
    assert!(early.is_err(), "the drain ended while a run was starting in its enqueue");
    holder.commit().await.unwrap();
    let run = enqueue.await.unwrap();
    let report = drain.await.unwrap();
    assert!(report.finished_in_budget, "{report:?}");
    assert_eq!(status(&db.pool, run).await, "completed");
    assert_journal_sound(&db.pool, run).await;
}
