//! Throughput mechanisms against a real PostgreSQL, each with the invariant
//! it must keep: batch claims (never more rows than slots, FIFO and one
//! running turn per conversation, a conflict claims fewer rows, fairness
//! across tenants) and group-committed endings (each row fenced alone, each
//! run its `complete`, its answer and its wake).
//!
//! Which rows one statement wrote is read from the rows themselves: rows
//! inserted by one transaction share its `xmin`, and journal rows are never
//! updated, so the `run_started` rows of one claim, or the `complete` rows of
//! one group commit, share one `xmin`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use agent_host::agent::{Agent, AgentError, AgentRegistry, RunHost, RunInput};
use agent_host::db::enqueue;
use agent_host::db::lifecycle::{self, Claim, Ending, Expired};
use agent_host::db::{MessageStatus, RunId, RunStatus};
use agent_host::worker::WorkerConfig;
use async_trait::async_trait;
use serde_json::json;

/// Rows per writing transaction among the journal rows of `kind`, largest first.
async fn rows_per_commit(pool: &sqlx::PgPool, kind: &str) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM run_event WHERE type = $1 GROUP BY xmin::text::bigint ORDER BY count(*) DESC",
    )
    .bind(kind)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Holds each run until the test opens the gate, and records the most runs
/// the database showed running while one of its runs was starting.
struct Gate {
    gate: Arc<tokio::sync::Semaphore>,
    started: Arc<AtomicUsize>,
    most_running: Arc<AtomicUsize>,
    pool: sqlx::PgPool,
}

#[async_trait]
impl Agent for Gate {
    async fn run(&self, _host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        let running: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE status = 'running'")
            .fetch_one(&self.pool)
            .await
            .unwrap();
        self.most_running.fetch_max(running as usize, Ordering::SeqCst);
        self.started.fetch_add(1, Ordering::SeqCst);
        self.gate.acquire().await.unwrap().forget();
        Ok("done".into())
    }
}

/// A registry with the `gate` agent: runs started, and the most runs the
/// database showed running as one started.
fn gate_agents(db: &TestDb, gate: Arc<tokio::sync::Semaphore>) -> (AgentRegistry, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let (started, most_running) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut agents = AgentRegistry::default();
    let agent = Gate { gate, started: started.clone(), most_running: most_running.clone(), pool: db.pool.clone() };
    agents.insert("gate", Arc::new(agent));
    (agents, started, most_running)
}

/// `n` runs of the `gate` agent, each in its own conversation.
async fn enqueue_gated(db: &TestDb, n: usize) -> Vec<RunId> {
    let mut runs = Vec::new();
    for _ in 0..n {
        runs.push(enqueue(&db.pool, None, "gate", json!({})).await.run_id);
    }
    runs
}

/// A dispatcher with k free slots claims up to k rows in one statement, and
/// never more rows than slots: the database never shows more running than
/// the worker has slots, and no claim statement took more than that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_claim_never_holds_more_rows_than_slots() {
    const SLOTS: usize = 4;
    const RUNS: usize = 24;
    let db = TestDb::new().await;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (agents, started, most_running) = gate_agents(&db, gate.clone());
    let runs = enqueue_gated(&db, RUNS).await;
    let w = start_worker_with(&db, agents, WorkerConfig { max_runs: SLOTS, ..fast_config("batch") }).await;
    // Release the runs a slot-full at a time: each wave frees every slot at
    // once, so the next claim takes several rows in one statement.
    for wave in 1..=RUNS / SLOTS {
        let s = started.clone();
        wait_for("a full wave of runs to start", LONG, || {
            let s = s.clone();
            async move { s.load(Ordering::SeqCst) == wave * SLOTS }
        })
        .await;
        let running: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE status = 'running'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(running as usize, SLOTS, "wave {wave}: running rows beside {SLOTS} slots");
        gate.add_permits(SLOTS);
    }
    for run in &runs {
        wait_status(&db.pool, *run, "completed", LONG).await;
    }
    w.drain().await;
    assert!(
        most_running.load(Ordering::SeqCst) <= SLOTS,
        "{} running with {SLOTS} slots",
        most_running.load(Ordering::SeqCst)
    );
    let claims = rows_per_commit(&db.pool, "run_started").await;
    assert_eq!(claims.iter().sum::<i64>(), RUNS as i64);
    assert!(claims[0] <= SLOTS as i64, "one claim took {} rows with {SLOTS} slots", claims[0]);
    assert!(claims[0] > 1, "no claim took more than one row: {claims:?}");
}

