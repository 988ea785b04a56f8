//! Journal, hub and tails: merged deltas, fenced flushes, SSE replay and
//! rejoin, synthesized endings, retention, and the hub's fallbacks.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::support::sse::SseClient;
use crate::support::*;
use agent_host::agent::{Agent, AgentError, AgentRegistry, RunHost, RunInput};
use agent_host::api::{self, AppState};
use agent_host::db::{journal, lifecycle, tokens, RunId};
use agent_host::hub::Hub;
use agent_host::worker::{Worker, WorkerConfig};
use async_trait::async_trait;
use serde_json::{json, Value};

/// Emits `n` deltas as fast as it can, a structural event in the middle, and
/// returns the whole text.
struct Chatty(usize);

#[async_trait]
impl Agent for Chatty {
    async fn run(&self, host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        let mut text = String::new();
        for i in 0..self.0 {
            if i == self.0 / 2 {
                host.emit_event("note", json!({ "at": i })).await?;
            }
            let piece = format!("{i} ");
            host.emit_delta(&piece).await?;
            text.push_str(&piece);
        }
        Ok(text)
    }
}

fn agents() -> AgentRegistry {
    let mut a = AgentRegistry::with_builtins();
    a.insert("chatty", Arc::new(Chatty(1000)));
    a.insert("blobs", Arc::new(Blobs));
    a
}

/// An HTTP server and a worker in this process, on a real port.
struct Host {
    base: String,
    token: String,
    worker: Option<Worker>,
    server: tokio::task::JoinHandle<()>,
}

impl Host {
    async fn start(db: &TestDb, hub: Option<Hub>, config: WorkerConfig, keepalive: Duration) -> Host {
        Host::start_with(db, hub, config, |state| state.keepalive = keepalive).await
    }

    /// [`Host::start`] with the app state as `configure` leaves it.
    async fn start_with(
        db: &TestDb,
        hub: Option<Hub>,
        config: WorkerConfig,
        configure: impl FnOnce(&mut AppState),
    ) -> Host {
        let worker = Worker::start(db.pool.clone(), hub.clone(), agents(), config).await.unwrap();
        let mut state = AppState::new(db.pool.clone(), agents(), hub);
        state.stats = Some(worker.observer());
        configure(&mut state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, api::router(state)).await.unwrap();
        });
        let token = tokens::create(&db.pool, "alice", "acme", false).await.unwrap();
        Host { base, token, worker: Some(worker), server }
    }

    fn events_url(&self, run: RunId) -> String {
        format!("{}/v1/runs/{run}/events", self.base)
    }

    async fn stop(mut self) {
        self.worker.take().unwrap().drain().await;
        self.server.abort();
    }
}

