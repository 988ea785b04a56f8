//! The run's host side against a real PostgreSQL: the journal writer's one
//! outcome per event when the database goes away (and comes back, or not),
//! text the database cannot store, and `RunHost` as the one owner of a run's
//! imports for built-in agents (tools behind grants, history, bounds).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use agent_host::agent::{Agent, AgentError, AgentRegistry, HostError, RunHost, RunInput};
use agent_host::db::events::FIRST_RUN_SEQ;
use agent_host::db::lifecycle::{self, Claim, ClaimedRun};
use agent_host::run::host::STREAMED_BYTES_MAX;
use agent_host::run::journal::{Journal, JournalConfig, JournalStats};
use agent_host::run::manifest::Manifest;
use agent_host::tools::{LlmConfig, ToolRegistry};
use agent_host::worker::Worker;
use async_trait::async_trait;
use serde_json::{json, Value};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::support::*;

const APP: &str = "journal-under-test";

/// A database that can be taken away from one pool and given back.
struct Outage {
    /// On the server's `postgres` database: a database cannot refuse its own sessions.
    admin: PgConnection,
    /// A session on the test database opened before the outage, which it spares.
    reader: PgConnection,
    name: String,
}

impl Outage {
    async fn new(db: &TestDb) -> Outage {
        let mut reader = PgConnection::connect(&db.url).await.unwrap();
        let name: String = sqlx::query_scalar("SELECT current_database()").fetch_one(&mut reader).await.unwrap();
        let base = db.url.rsplit_once('/').unwrap().0;
        let admin = PgConnection::connect(&format!("{base}/postgres")).await.unwrap();
        Outage { admin, reader, name }
    }

    /// No new connections to the database, and the journal's pool's
    /// sessions ended: every statement of that pool fails.
    async fn begin(&mut self) {
        sqlx::query(&format!("ALTER DATABASE {} ALLOW_CONNECTIONS false", self.name))
            .execute(&mut self.admin)
            .await
            .unwrap();
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1")
            .bind(APP)
            .execute(&mut self.admin)
            .await
            .unwrap();
    }

    async fn end(&mut self) {
        sqlx::query(&format!("ALTER DATABASE {} ALLOW_CONNECTIONS true", self.name))
            .execute(&mut self.admin)
            .await
            .unwrap();
    }

    async fn events(&mut self, run: agent_host::db::RunId) -> Vec<(i32, String, Value)> {
        sqlx::query_as("SELECT seq, type, payload FROM run_event WHERE run_id = $1 ORDER BY seq")
            .bind(run)
            .fetch_all(&mut self.reader)
            .await
            .unwrap()
    }
}

/// A pool whose sessions the outage can find, failing fast while it lasts.
async fn journal_pool(db: &TestDb) -> PgPool {
    let options: PgConnectOptions = db.url.parse::<PgConnectOptions>().unwrap().application_name(APP);
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_millis(500))
        .connect_with(options)
        .await
        .unwrap()
}

async fn claimed(db: &TestDb) -> ClaimedRun {
    enqueue(&db.pool, None, "noop", json!({})).await;
    let claim = Claim {
        limit: 1,
        lease: LONG,
        worker_id: "journal",
        prefilter: true,
        tenant_max_running: None,
        rooms: Default::default(),
    };
    lifecycle::claim(&db.pool, &claim).await.unwrap().pop().unwrap()
}

fn start(pool: PgPool, run: &ClaimedRun, give_up_after: Duration, stats: &Arc<JournalStats>) -> Journal {
    let config = JournalConfig { flush_every: Duration::from_millis(20), give_up_after };
    Journal::start(pool, run.id, run.claim_token, FIRST_RUN_SEQ, config, CancellationToken::new(), stats.clone())
}

async fn wait_failures(stats: &JournalStats, n: u64) {
    wait_for("failed flushes", LONG, || async { stats.flush_failures.load(Ordering::Relaxed) >= n }).await;
}