/// A batch that reaches two turns of one conversation claims only the
/// first; and when the index turns a row away (here the pre-filter is off,
/// so the claim reaches for a turn whose conversation is running), the
/// claim takes the other rows instead of failing.
#[tokio::test]
async fn a_batch_containing_two_turns_of_one_conversation_claims_only_the_first() {
    let db = TestDb::new().await;
    let a1 = enqueue(&db.pool, None, "noop", json!({})).await;
    let a2 = enqueue(&db.pool, Some(a1.conversation_id), "noop", json!({})).await;
    let b1 = enqueue(&db.pool, None, "noop", json!({})).await;
    let batch = lifecycle::claim_batch(&db.pool, &claim_args("w", 10, true)).await.unwrap();
    let mut ids: Vec<RunId> = batch.runs.iter().map(|r| r.id).collect();
    ids.sort_by_key(|r| r.0);
    let mut want = vec![a1.run_id, b1.run_id];
    want.sort_by_key(|r| r.0);
    assert_eq!(ids, want, "the batch took a later turn of a conversation");
    assert_eq!(batch.conflicts, 0);
    assert_eq!(status(&db.pool, a2.run_id).await, "queued");

    // a1 runs; without the pre-filter a2 is a candidate, and the index turns
    // it away. The claim is made again without a2's conversation: c1 is
    // claimed, nothing errs, a2 stays queued.
    let c1 = enqueue(&db.pool, None, "noop", json!({})).await;
    let batch = lifecycle::claim_batch(&db.pool, &claim_args("w", 10, false)).await.unwrap();
    assert_eq!(batch.runs.iter().map(|r| r.id).collect::<Vec<_>>(), vec![c1.run_id], "{batch:?}");
    assert_eq!(batch.conflicts, 1, "the index did not turn a2 away");
    assert_eq!(status(&db.pool, a2.run_id).await, "queued");
    let running: i64 =
        sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE conversation_id = $1 AND status = 'running'")
            .bind(a1.conversation_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(running, 1);
}

/// A claim says the queue is dry only when its snapshot held no queued run
/// besides those it claimed: never while a run it could not take is still
/// queued (a conversation's later turn, a row another claimer holds), and
/// never for a claim that took as many rows as it asked for.
#[tokio::test]
async fn a_claim_is_dry_only_when_nothing_else_is_queued() {
    let db = TestDb::new().await;
    let claim = |limit| {
        let pool = db.pool.clone();
        async move { lifecycle::claim_batch(&pool, &claim_args("w", limit, true)).await }
    };
    let empty = claim(4).await.unwrap();
    assert!(empty.runs.is_empty() && empty.dry, "an empty queue: {empty:?}");

    // Three runs, two asked for: a full claim is never dry.
    for _ in 0..3 {
        enqueue(&db.pool, None, "noop", json!({})).await;
    }
    let full = claim(2).await.unwrap();
    assert_eq!((full.runs.len(), full.dry), (2, false));
    // The third, with room for four: it was the last.
    let last = claim(4).await.unwrap();
    assert_eq!((last.runs.len(), last.dry), (1, true));

    // A conversation's second turn stays queued behind its first: not dry.
    let a1 = enqueue(&db.pool, None, "noop", json!({})).await;
    let a2 = enqueue(&db.pool, Some(a1.conversation_id), "noop", json!({})).await;
    let first = claim(4).await.unwrap();
    assert_eq!(first.runs.iter().map(|r| r.id).collect::<Vec<_>>(), vec![a1.run_id]);
    assert!(!first.dry, "dry with a later turn queued");
    assert!(!claim(4).await.unwrap().dry, "dry with a later turn queued behind a running one");

    // A row another transaction holds is skipped, not claimed: not dry.
    let held = enqueue(&db.pool, None, "noop", json!({})).await;
    let mut other = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM agent_run WHERE id = $1 FOR UPDATE")
        .bind(held.run_id)
        .execute(&mut *other)
        .await
        .unwrap();
    let skipped = claim(4).await.unwrap();
    assert!(skipped.runs.is_empty() && !skipped.dry, "dry with a locked row queued: {skipped:?}");
    other.rollback().await.unwrap();
    let taken = claim(4).await.unwrap();
    assert_eq!(taken.runs.iter().map(|r| r.id).collect::<Vec<_>>(), vec![held.run_id]);
    assert!(!taken.dry, "a2 is still queued");
    assert_eq!(status(&db.pool, a2.run_id).await, "queued");
}

/// Runs that come one at a time cost one claim and one ending each: a
/// claim that finds the queue dry is not made again at once (the next run
/// queued wakes the worker), and an ending then claims nothing with its
/// statement. Before, each such run cost three claims: its own, an empty
/// one right after it, and an empty one in its ending's statement. The poll
/// tick is far longer than the deadline: every pickup came from a wake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_one_at_a_time_cost_one_claim_and_one_ending_each() {
    const RUNS: u64 = 5;
    let db = TestDb::new().await;
    let hub = connected_hub(&db).await;
    let config = WorkerConfig { poll_tick: Duration::from_secs(120), ..fast_config("trickle") };
    let w = agent_host::worker::Worker::start(db.pool.clone(), Some(hub), AgentRegistry::with_builtins(), config)
        .await
        .unwrap();
    let stats = w.stats();
    let s = stats.clone();
    wait_for("the worker's first look at the queue", LONG, || {
        let s = s.clone();
        async move { s.claim_rounds.load(Ordering::Relaxed) == 1 }
    })
    .await;
    for _ in 0..RUNS {
        let run = enqueue(&db.pool, None, "echo", json!({})).await.run_id;
        wait_status(&db.pool, run, "completed", Duration::from_secs(30)).await;
        assert_eq!(assert_journal_sound(&db.pool, run).await.iter().filter(|(_, k)| k == "complete").count(), 1);
    }
    w.drain().await;
    assert_eq!(stats.claim_rounds.load(Ordering::Relaxed), 1 + RUNS, "claim statements");
    assert_eq!(stats.finish_commits.load(Ordering::Relaxed), RUNS, "ending statements");
    assert_eq!(stats.poll_wakeups.load(Ordering::Relaxed), 0, "a run waited for the poll tick");
}

