//! Query plans the host's statements keep, each with the cost it once had:
//! no JIT, the claim's probe of the running index, one generic plan per
//! prepared statement however long its arrays, key access once the tables
//! grow; and the one text the claim takes from outside, escaped.

use crate::support::*;
use agent_host::db::lifecycle;
use agent_host::db::RunId;
use serde_json::json;

/// Every connection of the host runs without JIT: the claim's estimated
/// cost grows with the queue (the planner prices each tenant's scan whole
/// before its LIMIT), and past `jit_above_cost` each claim compiled about a
/// hundred functions before running (45 ms against 0.9 ms at 20,000 queued).
#[tokio::test]
async fn the_hosts_connections_compile_no_query_just_in_time() {
    let db = TestDb::new().await;
    let jit: String = sqlx::query_scalar("SHOW jit").fetch_one(&db.pool).await.unwrap();
    assert_eq!(jit, "off");
}

/// `n` runs, each in its own conversation: running (claimed elsewhere, an
/// hour's lease) or queued.
async fn bulk_runs(pool: &sqlx::PgPool, n: i64, running: bool) {
    let (status, message, claim) = match running {
        true => ("running", "complete", "gen_random_uuid(), now() + interval '1 hour', 'elsewhere', now()"),
        false => ("queued", "queued", "NULL, NULL, NULL, NULL"),
    };
    sqlx::raw_sql(&format!(
        "WITH c AS (
             INSERT INTO conversation (id, owner_id, tenant_id)
             SELECT gen_random_uuid(), 'u', 't' FROM generate_series(1, {n}) RETURNING id),
         m AS (
             INSERT INTO message (id, conversation_id, role, content, status)
             SELECT gen_random_uuid(), id, 'user', 'x', '{message}' FROM c RETURNING id, conversation_id)
         INSERT INTO agent_run (id, conversation_id, owner_id, tenant_id, user_message_id, plugin, status,
                                claim_token, claim_expires_at, worker_id, started_at)
         SELECT gen_random_uuid(), conversation_id, 'u', 't', id, 'noop', '{status}', {claim}
         FROM m;"
    ))
    .execute(pool)
    .await
    .unwrap();
}

/// The claim's pre-filter (skip conversations with a running turn) stays a
/// probe of `one_running_per_conversation` per candidate. Left to itself the
/// planner hashed the whole index on every claim once many runs were running
/// (or had run and not been vacuumed yet): 4.5 ms a claim at 16,000 running
/// against 0.9 ms probing.
#[tokio::test]
async fn a_claim_probes_the_running_index_per_candidate_instead_of_hashing_it() {
    const RUNS: i64 = 5_000;
    let db = TestDb::new().await;
    // RUNS running elsewhere and RUNS queued, each in its own conversation.
    bulk_runs(&db.pool, RUNS, true).await;
    bulk_runs(&db.pool, RUNS, false).await;
    sqlx::query("ANALYZE agent_run").execute(&db.pool).await.unwrap();
    let claim = claim_args("w", 10, true);
    let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {}", lifecycle::claim_sql(&claim, &[])))
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let plan = plan.join("\n");
    assert!(!plan.contains("hashed SubPlan"), "the claim hashes a whole index:\n{plan}");
    assert!(plan.contains("one_running_per_conversation"), "no probe of the running index:\n{plan}");
    let claimed = lifecycle::claim_batch(&db.pool, &claim).await.unwrap().runs;
    assert_eq!(claimed.len(), 10);
    let running: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE status = 'running'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(running, RUNS + 10, "a claim took a run that was running");
}

/// How often the prepared statement whose text contains `marker`, on the
/// pool's one connection, was planned generic and custom.
async fn plans(pool: &sqlx::PgPool, marker: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements
         WHERE strpos(statement, $1) > 0 AND strpos(statement, 'pg_prepared_statements') = 0",
    )
    .bind(marker)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// PostgreSQL plans a prepared statement's first five executions for their