#[tokio::test]
async fn an_event_emitted_while_the_database_is_away_is_written_once_when_it_returns() {
    let db = TestDb::new().await;
    let run = claimed(&db).await;
    let stats = Arc::new(JournalStats::default());
    let mut journal = start(journal_pool(&db).await, &run, LONG, &stats);
    journal.event("probe", json!({ "n": 1 }), None).await.unwrap();
    let mut outage = Outage::new(&db).await;
    outage.begin().await;

    let emitter = tokio::spawn(async move {
        journal.delta(json!({ "delta": "while away" }), None).await.unwrap();
        let r = journal.event("probe", json!({ "n": 2 }), None).await;
        (r, journal)
    });
    // The flush failed at least twice (it is being retried) and the emitter
    // has not been told anything: neither "written" nor "failed".
    wait_failures(&stats, 2).await;
    assert!(!emitter.is_finished(), "the emitter was answered while its event was unwritten");
    assert_eq!(outage.events(run.id).await.len(), 4, "nothing of the outage is written yet");

    outage.end().await;
    let (r, journal) = tokio::time::timeout(LONG, emitter).await.unwrap().unwrap();
    assert_eq!(r, Ok(()), "written once the database is back");
    journal.close().await.unwrap();
    let events = outage.events(run.id).await;
    let seqs: Vec<i32> = events.iter().map(|e| e.0).collect();
    assert_eq!(seqs, (1..=6).collect::<Vec<_>>(), "contiguous, nothing twice: {events:?}");
    assert_eq!(events[4].1, "content_delta");
    assert_eq!(events[4].2["delta"], "while away");
    assert_eq!(events.iter().filter(|e| e.1 == "probe" && e.2["n"] == 2).count(), 1);
}

#[tokio::test]
async fn a_journal_that_gives_up_never_writes_what_it_refused() {
    let db = TestDb::new().await;
    let run = claimed(&db).await;
    let stats = Arc::new(JournalStats::default());
    let mut journal = start(journal_pool(&db).await, &run, Duration::from_millis(300), &stats);
    let gave_up = journal.gave_up();
    journal.event("probe", json!({ "n": 1 }), None).await.unwrap();
    let mut outage = Outage::new(&db).await;
    outage.begin().await;

    let r = tokio::time::timeout(LONG, journal.event("probe", json!({ "n": 2 }), None)).await.unwrap();
    assert!(matches!(r, Err(HostError::Unavailable(_))), "{r:?}");
    assert!(gave_up.is_cancelled(), "the run is told");
    assert_eq!(stats.gave_up.load(Ordering::Relaxed), 1);

    // The database comes back: what was refused stays unwritten, and the
    // journal refuses everything after.
    outage.end().await;
    let later = journal.event("probe", json!({ "n": 3 }), None).await;
    assert!(matches!(later, Err(HostError::Unavailable(_))), "{later:?}");
    assert!(matches!(journal.close().await, Err(HostError::Unavailable(_))));
    let kinds: Vec<(String, Value)> = outage.events(run.id).await.into_iter().map(|e| (e.1, e.2)).collect();
    assert_eq!(kinds.len(), 4, "{kinds:?}");
    assert_eq!(kinds[3], ("probe".to_string(), json!({ "n": 1 })));
}

/// Streams and answers text with U+0000 in it, as a third-party model can.
struct Nul;

#[async_trait]
impl Agent for Nul {
    async fn run(&self, host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        host.emit_delta("before\u{0}after").await?;
        host.emit_event("note\u{0}", json!({ "k\u{0}": "v\u{0}" })).await?;
        Ok("before\u{0}after".into())
    }
}

/// Answers with what it was given: the history's length, and what a granted
/// and an ungranted tool call answer.
struct Probe;

#[async_trait]
impl Agent for Probe {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        let args = json!({ "messages": [{ "role": "user", "content": "sky today" }] }).to_string();
        let model: Value = serde_json::from_str(&host.call_tool("llm", &args).await?).unwrap();
        let denied = host.call_tool("weather", "{}").await.unwrap_err();
        let history: Vec<String> = input.history.iter().map(|m| format!("{}:{}", m.role, m.content)).collect();
        Ok(json!({ "history": history, "model": model["content"], "denied": denied.to_string() }).to_string())
    }
}

/// Streams more than a partial answer may keep, then waits to be stopped.
struct Flood;

#[async_trait]
impl Agent for Flood {
    async fn run(&self, host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        let chunk = "é".repeat(32 * 1024);
        for _ in 0..(2 * STREAMED_BYTES_MAX / chunk.len()) {
            host.emit_delta(&chunk).await?;
        }
        host.emit_event("flooded", json!({})).await?;
        host.cancelled().await;
        Err(HostError::Cancelled.into())
    }
}