/// Endings of `claimed`, each completed with an answer and `usage`.
fn completed(claimed: &[lifecycle::ClaimedRun], usage: Option<serde_json::Value>) -> Vec<Ending> {
    claimed
        .iter()
        .map(|c| Ending {
            run: c.id,
            token: c.claim_token,
            status: RunStatus::Completed,
            error: None,
            assistant: Some((format!("answer of {}", c.id), MessageStatus::Complete)),
            usage: usage.clone(),
        })
        .collect()
}

/// Three conversations of two turns each (the second waits on the first),
/// their first turns claimed in one statement, and the middle one's worker
/// lost: its lease lapsed and the reaper ended it. Returns the turns and the
/// claimed runs in claim order.
async fn three_claimed_one_reaped(
    db: &TestDb,
) -> (Vec<(enqueue::Enqueued, enqueue::Enqueued)>, Vec<lifecycle::ClaimedRun>) {
    let mut turns = Vec::new();
    for _ in 0..3 {
        let first = enqueue(&db.pool, None, "noop", json!({})).await;
        let next = enqueue(&db.pool, Some(first.conversation_id), "noop", json!({})).await;
        turns.push((first, next));
    }
    let claimed = lifecycle::claim_batch(&db.pool, &claim_args("w", 10, true)).await.unwrap().runs;
    assert_eq!(claimed.len(), 3);
    let lost = &claimed[1];
    update_run(&db.pool, lost.id, "claim_expires_at = now() - interval '1 hour'").await;
    let expired = Expired { id: lost.id, claim_token: lost.claim_token };
    assert!(lifecycle::reap(&db.pool, expired, Duration::from_secs(1)).await.unwrap());
    (turns, claimed)
}

