//! Run lifecycle as readers see it over many turns and two real processes:
//! a conversation's turns never appear to overlap. `started_at` and
//! `finished_at` are stamped with the statement clock, so a claim whose
//! transaction began before the previous turn's finish committed still
//! records a start after that finish.

use std::time::Duration;

use crate::support::process::{HostProcess, FAST};
use crate::support::*;
use agent_host::db::lifecycle::{self, Claim, Finish};
use agent_host::db::{RunId, RunStatus};
use chrono::{DateTime, Utc};
use serde_json::json;

const CONVERSATIONS: usize = 16;
const TURNS: usize = 40;
const ALL_DONE_WITHIN: Duration = Duration::from_secs(60);

fn claim_args(worker_id: &str) -> Claim<'_> {
    Claim {
        limit: 10,
        lease: Duration::from_secs(30),
        worker_id,
        prefilter: true,
        tenant_max_running: None,
        rooms: Default::default(),
    }
}

async fn stamps(pool: &sqlx::PgPool, run: RunId) -> (Option<DateTime<Utc>>, Option<DateTime<Utc>>) {
    sqlx::query_as("SELECT started_at, finished_at FROM agent_run WHERE id = $1")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The mechanism, deterministically: a claim whose transaction began before
/// the previous turn's finish committed (its snapshot, taken later, sees the
/// turn ended) records its start after that finish, not at its
/// transaction's start.
#[tokio::test]
async fn a_claim_whose_transaction_began_before_the_previous_turn_ended_starts_after_it() {
    let db = TestDb::new().await;
    let t1 = enqueue(&db.pool, None, "noop", json!({})).await;
    let t2 = enqueue(&db.pool, Some(t1.conversation_id), "noop", json!({})).await;
    let first = lifecycle::claim(&db.pool, &claim_args("a")).await.unwrap();
    assert_eq!(first.iter().map(|c| c.id).collect::<Vec<_>>(), vec![t1.run_id]);

    // A claimer's transaction is under way (its now() is fixed) before turn
    // 1 ends; its claim statement runs after turn 1's finish has committed.
    let mut late = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *late).await.unwrap();
    let finish = Finish { status: RunStatus::Completed, error: None, assistant: None, usage: None };
    assert!(lifecycle::finish(&db.pool, t1.run_id, first[0].claim_token, &finish).await.unwrap());
    let second = lifecycle::claim(&mut *late, &claim_args("b")).await.unwrap();
    late.commit().await.unwrap();
    assert_eq!(second.iter().map(|c| c.id).collect::<Vec<_>>(), vec![t2.run_id]);

    let (_, finished1) = stamps(&db.pool, t1.run_id).await;
    let (started2, _) = stamps(&db.pool, t2.run_id).await;
    let (finished1, started2) = (finished1.unwrap(), started2.unwrap());
    assert!(started2 >= finished1, "turn 2 started {started2}, before turn 1 finished {finished1}");
}