fn agents() -> AgentRegistry {
    let tools = ToolRegistry::from_config(&LlmConfig::default(), &[]).unwrap();
    let mut agents = AgentRegistry::with_builtins().with_tools(tools);
    agents.insert("nul", Arc::new(Nul));
    agents.insert("flood", Arc::new(Flood));
    let granted = Manifest::parse(&json!({ "tools": ["llm"] })).unwrap();
    agents.insert_with_manifest("probe", Arc::new(Probe), granted);
    agents
}

async fn with_worker() -> (TestDb, Worker) {
    let db = TestDb::new().await;
    let w = start_worker_with(&db, agents(), fast_config("w")).await;
    (db, w)
}

async fn answer(pool: &PgPool, run: agent_host::db::RunId) -> (String, String) {
    sqlx::query_as("SELECT content, status FROM message WHERE run_id = $1 AND role = 'assistant'")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn text_the_database_cannot_store_is_made_storable_not_fatal() {
    let (db, w) = with_worker().await;
    let run = enqueue(&db.pool, None, "nul", json!({})).await;
    wait_status(&db.pool, run.run_id, "completed", LONG).await;
    assert_eq!(answer(&db.pool, run.run_id).await, ("before\u{FFFD}after".into(), "complete".into()));
    let events = journal_payloads(&db.pool, run.run_id).await;
    assert_eq!(deltas_text(&events), "before\u{FFFD}after");
    let note = events.iter().find(|e| e.1 == "note\u{FFFD}").expect("the event, its kind made storable");
    assert_eq!(note.2, json!({ "k\u{FFFD}": "v\u{FFFD}" }));
    assert_eq!(w.journal_stats().nul_replaced.load(Ordering::Relaxed), 5);
    w.drain().await;
}

#[tokio::test]
async fn a_built_in_agent_gets_history_and_tools_behind_its_grants() {
    let (db, w) = with_worker().await;
    let first = enqueue(&db.pool, None, "echo", json!({})).await;
    wait_status(&db.pool, first.run_id, "completed", LONG).await;
    let second = enqueue(&db.pool, Some(first.conversation_id), "probe", json!({})).await;
    wait_status(&db.pool, second.run_id, "completed", LONG).await;
    let said: Value = serde_json::from_str(&answer(&db.pool, second.run_id).await.0).unwrap();
    assert_eq!(said["history"], json!(["user:hello agent", "assistant:hello agent"]));
    assert!(said["model"].as_str().unwrap().contains("sky today"), "{said}");
    assert_eq!(said["denied"], "denied: tool \"weather\" is not granted to this plugin");
    // The call is journaled like a guest's, with its ordinal.
    let events = journal_payloads(&db.pool, second.run_id).await;
    let started: Vec<&Value> = events.iter().filter(|e| e.1 == "tool_call_started").map(|e| &e.2).collect();
    assert_eq!(started, [&json!({ "call_index": 1, "name": "llm" })]);
    let usage: Value = sqlx::query_scalar("SELECT usage FROM agent_run WHERE id = $1")
        .bind(second.run_id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(usage["model_calls"], 1);
    w.drain().await;
}

#[tokio::test]
async fn the_partial_answer_a_run_keeps_is_bounded() {
    let (db, w) = with_worker().await;
    let run = enqueue(&db.pool, None, "flood", json!({})).await;
    wait_for("the flood to be journaled", LONG, || {
        let pool = db.pool.clone();
        async move { journal(&pool, run.run_id).await.iter().any(|e| e.1 == "flooded") }
    })
    .await;
    lifecycle::cancel(&db.pool, run.run_id, &owner().user_id).await.unwrap();
    wait_status(&db.pool, run.run_id, "cancelled", LONG).await;
    let (partial, status) = answer(&db.pool, run.run_id).await;
    assert_eq!(status, "partial");
    assert!(partial.len() <= STREAMED_BYTES_MAX && partial.len() > STREAMED_BYTES_MAX - 4, "{}", partial.len());
    assert!(partial.chars().all(|c| c == 'é'));
    // The journal has all of it.
    assert_eq!(deltas_text(&journal_payloads(&db.pool, run.run_id).await).len(), 2 * STREAMED_BYTES_MAX);
    w.drain().await;
}