/// A fenced row inside a group-committed batch of endings changes nothing
/// (the run keeps the ending its reaper wrote, with no second `complete` and
/// no answer), and its neighbours end normally in the same commit, each with
/// its `complete` event, its assistant message and its wake.
#[tokio::test]
async fn a_fenced_row_in_a_group_committed_batch_changes_nothing_and_its_neighbours_end() {
    let db = TestDb::new().await;
    let (_, claimed) = three_claimed_one_reaped(&db).await;
    let fenced = claimed[1].clone();

    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener.listen(agent_host::db::notify::RUN_ENQUEUED).await.unwrap();
    let endings = completed(&claimed, Some(json!({ "input_tokens": 1, "output_tokens": 2 })));
    let written = lifecycle::finish_many(&db.pool, &endings).await.unwrap();
    let mut want = vec![claimed[0].id, claimed[2].id];
    want.sort_by_key(|r| r.0);
    let mut got = written.clone();
    got.sort_by_key(|r| r.0);
    assert_eq!(got, want, "the fenced row did not drop out alone");

    assert_eq!(status(&db.pool, fenced.id).await, "failed", "the fenced row was changed");
    assert!(run_error(&db.pool, fenced.id).await.contains("worker lost"));
    let answers: i64 = sqlx::query_scalar("SELECT count(*) FROM message WHERE run_id = $1 AND role = 'assistant'")
        .bind(fenced.id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(answers, 0, "a fenced run got an answer");
    for c in claimed.iter().filter(|c| c.id != fenced.id) {
        assert_eq!(status(&db.pool, c.id).await, "completed");
        let (content, message_status): (String, String) =
            sqlx::query_as("SELECT content, status FROM message WHERE run_id = $1 AND role = 'assistant'")
                .bind(c.id)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!((content.as_str(), message_status.as_str()), (format!("answer of {}", c.id).as_str(), "complete"));
    }
    // One `complete` per run, in seq order after what the run journaled.
    for c in &claimed {
        let journal = assert_journal_sound(&db.pool, c.id).await;
        assert_eq!(journal.iter().filter(|(_, k)| k == "complete").count(), 1, "{journal:?}");
        assert_eq!(journal.last().unwrap().1, "complete");
    }
    // The two endings shared one commit.
    let ids: Vec<uuid::Uuid> = want.iter().map(|r| r.0).collect();
    let commits: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT xmin::text) FROM run_event WHERE run_id = ANY($1) AND type = 'complete'",
    )
    .bind(&ids)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(commits, 1);
    // Each ended run's conversation was woken for its next turn.
    let mut woken = std::collections::HashSet::new();
    let want_woken: std::collections::HashSet<String> =
        claimed.iter().filter(|c| c.id != fenced.id).map(|c| c.conversation_id.to_string()).collect();
    while !want_woken.is_subset(&woken) {
        let n = tokio::time::timeout(LONG, listener.recv()).await.expect("a wake within the deadline").unwrap();
        woken.insert(n.payload().to_string());
    }
}

/// The worker's group commit, end to end: a drain of many short runs ends
/// them in fewer commits than runs, and the wake chain still starts every
/// next turn at once (the poll tick is far longer than the whole drain).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_committed_endings_keep_every_complete_answer_and_wake() {
    const CONVERSATIONS: usize = 12;
    const TURNS: usize = 3;
    let db = TestDb::new().await;
    let mut runs = Vec::new();
    for _ in 0..CONVERSATIONS {
        let mut conversation = None;
        for _ in 0..TURNS {
            let e = enqueue(&db.pool, conversation, "echo", json!({})).await;
            conversation = Some(e.conversation_id);
            runs.push(e.run_id);
        }
    }
    let config = WorkerConfig { max_runs: 8, poll_tick: Duration::from_secs(60), ..fast_config("group") };
    let w = start_worker(&db, config).await;
    for run in &runs {
        wait_status(&db.pool, *run, "completed", Duration::from_secs(30)).await;
    }
    let stats = w.stats();
    w.drain().await;
    for run in &runs {
        let journal = assert_journal_sound(&db.pool, *run).await;
        assert_eq!(journal.iter().filter(|(_, k)| k == "complete").count(), 1);
        let answers: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM message WHERE run_id = $1 AND role = 'assistant' AND status = 'complete'",
        )
        .bind(run)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(answers, 1);
    }
    let endings = rows_per_commit(&db.pool, "complete").await;
    assert_eq!(endings.iter().sum::<i64>(), runs.len() as i64);
    assert!(endings.len() < runs.len(), "no two endings shared a commit: {endings:?}");
    assert!(endings[0] <= agent_host::worker::FINISH_BATCH_MAX as i64);
    let commits = stats.finish_commits.load(Ordering::Relaxed);
    assert_eq!(commits as usize, endings.len(), "the worker's count of ending commits");
    assert_eq!(stats.poll_wakeups.load(Ordering::Relaxed), 0, "a turn waited for the poll tick");
}