/// The guard, as readers meet it: hundreds of turns queued behind each other
/// on two real processes, every turn starting after its predecessor ended.
/// (With the transaction clock this caught an overlap only now and then on a
/// 2-core machine: the window is a claim's planning time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_of_a_conversation_never_overlap_across_two_processes() {
    let db = TestDb::new().await;
    let a = HostProcess::spawn(&db.url, "A", FAST);
    let b = HostProcess::spawn(&db.url, "B", FAST);
    // Every turn queues behind the one before it: the next one starts only
    // when the previous one's ending wakes a claimer, in either process.
    let mut conversations = Vec::new();
    for _ in 0..CONVERSATIONS {
        conversations.push(enqueue(&db.pool, None, "noop", json!({})).await.conversation_id);
    }
    let mut last = Vec::new();
    for turn in 1..TURNS {
        for c in &conversations {
            let run = enqueue(&db.pool, Some(*c), "noop", json!({})).await.run_id;
            if turn == TURNS - 1 {
                last.push(run);
            }
        }
    }
    // A conversation's last turn ends after every turn before it (FIFO).
    for run in last {
        wait_status(&db.pool, run, "completed", ALL_DONE_WITHIN).await;
    }
    let total = (CONVERSATIONS * TURNS) as i64;

    let rows: Vec<(agent_host::db::ConversationId, String, String, DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
        "SELECT conversation_id, status, worker_id, started_at, finished_at FROM agent_run
         ORDER BY conversation_id, queue_pos",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len() as i64, total);
    let mut overlaps = Vec::new();
    let mut handovers = 0;
    for pair in rows.windows(2) {
        let (c0, _, w0, _, finished0) = &pair[0];
        let (c1, _, w1, started1, _) = &pair[1];
        if c0 != c1 {
            continue;
        }
        if w0 != w1 {
            handovers += 1;
        }
        if started1 < finished0 {
            overlaps.push(format!("{c1}: started {started1} before the previous turn finished {finished0}"));
        }
    }
    for (c, status, _, started, finished) in &rows {
        assert_eq!(status, "completed", "a turn of {c} ended {status}");
        assert!(started <= finished, "a turn of {c} finished {finished} before it started {started}");
    }
    eprintln!("{} turns, {handovers} handed between processes, {} overlapping", rows.len(), overlaps.len());
    assert!(
        overlaps.is_empty(),
        "{} of {} turns overlap their predecessor:\n{}",
        overlaps.len(),
        rows.len(),
        overlaps.join("\n")
    );
    drop((a, b));
}

/// Issue 41: the state machine's table (`lifecycle::TRANSITIONS`) and the
/// schema agree on every pair of statuses. A run of a resumable plugin is
/// brought to `from` by legal steps, then set to `to` in the shape the
/// lifecycle's functions write (a claim for running, attempt raised and
/// lease cleared for queued, waits raised for waiting, finished_at for an
/// ending): the table's pairs pass, every other pair is refused by the
/// transition trigger or a CHECK (23514).
#[tokio::test]
async fn every_status_pair_passes_the_schema_exactly_when_the_table_has_it() {
    use RunStatus::*;
    let db = TestDb::new().await;
    let all = [Queued, Running, Waiting, Completed, Failed, Cancelled];
    let shape = |to: RunStatus| match to {
        Running => {
            "claim_token = gen_random_uuid(), claim_expires_at = now() + interval '1 minute', started_at = now()"
        }
        Queued => "attempt = attempt + 1, claim_expires_at = NULL",
        Waiting => "waits = waits + 1, claim_expires_at = NULL",
        Completed | Failed | Cancelled => "finished_at = now(), claim_expires_at = NULL",
    };
    let set = |run: RunId, to: RunStatus| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(&format!("UPDATE agent_run SET status = $2, {} WHERE id = $1", shape(to)))
                .bind(run)
                .bind(to)
                .execute(&pool)
                .await
        }
    };
    let manifest = json!({ "durability": "resume" });
    let mut checked = 0;
    for from in all {
        // The legal way there: queued, then a claim, then the rest.
        let path: &[RunStatus] = match from {
            Queued => &[],
            Running => &[Running],
            _ => &[Running, from],
        };
        for to in all.into_iter().filter(|&to| to != from) {
            let run = enqueue_pinned(&db, "echo", Some(&manifest), json!({})).await;
            for &step in path {
                set(run, step).await.unwrap_or_else(|e| panic!("the way to {from}: {step}: {e}"));
            }
            let legal = lifecycle::TRANSITIONS.contains(&(from, to));
            match set(run, to).await {
                Ok(done) => {
                    assert!(legal, "{from} -> {to} passed the schema but is not in the table");
                    assert_eq!(done.rows_affected(), 1);
                }
                Err(sqlx::Error::Database(e)) => {
                    assert!(!legal, "{from} -> {to} is in the table but the schema refused it: {e}");
                    assert_eq!(e.code().as_deref(), Some("23514"), "{from} -> {to}: {e}");
                }
                Err(e) => panic!("{from} -> {to}: {e}"),
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 30);
}