#[tokio::test]
async fn deltas_merge_structural_events_write_through_and_order_holds() {
    let db = TestDb::new().await;
    let e = enqueue(&db.pool, None, "chatty", json!({})).await;
    let w = start_worker_with(&db, agents(), fast_config("w")).await;
    wait_status(&db.pool, e.run_id, "completed", LONG).await;
    let j = journal_payloads(&db.pool, e.run_id).await;
    let expected: String = (0..1000).map(|i| format!("{i} ")).collect();
    assert_eq!(deltas_text(&j), expected, "merged deltas keep every character, in order");
    // The structural event sits between the halves, written through.
    let note = j.iter().position(|(_, t, _)| t == "note").unwrap();
    let before = deltas_text(&j[..note]);
    assert_eq!(before, (0..500).map(|i| format!("{i} ")).collect::<String>());
    let rows = j.iter().filter(|(_, t, _)| t == "content_delta").count();
    eprintln!("journal rows for 1000 deltas: {rows}");
    assert!(rows <= 40, "{rows} delta rows for 1000 deltas: not merged");
    assert_journal_sound(&db.pool, e.run_id).await;
    let (content, status): (String, String) =
        sqlx::query_as("SELECT content, status FROM message WHERE run_id = $1 AND role = 'assistant'")
            .bind(e.run_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((content, status.as_str()), (expected, "complete"));
    let js = w.journal_stats();
    assert_eq!(js.deltas_in.load(Ordering::Relaxed), 1000);
    w.drain().await;
}

/// A run reaped under its worker: its next journal flush is fenced, writes
/// nothing, and stops the run well before any heartbeat would have.
#[tokio::test]
async fn a_fenced_flush_writes_nothing_and_stops_the_run() {
    let db = TestDb::new().await;
    let e = enqueue(&db.pool, None, "sleep", json!({ "steps": 100000, "step_ms": 10 })).await;
    let config = WorkerConfig {
        lease: Duration::from_secs(600),
        heartbeat: Duration::from_secs(300), // the journal, not the heartbeat, must notice
        reap_interval: Duration::from_secs(3600),
        journal_flush: Duration::from_millis(20),
        ..fast_config("w")
    };
    let w = Worker::start(db.pool.clone(), None, agents(), config).await.unwrap();
    let pool = db.pool.clone();
    wait_for("some deltas", LONG, || {
        let pool = pool.clone();
        async move { journal(&pool, e.run_id).await.len() > 5 }
    })
    .await;
    update_run(&db.pool, e.run_id, "claim_expires_at = now() - interval '1 hour'").await;
    let expired = lifecycle::find_expired(&db.pool, Duration::ZERO, 10).await.unwrap();
    assert!(lifecycle::reap(&db.pool, expired[0], Duration::ZERO).await.unwrap());
    let ended = journal(&db.pool, e.run_id).await;
    wait_fenced(&w, "the worker to stand down").await;
    assert_eq!(journal(&db.pool, e.run_id).await, ended);
    w.drain().await;
}

#[tokio::test]
async fn sse_replays_then_follows_live_until_complete() {
    let db = TestDb::new().await;
    let host = Host::start(&db, Some(Hub::start(db.url.clone())), fast_config("w"), Duration::from_secs(15)).await;
    let e = enqueue_as(&db.pool, &owner(), None, "sleep", json!({ "steps": 20, "step_ms": 20 })).await;
    let mut client = SseClient::connect(&host.events_url(e.run_id), &host.token, None).await;
    let frames = client.collect(LONG).await;
    let seqs: Vec<i64> = frames.iter().map(|f| f.data["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>(), "every seq once, in order");
    for f in &frames {
        assert_eq!(f.id.as_deref(), Some(f.data["seq"].to_string().as_str()));
        assert_eq!(f.event, f.data["type"].as_str().unwrap());
    }
    assert_eq!(frames[0].event, "user_message_created");
    assert_eq!(frames.last().unwrap().event, "complete");
    assert_eq!(frames.last().unwrap().data["status"], "completed");
    let j = journal_payloads(&db.pool, e.run_id).await;
    assert_eq!(frames.len(), j.len(), "the stream equals the journal");
    host.stop().await;
}

/// A client drops at seq k and reconnects with `Last-Event-ID: k`: it gets
/// exactly k+1 to the end. No gap, no duplicate.
#[tokio::test]
async fn a_client_that_drops_and_rejoins_gets_exactly_the_rest() {
    let db = TestDb::new().await;
    let host = Host::start(&db, Some(Hub::start(db.url.clone())), fast_config("w"), Duration::from_secs(15)).await;
    let e = enqueue(&db.pool, None, "sleep", json!({ "steps": 30, "step_ms": 30 })).await;
    let mut seen = Vec::new();
    let mut client = SseClient::connect(&host.events_url(e.run_id), &host.token, None).await;
    while seen.len() < 6 {
        let f = client.next(LONG).await.expect("stream ended early");
        seen.push(f.data["seq"].as_i64().unwrap());
    }
    drop(client); // the tab closes mid-run
    let k = *seen.last().unwrap() as i32;
    // `from` in the URL is older than the header: the header wins, as for EventSource.
    let url = format!("{}?from=1", host.events_url(e.run_id));
    let mut client = SseClient::connect(&url, &host.token, Some(k)).await;
    let rest = client.collect(LONG).await;
    seen.extend(rest.iter().map(|f| f.data["seq"].as_i64().unwrap()));
    let j = journal_payloads(&db.pool, e.run_id).await;
    assert_eq!(seen, j.iter().map(|(s, _, _)| *s as i64).collect::<Vec<_>>());
    assert_eq!(rest.last().unwrap().event, "complete");
    // Closing the stream was not a stop.
    assert_eq!(status(&db.pool, e.run_id).await, "completed");
    host.stop().await;
}

#[tokio::test]
async fn json_pages_walk_the_journal_with_next_from() {
    let db = TestDb::new().await;
    let host = Host::start(&db, Some(Hub::start(db.url.clone())), fast_config("w"), Duration::from_secs(15)).await;
    let e = enqueue(&db.pool, None, "echo", json!({})).await;
    wait_status(&db.pool, e.run_id, "completed", LONG).await;
    let client = reqwest::Client::new();
    let get = |from: i64| {
        client
            .get(format!("{}?from={from}", host.events_url(e.run_id)))
            .bearer_auth(&host.token)
            .header("Accept", "application/json")
            .send()
    };
    let page: Value = get(0).await.unwrap().json().await.unwrap();
    let events = page["events"].as_array().unwrap();
    assert_eq!(page["terminal"], true);
    assert_eq!(page["next_from"], events.last().unwrap()["seq"]);
    assert_eq!(events.last().unwrap()["type"], "complete");
    let tail: Value = get(3).await.unwrap().json().await.unwrap();
    assert_eq!(tail["events"][0]["seq"], 4);
    let res =
        client.get(format!("{}?from=-1", host.events_url(e.run_id))).bearer_auth(&host.token).send().await.unwrap();
    assert_eq!(res.status(), 400);
    // Someone else's run: 404, streams included.
    let bob = tokens::create(&db.pool, "bob", "acme", false).await.unwrap();
    let res = client
        .get(host.events_url(e.run_id))
        .bearer_auth(&bob)
        .header("Accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 404);
    host.stop().await;
}

/// A finalizer that died after the status flip but before its `complete`:
/// the tail ends with one synthesized from the row.
#[tokio::test]
async fn a_missing_complete_is_synthesized_from_the_run_row() {
    let db = TestDb::new().await;
    let host = Host::start(
        &db,
        Some(Hub::start(db.url.clone())),
        WorkerConfig { dispatch: false, ..fast_config("w") },
        Duration::from_millis(200),
    )
    .await;
    let e = enqueue(&db.pool, None, "noop", json!({})).await;
    lifecycle::claim(
        &db.pool,
        &lifecycle::Claim {
            limit: 1,
            lease: LONG,
            worker_id: "dying",
            prefilter: true,
            tenant_max_running: None,
            rooms: Default::default(),
        },
    )
    .await
    .unwrap();
    let mut client = SseClient::connect(&host.events_url(e.run_id), &host.token, None).await;
    for _ in 0..3 {
        client.next(LONG).await.unwrap();
    }
    // The status flips; the complete event never comes.
    update_run(&db.pool, e.run_id, "status = 'failed', error = 'finalizer died', finished_at = now()").await;
    let last = client.next(LONG).await.unwrap();
    assert_eq!(last.event, "complete");
    assert_eq!((last.data["status"].as_str(), last.data["error"].as_str()), (Some("failed"), Some("finalizer died")));
    assert_eq!(last.data["seq"], 4);
    assert!(client.next(LONG).await.is_none(), "the stream ends after the complete");
    host.stop().await;
}

#[tokio::test]
async fn retention_trims_events_keeps_the_transcript_and_tails_still_end() {
    let db = TestDb::new().await;
    let host = Host::start(&db, Some(Hub::start(db.url.clone())), fast_config("w"), Duration::from_secs(15)).await;
    let old = enqueue(&db.pool, None, "echo", json!({})).await;
    let fresh = enqueue(&db.pool, None, "echo", json!({})).await;
    wait_status(&db.pool, old.run_id, "completed", LONG).await;
    wait_status(&db.pool, fresh.run_id, "completed", LONG).await;
    update_run(&db.pool, old.run_id, "finished_at = now() - interval '25 hours'").await;
    assert_eq!(journal::trim_terminal(&db.pool, Duration::from_secs(24 * 3600), 100).await.unwrap(), 1);
    assert!(journal(&db.pool, old.run_id).await.is_empty());
    assert!(!journal(&db.pool, fresh.run_id).await.is_empty());
    let request: Option<Value> = sqlx::query_scalar("SELECT request FROM agent_run WHERE id = $1")
        .bind(old.run_id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(request.is_none());
    let messages: i64 = sqlx::query_scalar("SELECT count(*) FROM message WHERE conversation_id = $1")
        .bind(old.conversation_id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(messages, 2, "the transcript stays");
    let mut client = SseClient::connect(&host.events_url(old.run_id), &host.token, None).await;
    let frames = client.collect(LONG).await;
    assert_eq!(frames.len(), 1);
    assert_eq!((frames[0].event.as_str(), frames[0].data["status"].as_str()), ("complete", Some("completed")));
    assert_eq!(journal::trim_terminal(&db.pool, Duration::from_secs(24 * 3600), 100).await.unwrap(), 0);
    host.stop().await;
}

/// Issue 40: retries keep retention. A retry copies its run's request
/// snapshot, which retention nulls; a retry of a trimmed run must still be
/// trimmed when its own time comes (retention once took a null snapshot to
/// mean "trimmed already").
#[tokio::test]
async fn a_retry_of_a_trimmed_run_is_trimmed_in_its_turn() {
    let db = TestDb::new().await;
    let first = enqueue(&db.pool, None, "echo", json!({})).await;
    let owner = owner();
    assert!(lifecycle::cancel(&db.pool, first.run_id, &owner.user_id).await.unwrap().is_some());
    update_run(&db.pool, first.run_id, "finished_at = now() - interval '25 hours'").await;
    assert_eq!(journal::trim_terminal(&db.pool, Duration::from_secs(24 * 3600), 100).await.unwrap(), 1);
    let retry = lifecycle::retry(&db.pool, first.run_id, &owner.user_id, None).await.unwrap();
    assert!(!journal(&db.pool, retry.run_id).await.is_empty(), "the retry has its own journal");
    assert!(lifecycle::cancel(&db.pool, retry.run_id, &owner.user_id).await.unwrap().is_some());
    update_run(&db.pool, retry.run_id, "finished_at = now() - interval '25 hours'").await;
    assert_eq!(journal::trim_terminal(&db.pool, Duration::from_secs(24 * 3600), 100).await.unwrap(), 1);
    assert!(journal(&db.pool, retry.run_id).await.is_empty(), "the retry's journal is trimmed too");
    assert_eq!(journal::trim_terminal(&db.pool, Duration::from_secs(24 * 3600), 100).await.unwrap(), 0);
}

/// With the hub down for good, runs still start and tails still deliver, at
/// the poll interval: slower, never wrong.
#[tokio::test]
async fn with_the_hub_down_everything_falls_back_to_polling() {
    let db = TestDb::new().await;
    let dead = Hub::start("postgres://postgres@127.0.0.1:1/nowhere".into());
    let config = WorkerConfig { poll_tick: Duration::from_millis(300), ..fast_config("w") };
    let host = Host::start(&db, Some(dead.clone()), config, Duration::from_millis(300)).await;
    let e = enqueue(&db.pool, None, "sleep", json!({ "steps": 5, "step_ms": 50 })).await;
    let mut client = SseClient::connect(&host.events_url(e.run_id), &host.token, None).await;
    let frames = client.collect(LONG).await;
    assert_eq!(frames.last().unwrap().event, "complete");
    assert_eq!(frames.len(), journal(&db.pool, e.run_id).await.len());
    assert!(!dead.stats().connected.load(Ordering::Relaxed));
    host.stop().await;
}

/// The LISTEN connection is killed: the hub reconnects, and wakes are
/// milliseconds again (the poll tick here is a minute).
#[tokio::test]
async fn a_killed_listen_connection_reconnects_and_wakes_come_back() {
    let db = TestDb::new().await;
    let hub = Hub::start(db.url.clone());
    let config = WorkerConfig { poll_tick: Duration::from_secs(60), ..fast_config("w") };
    let host = Host::start(&db, Some(hub.clone()), config, Duration::from_secs(60)).await;
    let first = enqueue(&db.pool, None, "echo", json!({})).await;
    wait_status(&db.pool, first.run_id, "completed", Duration::from_secs(10)).await;

    let killed: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = $1",
    )
    .bind(agent_host::hub::APPLICATION_NAME)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(killed >= 1, "no LISTEN connection found");
    let h = hub.clone();
    wait_for("the hub to reconnect", LONG, || {
        let h = h.clone();
        async move { h.stats().reconnects.load(Ordering::Relaxed) >= 1 && h.stats().connected.load(Ordering::Relaxed) }
    })
    .await;
    let second = enqueue(&db.pool, None, "echo", json!({})).await;
    let mut client = SseClient::connect(&host.events_url(second.run_id), &host.token, None).await;
    let frames = client.collect(Duration::from_secs(10)).await;
    assert_eq!(frames.last().unwrap().event, "complete");
    host.stop().await;
}

/// A quiet run still sends keepalives, so proxies do not cut the stream.
#[tokio::test]
async fn a_quiet_stream_gets_keepalives() {
    let db = TestDb::new().await;
    let host = Host::start(&db, Some(Hub::start(db.url.clone())), fast_config("w"), Duration::from_millis(100)).await;
    let e = enqueue(&db.pool, None, "sleep", json!({ "steps": 2, "step_ms": 700 })).await;
    let mut client = SseClient::connect(&host.events_url(e.run_id), &host.token, None).await;
    let frames = client.collect(LONG).await;
    assert_eq!(frames.last().unwrap().event, "complete");
    assert!(client.comments >= 3, "only {} keepalives over a 1.4 s quiet run", client.comments);
    host.stop().await;
}

/// Emits `config.events` events of `config.bytes` bytes each.
struct Blobs;

#[async_trait]
impl Agent for Blobs {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        let n = input.config["events"].as_u64().unwrap_or(0);
        let blob = "x".repeat(input.config["bytes"].as_u64().unwrap_or(0) as usize);
        for i in 0..n {
            host.emit_event("blob", json!({ "i": i, "data": blob })).await?;
        }
        Ok("done".into())
    }
}

/// A host with the `blobs` agent, and its run of `events` blobs of `bytes`
/// each, completed.
async fn blobs_run(db: &TestDb, events: u64, bytes: u64) -> (crate::support::http::TestHost, RunId) {
    let mut agents = AgentRegistry::with_builtins();
    agents.insert("blobs", Arc::new(Blobs));
    let host =
        crate::support::http::TestHost::start(db, Some(Hub::start(db.url.clone())), agents, fast_config("w")).await;
    let config = json!({ "events": events, "bytes": bytes });
    let (code, run) =
        host.call("POST", "/v1/runs", Some(json!({ "content": "go", "plugin": "blobs", "config": config }))).await;
    assert_eq!(code, 202, "{run}");
    let id: RunId = serde_json::from_value(run["run_id"].clone()).unwrap();
    assert_eq!(wait_terminal(&db.pool, id, LONG).await, "completed");
    (host, id)
}

/// Issue 40: a JSON page of a run's events is bounded in bytes as well as
/// rows, so a few readers of a run with a long journal cannot exhaust the
/// process's memory: 12 events of 900 KB come in pages of about 4 MiB, each
/// ending where the next begins, every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_page_of_events_is_bounded_in_bytes() {
    let db = TestDb::new().await;
    let (host, id) = blobs_run(&db, 12, 900_000).await;
    let (mut from, mut blobs, mut pages) = (0, Vec::new(), 0);
    loop {
        let page = host.events_page(id, from).await;
        pages += 1;
        let events = page["events"].as_array().unwrap();
        let bytes: usize = events.iter().map(|e| e.to_string().len()).sum();
        assert!(bytes <= (4 << 20) + 1_000_000, "a page of {bytes} bytes");
        blobs.extend(events.iter().filter(|e| e["type"] == "blob").map(|e| e["i"].as_u64().unwrap()));
        from = page["next_from"].as_i64().unwrap();
        if page["terminal"] == json!(true) {
            break;
        }
        assert!(pages < 20, "paging never ended");
    }
    assert_eq!(blobs, (0..12).collect::<Vec<_>>(), "every event once, in order");
    assert!(pages >= 3, "12 events of 900 KB in {pages} pages");
    host.stop().await;
}

/// Claims `n` queued runs of the `noop` agent for a journal test.
async fn claimed_runs(db: &TestDb, n: usize) -> Vec<lifecycle::ClaimedRun> {
    for _ in 0..n {
        enqueue(&db.pool, None, "noop", json!({})).await;
    }
    let claim = lifecycle::Claim {
        limit: n as i64,
        lease: LONG,
        worker_id: "group",
        prefilter: true,
        tenant_max_running: None,
        rooms: Default::default(),
    };
    let runs = lifecycle::claim(&db.pool, &claim).await.unwrap();
    assert_eq!(runs.len(), n);
    runs
}

/// Issue 43: the group commit's statement. Three runs' rows in one
/// statement, one of them fenced (its claim went to another worker): the
/// two others' rows are written, the fenced run's none, the answer names
/// exactly the runs written, and the one NOTIFY lists them.
#[tokio::test]
async fn a_group_statement_with_a_fenced_run_writes_the_others() {
    use agent_host::db::journal::GroupPart;
    let db = TestDb::new().await;
    let runs = claimed_runs(&db, 3).await;
    update_run(&db.pool, runs[1].id, "claim_token = gen_random_uuid()").await;
    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener.listen(agent_host::db::notify::RUN_EVENTS).await.unwrap();
    let events: Vec<Vec<(String, Value, Option<i64>)>> = (0..3)
        .map(|i| (0..=i).map(|k| ("content_delta".to_string(), json!({ "delta": format!("{i}.{k}") }), None)).collect())
        .collect();
    let first: Vec<i32> = {
        let mut v = Vec::new();
        for r in &runs {
            v.push(journal(&db.pool, r.id).await.last().unwrap().0 + 1);
        }
        v
    };
    let parts: Vec<GroupPart<'_>> = runs
        .iter()
        .zip(&events)
        .zip(&first)
        .map(|((r, e), f)| GroupPart { run: r.id, token: r.claim_token, first_seq: *f, events: e })
        .collect();
    let written = journal::append_group(&db.pool, &parts).await.unwrap();
    let mut got = written.runs.clone();
    got.sort();
    let mut want = vec![runs[0].id, runs[2].id];
    want.sort();
    assert_eq!(got, want, "the runs written are exactly the unfenced ones");
    assert!(written.notified);
    for (i, r) in runs.iter().enumerate() {
        let deltas = journal(&db.pool, r.id).await.iter().filter(|(_, k)| k == "content_delta").count();
        assert_eq!(deltas, if i == 1 { 0 } else { i + 1 }, "run {i}'s rows");
    }
    let n = tokio::time::timeout(LONG, listener.recv()).await.unwrap().unwrap();
    let mut named: Vec<String> = n.payload().split(',').map(str::to_string).collect();
    named.sort();
    let mut expected: Vec<String> = want.iter().map(|r| r.0.simple().to_string()).collect();
    expected.sort();
    assert_eq!(named, expected, "one NOTIFY naming the runs written");
}

/// Issue 43: three runs' writers in one process group, their deltas due at
/// one tick: one commit carries all three batches; the run whose claim was
/// taken away writes nothing and only its writer learns it lost the claim
/// (its `lost` fires, its close says fenced); its neighbours' rows are
/// written and they go on.
#[tokio::test]
async fn a_group_commit_with_a_fenced_run_writes_the_others_and_tells_only_it() {
    use agent_host::run::journal::{Journal, JournalConfig, JournalGroup, JournalStats};
    use tokio_util::sync::CancellationToken;
    let db = TestDb::new().await;
    let runs = claimed_runs(&db, 3).await;
    update_run(&db.pool, runs[1].id, "claim_token = gen_random_uuid()").await;
    let stats = Arc::new(JournalStats::default());
    let flush = Duration::from_millis(100);
    // A gather longer than a tick: the three batches surely share a commit.
    let group = JournalGroup::start_with_gather(db.pool.clone(), flush, Duration::from_millis(400), stats.clone());
    let config = JournalConfig { flush_every: flush, ..JournalConfig::default() };
    let mut journals = Vec::new();
    for r in &runs {
        let first = journal(&db.pool, r.id).await.last().unwrap().0 + 1;
        let lost = CancellationToken::new();
        let j = Journal::start_in(&group, r.id, r.claim_token, first, config, lost.clone(), stats.clone());
        journals.push((j, lost));
    }
    for (i, (j, _)) in journals.iter_mut().enumerate() {
        j.delta(json!({ "delta": format!("run {i}") }), None).await.unwrap();
    }
    tokio::time::timeout(LONG, journals[1].1.cancelled()).await.expect("the fenced run was never told");
    let pool = db.pool.clone();
    let (a, c) = (runs[0].id, runs[2].id);
    wait_for("the neighbours' rows", LONG, || {
        let pool = pool.clone();
        async move {
            for r in [a, c] {
                if !journal(&pool, r).await.iter().any(|(_, k)| k == "content_delta") {
                    return false;
                }
            }
            true
        }
    })
    .await;
    assert!(!journal(&db.pool, runs[1].id).await.iter().any(|(_, k)| k == "content_delta"), "the fenced run wrote");
    assert_eq!(stats.group_commits.load(Ordering::Relaxed), 1, "one commit for the three batches");
    assert_eq!(stats.group_batches.load(Ordering::Relaxed), 3);
    assert_eq!(stats.group_fenced.load(Ordering::Relaxed), 1);
    assert_eq!(stats.group_rows.load(Ordering::Relaxed), 2);
    assert_eq!(stats.group_notifies.load(Ordering::Relaxed), 1);
    let mut closed = Vec::new();
    for (j, lost) in journals {
        closed.push((lost.is_cancelled(), j.close().await.is_ok()));
    }
    assert_eq!(closed, vec![(false, true), (true, false), (false, true)], "only the fenced run was told");
}

/// Issue 43: many live runs on one process: the flush clock, not the
/// number of runs, bounds the commits. 40 runs streaming deltas for about
/// a second make hundreds of per-run flushes and a few dozen commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_live_runs_share_few_journal_commits() {
    let db = TestDb::new().await;
    let config =
        WorkerConfig { max_runs: 40, journal_flush: Duration::from_millis(100), lease: LONG, ..fast_config("w") };
    let host = Host::start(&db, Some(Hub::start(db.url.clone())), config, Duration::from_secs(15)).await;
    let mut runs = Vec::new();
    for _ in 0..40 {
        runs.push(enqueue(&db.pool, None, "sleep", json!({ "steps": 50, "step_ms": 20 })).await.run_id);
    }
    for r in &runs {
        assert_eq!(wait_terminal(&db.pool, *r, LONG).await, "completed");
    }
    let j = host.worker.as_ref().unwrap().journal_stats();
    let (flushes, commits, notifies) = (
        j.flushes.load(Ordering::Relaxed),
        j.group_commits.load(Ordering::Relaxed),
        j.group_notifies.load(Ordering::Relaxed),
    );
    eprintln!(
        "40 live runs: {flushes} run flushes in {commits} commits ({} rows, at most {} in one), {notifies} NOTIFYs",
        j.group_rows.load(Ordering::Relaxed),
        j.group_rows_max.load(Ordering::Relaxed)
    );
    assert!(flushes >= 40 * 5, "{flushes} flushes: the runs did not stream");
    assert!(commits * 5 <= flushes, "{commits} commits for {flushes} flushes: not grouped");
    assert!(notifies <= commits, "at most one NOTIFY per commit ({notifies} for {commits})");
    // The counters are on /metrics.
    let metrics = reqwest::get(format!("{}/metrics", host.base)).await.unwrap().text().await.unwrap();
    for name in [
        "agent_host_journal_group_commits_total",
        "agent_host_journal_group_rows_per_commit",
        "agent_host_journal_group_notifies_total",
        "agent_host_sse_feed_reads_total",
        "agent_host_sse_tails_stalled_total",
    ] {
        assert!(metrics.contains(&format!("\n{name} ")), "{name} missing from /metrics");
    }
    for r in &runs {
        assert_journal_sound(&db.pool, *r).await;
    }
    host.stop().await;
}

/// Issue 43: all tails of one run on a process share one journal read per
/// wake: five SSE clients of one streaming run each get the whole journal,
/// while the feed's reads stay those of one reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tails_of_one_run_share_one_read_per_wake() {
    let db = TestDb::new().await;
    let live = agent_host::stream::tail::LiveTails::new(100);
    let l = live.clone();
    let host = Host::start_with(&db, Some(Hub::start(db.url.clone())), fast_config("w"), move |s| {
        s.live_tails = l;
    })
    .await;
    let e = enqueue(&db.pool, None, "sleep", json!({ "steps": 20, "step_ms": 25 })).await;
    let mut clients = Vec::new();
    for _ in 0..5 {
        clients.push(SseClient::connect(&host.events_url(e.run_id), &host.token, None).await);
    }
    let mut all = Vec::new();
    for mut c in clients {
        all.push(c.collect(LONG).await);
    }
    let j = journal_payloads(&db.pool, e.run_id).await;
    for frames in &all {
        let seqs: Vec<i64> = frames.iter().map(|f| f.data["seq"].as_i64().unwrap()).collect();
        assert_eq!(seqs, (1..=j.len() as i64).collect::<Vec<_>>(), "every seq once, in order");
    }
    let reads = live.feeds().stats().reads.load(Ordering::Relaxed);
    eprintln!("5 tails of a run of {} events: {reads} feed reads", j.len());
    // One reader's reads: about one per flush of the run (20 steps, a 50 ms
    // clock), far from five tails' worth.
    assert!(reads <= 2 * j.len() as u64 + 10, "{reads} reads for {} events", j.len());
    host.stop().await;
}

/// Issue 43: the feeds of many runs on a process share statements: 30 runs
/// streaming at once, each with an SSE client, are woken together by their
/// group commits, and their feeds' reads go to the database a batch at a
/// time, while every client still gets its run's whole journal in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_feeds_of_many_runs_share_their_reads_statements() {
    let db = TestDb::new().await;
    let live = agent_host::stream::tail::LiveTails::new(100);
    let l = live.clone();
    let config = WorkerConfig { max_runs: 30, lease: LONG, ..fast_config("w") };
    let host = Host::start_with(&db, Some(Hub::start(db.url.clone())), config, move |s| {
        s.live_tails = l;
    })
    .await;
    let mut runs = Vec::new();
    for _ in 0..30 {
        runs.push(enqueue(&db.pool, None, "sleep", json!({ "steps": 30, "step_ms": 30 })).await.run_id);
    }
    let mut clients = Vec::new();
    for r in &runs {
        clients.push((*r, SseClient::connect(&host.events_url(*r), &host.token, None).await));
    }
    for (run, mut c) in clients {
        let frames = c.collect(LONG).await;
        let seqs: Vec<i64> = frames.iter().map(|f| f.data["seq"].as_i64().unwrap()).collect();
        let j = journal_payloads(&db.pool, run).await;
        assert_eq!(seqs, (1..=j.len() as i64).collect::<Vec<_>>(), "every seq once, in order");
    }
    let stats = live.feeds().stats();
    let (reads, statements) = (stats.reads.load(Ordering::Relaxed), stats.read_statements.load(Ordering::Relaxed));
    eprintln!("30 live runs' feeds: {reads} reads in {statements} statements");
    assert!(reads >= 30 * 5, "{reads} reads: the runs did not stream to their feeds");
    // Woken together, the reads of a wake share a statement or two.
    assert!(statements * 3 <= reads, "{statements} statements for {reads} reads: not shared");
    let metrics = reqwest::get(format!("{}/metrics", host.base)).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("\nagent_host_sse_feed_read_statements_total "), "the counter is on /metrics");
    host.stop().await;
}