/// A tenant flooding the queue cannot starve a trickling one with batch
/// claims on: with eight slots a claim takes several rows, ranked by the
/// load each tenant would carry, so the trickle's runs go first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_cannot_starve_a_trickle_with_batch_claims() {
    const SLOTS: usize = 8;
    let db = TestDb::new().await;
    let pool = &db.pool;
    let quick = json!({ "steps": 1, "step_ms": 10 });
    let mut flood = Vec::new();
    for _ in 0..300 {
        flood.push(enqueue_as(pool, &tenant("flood"), None, "sleep", quick.clone()).await.run_id);
    }
    let w = start_worker(&db, WorkerConfig { max_runs: SLOTS, ..fast_config("fair") }).await;
    for run in &flood[..20] {
        wait_status(pool, *run, "completed", LONG).await;
    }
    let mut trickle = Vec::new();
    for _ in 0..5 {
        trickle.push(enqueue_as(pool, &tenant("trickle"), None, "sleep", quick.clone()).await.run_id);
    }
    for run in &trickle {
        wait_status(pool, *run, "completed", LONG).await;
    }
    // For each trickle run, the flood runs that started while it was queued:
    // at most the claim in progress when it arrived and the claim that took
    // it (the least-loaded tenant goes first). A FIFO claim would start the
    // whole flood ahead of it. Read from the rows' clocks, so how fast this
    // machine drains does not matter.
    let passed: Vec<i64> = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM agent_run f WHERE f.tenant_id = 'flood'
                   AND f.started_at > t.created_at AND f.started_at < t.started_at)
         FROM agent_run t WHERE t.tenant_id = 'trickle' ORDER BY t.queue_pos",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(passed.len(), trickle.len());
    assert!(passed.iter().all(|&n| n <= 2 * SLOTS as i64), "flood runs started ahead of each trickle run: {passed:?}");
    // The flood was still queued when the trickle's last run started (read
    // from the start times, not from how far the drain has got by now).
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM agent_run WHERE tenant_id = 'flood' AND (started_at IS NULL OR started_at >
             (SELECT max(started_at) FROM agent_run WHERE tenant_id = 'trickle'))",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(waiting > 150, "the flood was still queued while the trickle ran ({waiting} left)");
    w.drain().await;
    let claims = rows_per_commit(pool, "run_started").await;
    assert!(claims[0] > 1 && claims[0] <= SLOTS as i64, "claims took {claims:?} rows");
}

/// A row the database refuses inside a group-committed batch fails alone:
/// the batch falls back to one statement per ending, so its neighbours end
/// normally. (A trigger stands for any row-level refusal: it raises for one
/// run's terminal write only.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_ending_in_a_batch_fails_alone() {
    let db = TestDb::new().await;
    let mut runs = Vec::new();
    for _ in 0..6 {
        runs.push(enqueue(&db.pool, None, "echo", json!({})).await.run_id);
    }
    let refused = runs[2];
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION refuse_one_ending() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.id = '{refused}' AND NEW.status <> 'running' THEN
                 RAISE EXCEPTION 'this ending is refused';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse_one_ending BEFORE UPDATE ON agent_run
             FOR EACH ROW EXECUTE FUNCTION refuse_one_ending();"
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    // A long window and slots for all: the six endings share a batch.
    let config =
        WorkerConfig { max_runs: 8, finish_window: agent_host::worker::FINISH_WINDOW_MAX, ..fast_config("refused") };
    let w = start_worker(&db, config).await;
    for run in runs.iter().filter(|r| **r != refused) {
        wait_status(&db.pool, *run, "completed", Duration::from_secs(30)).await;
        assert_eq!(assert_journal_sound(&db.pool, *run).await.iter().filter(|(_, k)| k == "complete").count(), 1);
    }
    w.drain().await;
    let (status, completes): (String, i64) = sqlx::query_as(
        "SELECT r.status::text, (SELECT count(*) FROM run_event e WHERE e.run_id = r.id AND e.type = 'complete')
         FROM agent_run r WHERE r.id = $1",
    )
    .bind(refused)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), completes), ("running", 0), "the refused ending wrote nothing");
}