/// parameters, then keeps a generic plan unless the custom ones look
/// cheaper. The post-commit wake unnested its array directly, and each
/// call's length made the custom plan look cheaper: it was planned anew on
/// every call (14,563 plans in 19,621 calls of a 60,000-run drain, 3.3 s of
/// the server's CPU). The claim's passed-over conversations are an array
/// too. Both now keep one generic plan, however long the arrays.
#[tokio::test]
async fn the_claim_and_the_post_commit_wake_keep_one_generic_plan() {
    const CALLS: usize = 12;
    let db = TestDb::new().await;
    // A queue as deep as a drain's: with an empty table every plan costs
    // next to nothing and the difference never shows.
    bulk_runs(&db.pool, 5_000, false).await;
    sqlx::query("ANALYZE agent_run").execute(&db.pool).await.unwrap();
    let pool = db.pool(1).await;
    for i in 0..CALLS {
        // One to three runs ended at once, as in a drain: each custom plan
        // for so short an array looked cheaper than the generic one.
        let n = 1 + i % 3;
        let ended: Vec<_> = (0..n).map(|_| (RunId::new(), agent_host::db::ConversationId::new())).collect();
        lifecycle::announce_ended(&mut *pool.acquire().await.unwrap(), &ended).await.unwrap();
        assert_eq!(lifecycle::claim_batch(&pool, &claim_args("w", 3, true)).await.unwrap().runs.len(), 3);
    }
    // The wake: at most the five first executions planned for their values.
    let (generic, custom) = plans(&pool, "SELECT DISTINCT c FROM unnest").await;
    assert_eq!(generic + custom, CALLS as i64, "not one prepared statement");
    assert!(custom <= 5, "the wake was planned for its parameters {custom} times in {CALLS} calls");
    // The claim has no parameters at all: never planned for values.
    let (generic, custom) = plans(&pool, "WITH RECURSIVE").await;
    assert_eq!((generic, custom), (CALLS as i64, 0), "the claim was planned for its parameters");
}

/// A worker's own connection (`db::OwnConnection`: the dispatcher's claims,
/// the finisher's endings) keeps one generic plan per statement for its
/// life, replanned only when the tables' statistics change. Made while the
/// tables were small (a fresh database, a host started before its first
/// runs), the claim's plan found its rows again with a hash over a scan of
/// every run, and the user message's update over a scan of every message,
/// on every claim until autovacuum next analyzed the tables: in the
/// benchmark's pickup figure, which starts on emptied tables, a fifth of the
/// pickup. Those connections plan no sequential scan now.
#[tokio::test]
async fn a_claim_planned_on_empty_tables_reaches_rows_by_key_once_they_grow() {
    let db = TestDb::new().await;
    let mut own = agent_host::db::OwnConnection::new(&db.pool);
    // As an idle worker claims: for all of its ten slots.
    let claim = claim_args("w", 10, true);
    // The plan is made now, with nothing in the tables.
    let batch = lifecycle::claim_batch_on(own.get().await.unwrap(), &claim).await.unwrap();
    assert!(batch.runs.is_empty());
    // Runs and messages the plan never saw (no ANALYZE since), and one to claim.
    bulk_runs(&db.pool, 2_000, true).await;
    bulk_runs(&db.pool, 1, false).await;
    let mut tx = sqlx::Connection::begin(own.get().await.unwrap()).await.unwrap();
    let batch = lifecycle::claim_batch_on(&mut tx, &claim).await.unwrap();
    assert_eq!(batch.runs.len(), 1);
    // This transaction's scans, as the server counted them.
    let scans: Vec<(String, i64)> = sqlx::query_as(
        "SELECT relname::text, seq_scan FROM pg_stat_xact_user_tables
         WHERE relname IN ('agent_run', 'message') ORDER BY relname",
    )
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    assert_eq!(scans, [("agent_run".to_string(), 0), ("message".to_string(), 0)], "the claim scanned whole tables");
    tx.rollback().await.unwrap();
    own.close().await;
}

/// The claim writes its values in as literals; the one text from outside
/// (the worker's id, from the configuration) is an escaped string, so a
/// quote, a backslash or a placeholder's name in it is stored as given.
#[tokio::test]
async fn a_worker_id_with_quotes_and_backslashes_is_written_as_given() {
    let db = TestDb::new().await;
    let queued = enqueue(&db.pool, None, "noop", json!({})).await;
    let worker = r"o'brien\n {except} $1 E'x'";
    let claimed = lifecycle::claim_batch(&db.pool, &claim_args(worker, 1, true)).await.unwrap().runs;
    assert_eq!(claimed.len(), 1);
    let (stored, journaled): (String, String) = sqlx::query_as(
        "SELECT r.worker_id, e.payload ->> 'worker_id' FROM agent_run r
         JOIN run_event e ON e.run_id = r.id AND e.type = 'run_started' WHERE r.id = $1",
    )
    .bind(queued.run_id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((stored.as_str(), journaled.as_str()), (worker, worker));
}