/// Issue 43: a client that stops reading is cut with its cursor and
/// rejoins from it with no gap and no repeat. The run writes far more than
/// the sockets hold (80 events of 500 kB) while the client reads nothing:
/// the tail's queue fills, the stall timeout passes, and the tail is cut
/// (its place under the bound given back). The client then reads what had
/// reached it (the stream ends without the `complete`), and rejoins with
/// the last id it got: together, the journal exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_and_rejoins_from_its_cursor() {
    let db = TestDb::new().await;
    let live = agent_host::stream::tail::LiveTails::new(100);
    let l = live.clone();
    let host = Host::start_with(&db, Some(Hub::start(db.url.clone())), fast_config("w"), move |s| {
        s.live_tails = l;
        s.sse_stall = Duration::from_millis(300);
    })
    .await;
    let e = enqueue(&db.pool, None, "blobs", json!({ "events": 80, "bytes": 500_000 })).await;
    let mut client = SseClient::connect(&host.events_url(e.run_id), &host.token, None).await;
    let mut first = Vec::new();
    while first.len() < 2 {
        first.push(client.next(LONG).await.expect("the stream ended early"));
    }
    // The client stops reading here.
    let l = live.clone();
    wait_for("the stalled tail to be cut", LONG, || {
        let l = l.clone();
        async move { l.feeds().stats().stalled.load(Ordering::Relaxed) >= 1 }
    })
    .await;
    assert_eq!(live.live(), 0, "the cut tail gave its place back");
    assert_eq!(wait_terminal(&db.pool, e.run_id, LONG).await, "completed");
    // It reads again: what had reached it, then the end of the stream.
    first.extend(client.collect(LONG).await);
    assert_ne!(first.last().unwrap().event, "complete", "the tail was cut before the end");
    let cursor = first.last().unwrap().data["seq"].as_i64().unwrap() as i32;
    let mut again = SseClient::connect(&host.events_url(e.run_id), &host.token, Some(cursor)).await;
    let rest = again.collect(LONG).await;
    assert_eq!(rest.last().unwrap().event, "complete");
    let seqs: Vec<i64> = first.iter().chain(&rest).map(|f| f.data["seq"].as_i64().unwrap()).collect();
    let j = journal_payloads(&db.pool, e.run_id).await;
    assert_eq!(seqs, j.iter().map(|(s, _, _)| *s as i64).collect::<Vec<_>>(), "no gap, no repeat");
    host.stop().await;
}