/// `lifecycle::finish_and_claim` on a connection of `pool`.
async fn finish_and_claim(pool: &sqlx::PgPool, endings: &[Ending], claim: &Claim<'_>) -> lifecycle::Turnover {
    lifecycle::finish_and_claim(&mut *pool.acquire().await.unwrap(), endings, claim).await.unwrap()
}

fn sorted(mut ids: Vec<RunId>) -> Vec<RunId> {
    ids.sort_by_key(|r| r.0);
    ids
}

/// The finisher's statement: a batch of endings and a claim into the slots
/// they free, in one commit. A fenced row drops out alone (the reaper's
/// ending stays, no second `complete`, no answer) and its neighbours end;
/// the claim takes no more rows than it was given slots, only the oldest
/// turn of a conversation, and never the next turn of a conversation whose
/// running turn ends in the same statement (both halves read one snapshot;
/// the ending's wake is what starts that turn).
#[tokio::test]
async fn an_ending_and_claim_batch_fences_rows_alone_and_claims_at_most_its_slots() {
    let db = TestDb::new().await;
    let (firsts, claimed) = three_claimed_one_reaped(&db).await;
    assert_eq!(sorted(claimed.iter().map(|c| c.id).collect()), sorted(firsts.iter().map(|f| f.0.run_id).collect()));
    let fenced = claimed[1].clone();
    // Four more conversations queued, and a second turn of one of them.
    let mut fresh = Vec::new();
    for _ in 0..4 {
        fresh.push(enqueue(&db.pool, None, "noop", json!({})).await);
    }
    let later = enqueue(&db.pool, Some(fresh[0].conversation_id), "noop", json!({})).await;

    let turnover = finish_and_claim(&db.pool, &completed(&claimed, None), &claim_args("w", 3, true)).await;
    assert_eq!(
        sorted(turnover.written.clone()),
        sorted(vec![claimed[0].id, claimed[2].id]),
        "the fenced row did not drop out alone"
    );
    assert_eq!(status(&db.pool, fenced.id).await, "failed", "the fenced row was changed");
    let fenced_journal = assert_journal_sound(&db.pool, fenced.id).await;
    assert_eq!(fenced_journal.iter().filter(|(_, k)| k == "complete").count(), 1);
    // Three slots, three rows: the oldest queued turns that may run. The
    // fenced run's next turn may (its conversation has nothing running);
    // the next turns of the two runs ending here may not, nor `later`.
    let got: Vec<RunId> = turnover.claimed.iter().map(|c| c.id).collect();
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(got.contains(&firsts[1].1.run_id), "the fenced run's next turn was not claimed: {got:?}");
    for excluded in [firsts[0].1.run_id, firsts[2].1.run_id, later.run_id] {
        assert!(!got.contains(&excluded), "claimed {excluded}, which may not run yet: {got:?}");
    }
    for c in &turnover.claimed {
        // A second turn has its conversation's history to read; a lone first
        // turn has none.
        if c.id == firsts[1].1.run_id {
            assert!(c.has_history, "{c:?}");
        } else if fresh[1..].iter().any(|f| f.run_id == c.id) {
            assert!(!c.has_history, "{c:?}");
        }
        assert_eq!(status(&db.pool, c.id).await, "running");
        let journal = assert_journal_sound(&db.pool, c.id).await;
        assert_eq!(journal.iter().map(|(_, k)| k.as_str()).collect::<Vec<_>>().last(), Some(&"run_started"));
        let user: String = sqlx::query_scalar("SELECT status FROM message WHERE id = $1")
            .bind(c.user_message_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(user, "complete");
    }
    for id in &turnover.written {
        assert_eq!(status(&db.pool, *id).await, "completed");
        let answer: String = sqlx::query_scalar("SELECT content FROM message WHERE run_id = $1 AND role = 'assistant'")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(answer, format!("answer of {id}"));
    }
    // The endings and the claim shared one commit.
    let xmins = |kind: &'static str, ids: Vec<uuid::Uuid>| {
        let pool = db.pool.clone();
        async move {
            let x: Vec<String> =
                sqlx::query_scalar("SELECT DISTINCT xmin::text FROM run_event WHERE run_id = ANY($1) AND type = $2")
                    .bind(ids)
                    .bind(kind)
                    .fetch_all(&pool)
                    .await
                    .unwrap();
            x
        }
    };
    let ended = xmins("complete", turnover.written.iter().map(|r| r.0).collect()).await;
    let started = xmins("run_started", got.iter().map(|r| r.0).collect()).await;
    assert_eq!(ended.len(), 1);
    assert_eq!(started, ended, "the claim and the endings did not share a commit");
}

/// When the one-running-per-conversation index turns a claimed row away
/// (here the pre-filter is off, so the claim reaches for the next turn of
/// a conversation running elsewhere), the ending-and-claim statement is made
/// again passing over that conversation: the endings are written, the
/// other rows are claimed, and nothing errs.
#[tokio::test]
async fn an_index_conflict_in_an_ending_and_claim_batch_claims_fewer_rows_and_ends_every_run() {
    let db = TestDb::new().await;
    let ending = enqueue(&db.pool, None, "noop", json!({})).await;
    let busy = enqueue(&db.pool, None, "noop", json!({})).await;
    let claimed = lifecycle::claim_batch(&db.pool, &claim_args("w", 2, true)).await.unwrap().runs;
    assert_eq!(claimed.len(), 2);
    // `busy` keeps running; its next turn is the conflict. `free` may run.
    let blocked = enqueue(&db.pool, Some(busy.conversation_id), "noop", json!({})).await;
    let free = enqueue(&db.pool, None, "noop", json!({})).await;
    let mine: Vec<_> = claimed.iter().filter(|c| c.id == ending.run_id).cloned().collect();
    let turnover = finish_and_claim(&db.pool, &completed(&mine, None), &claim_args("w", 2, false)).await;
    assert_eq!(turnover.written, vec![ending.run_id]);
    assert_eq!(turnover.claimed.iter().map(|c| c.id).collect::<Vec<_>>(), vec![free.run_id]);
    assert_eq!(status(&db.pool, ending.run_id).await, "completed");
    assert_eq!(status(&db.pool, blocked.run_id).await, "queued");
    assert_eq!(status(&db.pool, busy.run_id).await, "running");
}

/// Commits that wrote `run_started` rows, `op` (INTERSECT or EXCEPT) those
/// that wrote `complete` rows.
async fn claim_commits(pool: &sqlx::PgPool, op: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM (SELECT xmin::text FROM run_event WHERE type = 'run_started'
                               {op} SELECT xmin::text FROM run_event WHERE type = 'complete') c"
    ))
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A busy worker hands the slots its endings free straight to the runs it
/// claims in the same commit (one statement per batch, not two), and still
/// never holds more runs than slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_worker_claims_with_its_endings_and_never_holds_more_than_its_slots() {
    const SLOTS: usize = 3;
    const RUNS: usize = 60;
    let db = TestDb::new().await;
    // Every run reads how many the database shows running as it starts.
    let (agents, _, most_running) = gate_agents(&db, Arc::new(tokio::sync::Semaphore::new(RUNS)));
    let runs = enqueue_gated(&db, RUNS).await;
    let w = start_worker_with(&db, agents, WorkerConfig { max_runs: SLOTS, ..fast_config("turnover") }).await;
    for run in &runs {
        wait_status(&db.pool, *run, "completed", LONG).await;
    }
    let stats = w.stats();
    w.drain().await;
    // Commits that wrote both endings and claims.
    let shared = claim_commits(&db.pool, "INTERSECT").await;
    assert!(shared > 0, "no claim rode an ending's commit");
    let claims = rows_per_commit(&db.pool, "run_started").await;
    assert_eq!(claims.iter().sum::<i64>(), RUNS as i64);
    assert!(claims[0] <= SLOTS as i64, "one claim took {} rows with {SLOTS} slots", claims[0]);
    let most = most_running.load(Ordering::SeqCst);
    assert!(most <= SLOTS, "{most} runs were running at once with {SLOTS} slots");
    // After the dispatcher's first claim, the slots pass from ending to
    // claim: claims committed without an ending are the first and, at most,
    // one made while the finisher's statement was being written.
    let alone = claim_commits(&db.pool, "EXCEPT").await;
    assert!(alone <= 3, "{alone} claims did not ride an ending's commit");
    assert!(stats.claim_rounds.load(Ordering::Relaxed) < RUNS as u64);
    // Claims riding endings keep the queue's order within a bound: no run
    // starts after more than a few runs enqueued behind it.
    let overtaken: i64 = sqlx::query_scalar(
        "SELECT max((SELECT count(*) FROM agent_run s WHERE s.queue_pos > r.queue_pos AND s.started_at < r.started_at))
         FROM agent_run r",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(overtaken <= 3 * SLOTS as i64, "a run started after {overtaken} runs enqueued behind it");
}