/// Issue 43: the feeds of a process share one statement per batch of
/// reads. Each page it answers is what a read of that run alone answers
/// (events after the cursor, bounded in count and bytes, and whether the
/// run ended, with its last seq), in the order asked, for runs that ended,
/// runs still running, and runs that do not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_statement_reads_the_pages_of_many_runs_as_each_alone() {
    use agent_host::db::journal::{Page, PageAsk};
    let db = TestDb::new().await;
    let (host, ended) = blobs_run(&db, 6, 1000).await;
    host.stop().await;
    let running = claimed_runs(&db, 1).await[0].id;
    let last = journal_payloads(&db.pool, ended).await.len() as i32;
    let ask = |run, after, events_max, bytes_max| PageAsk { run, after, events_max, bytes_max };
    let asks = [
        ask(ended, 0, 500, 4 << 20),
        ask(running, 0, 500, 4 << 20),
        ask(ended, 2, 3, 4 << 20),
        ask(ended, 3, 500, 1500), // cut by bytes past the first blob
        ask(ended, 3, 500, 1),    // the first event comes whatever its size
        ask(ended, last, 500, 4 << 20),
        ask(RunId::new(), 0, 500, 4 << 20),
        ask(running, 1, 500, 4 << 20),
    ];
    let pages = journal::pages_after(&db.pool, &asks).await.unwrap();
    assert_eq!(pages.len(), asks.len());
    for (a, page) in asks.iter().zip(&pages) {
        let (events, cut) =
            journal::events_after_bounded(&db.pool, a.run, a.after, a.events_max, a.bytes_max).await.unwrap();
        let alone = journal::terminal_state(&db.pool, a.run).await.unwrap();
        assert_eq!(*page, Page { events, cut, ended: alone }, "{a:?}");
    }
    // What each ask found, so the comparison above compared something.
    assert_eq!(pages[0].events.len() as i32, last);
    assert_eq!(pages[0].ended.as_ref().map(|e| e.2), Some(last));
    assert!(!pages[1].events.is_empty() && pages[1].ended.is_none(), "{:?}", pages[1]);
    assert_eq!(pages[2].events.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![3, 4, 5]);
    assert!(pages[3].cut && !pages[3].events.is_empty() && (pages[3].events.len() as i32) < last - 3);
    assert_eq!(pages[4].events.len(), 1);
    assert!(pages[5].events.is_empty() && pages[5].ended.is_some());
    assert_eq!(pages[6], Page::default());
    assert_eq!(pages[7].events.first().map(|e| e.seq), Some(2));
}