/// Blocks the first execution on `first` and every later one on `later`;
/// tells the test each start. (One gate for both would let a permit meant
/// for the first attempt go to the second, when a heartbeat found the first
/// fenced and stood it down before the test gave the permit.)
struct Held2 {
    first: Arc<tokio::sync::Semaphore>,
    later: Arc<tokio::sync::Semaphore>,
    runs: AtomicUsize,
    started: tokio::sync::mpsc::UnboundedSender<()>,
}

#[async_trait]
impl Agent for Held2 {
    async fn run(&self, _host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        let gate = if self.runs.fetch_add(1, Ordering::SeqCst) == 0 { &self.first } else { &self.later };
        let _ = self.started.send(());
        gate.acquire().await.unwrap().forget();
        Ok("done".into())
    }
}

/// A resumable run put back in the queue while its task still ran (its
/// lease lapsed; the reaper requeued it) is fenced at its ending (or stood
/// down by a heartbeat that found it fenced), and the same statement may
/// claim it again into the slot that ending frees: the new attempt's entry
/// in the worker's held runs, under its new token, must outlive the old task
/// standing down, or no heartbeat would renew its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_claimed_again_with_its_own_fenced_ending_stays_held() {
    let db = TestDb::new().await;
    let (first, later) = (Arc::new(tokio::sync::Semaphore::new(0)), Arc::new(tokio::sync::Semaphore::new(0)));
    let (tx, mut started) = tokio::sync::mpsc::unbounded_channel();
    let mut agents = AgentRegistry::default();
    let held = Held2 { first: first.clone(), later: later.clone(), runs: AtomicUsize::new(0), started: tx };
    agents.insert("held", Arc::new(held));
    let run = enqueue_pinned(&db, "held", Some(&json!({ "durability": "resume" })), json!({})).await;
    let config = WorkerConfig { max_runs: 1, lease: Duration::from_secs(60), ..fast_config("again") };
    let w = start_worker_with(&db, agents, config).await;
    tokio::time::timeout(LONG, started.recv()).await.expect("the first attempt starts");
    // What the reaper does to a resumable run whose lease lapsed.
    update_run(&db.pool, run, "status = 'queued', attempt = attempt + 1, claim_expires_at = NULL").await;
    first.add_permits(1);
    tokio::time::timeout(LONG, started.recv()).await.expect("the second attempt starts");
    let stats = w.stats();
    wait_for("the first attempt to stand down", LONG, || {
        let stats = stats.clone();
        async move { stats.fenced.load(Ordering::SeqCst) == 1 }
    })
    .await;
    // A heartbeat after that renews the second attempt's lease.
    let since: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(&db.pool).await.unwrap();
    wait_for("a heartbeat of the second attempt", LONG, || {
        let pool = db.pool.clone();
        async move {
            let beat: Option<chrono::DateTime<chrono::Utc>> =
                sqlx::query_scalar("SELECT last_heartbeat_at FROM agent_run WHERE id = $1 AND status = 'running'")
                    .bind(run)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            beat.is_some_and(|b| b > since)
        }
    })
    .await;
    assert_eq!(w.in_flight(), 1, "the second attempt is not held");
    later.add_permits(1);
    wait_status(&db.pool, run, "completed", LONG).await;
    let attempt: i32 =
        sqlx::query_scalar("SELECT attempt FROM agent_run WHERE id = $1").bind(run).fetch_one(&db.pool).await.unwrap();
    assert_eq!(attempt, 2);
    w.drain().await;
}

// ---------------------------------------------------------------------------
// Eager start: a run submitted to a process with a free slot, when nothing
// else is queued, starts in its enqueue's statement.
