//! The HTTP edge against a real PostgreSQL: one ending for every reader of a
//! run's stream, text PostgreSQL cannot store refused with 422, no driver text
//! in any answer, list endpoints that page with a cursor, a bound on live SSE
//! tails, and the boilerplate every handler shares (ids, not-found).

use std::time::Duration;

use crate::support::http::{multipart, oneshot, Answer, TestHost};
use crate::support::sse::SseClient;
use crate::support::*;
use agent_host::db::{plugins, tokens, RunId};
use agent_host::stream::tail::LiveTails;
use reqwest::StatusCode;
use serde_json::{json, Value};

const LONG: Duration = Duration::from_secs(30);

/// The router in-process, with a sandbox (so plugin names reach the
/// registry), and alice's and bob's tokens (same tenant).
struct Edge {
    db: TestDb,
    router: axum::Router,
    alice: String,
    bob: String,
}

impl Edge {
    async fn new() -> Edge {
        let db = TestDb::new().await;
        let (_, router) = sandboxed_router(&db);
        let alice = tokens::create(&db.pool, "alice", "acme", true).await.unwrap();
        let bob = tokens::create(&db.pool, "bob", "acme", false).await.unwrap();
        Edge { db, router, alice, bob }
    }

    async fn get(&self, uri: &str) -> Answer {
        oneshot(&self.router, "GET", uri, Some(&self.alice), &[], None).await
    }

    async fn post_json(&self, uri: &str, body: &str) -> Answer {
        oneshot(&self.router, "POST", uri, Some(&self.alice), &[], Some(("application/json", body.as_bytes().to_vec())))
            .await
    }

    async fn runs(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM agent_run").fetch_one(&self.db.pool).await.unwrap()
    }
}

fn error(a: &Answer) -> (StatusCode, String, String) {
    let v = a.json();
    let code = v["error"]["code"].as_str().unwrap_or_else(|| panic!("not an error body: {}", a.text()));
    (a.status, code.to_string(), v["error"]["message"].as_str().unwrap().to_string())
}

/// An SSE request's whole body, which must end by itself within `within`.
async fn sse_body(host: &TestHost, run: RunId, last_event_id: i64, within: Duration) -> String {
    let res = host.events(run, "text/event-stream", None, Some(last_event_id)).await;
    assert_eq!(res.status(), StatusCode::OK);
    tokio::time::timeout(within, res.text()).await.expect("the stream did not end by itself").unwrap()
}

fn frames_in(body: &str) -> Vec<&str> {
    body.lines().filter(|l| l.starts_with("data:") || l.starts_with("id:")).collect()
}

// ---------------------------------------------------------------- one ending

/// A completed run: the JSON page from the real `complete`'s seq (or past
/// it) is empty and terminal with `next_from` unchanged, however often a
/// poller asks; an SSE reconnect whose Last-Event-ID is that seq ends at
/// once, without a frame. Before, each got a second, synthesized `complete`.
#[tokio::test]
async fn a_completed_run_has_one_ending_for_every_reader() {
    let db = TestDb::new().await;
    let host = TestHost::builtins(&db).await;
    let (code, v) = host.call("POST", "/v1/runs", Some(json!({ "content": "hi", "plugin": "echo" }))).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{v}");
    let run: RunId = v["run_id"].as_str().unwrap().parse().unwrap();
    wait_status(&db.pool, run, "completed", LONG).await;
    let j = assert_journal_sound(&db.pool, run).await;
    let complete = j.last().unwrap().0 as i64;
    assert_eq!(j.last().unwrap().1, "complete");

    // A poller that follows next_from: one complete in all, then empty pages.
    let mut from = 0;
    let mut completes = 0;
    for _ in 0..4 {
        let page = host.events_page(run, from).await;
        assert_eq!(page["terminal"], true, "{page}");
        completes += page["events"].as_array().unwrap().iter().filter(|e| e["type"] == "complete").count();
        from = page["next_from"].as_i64().unwrap();
    }
    assert_eq!(completes, 1, "a poller following next_from sees one ending");
    assert_eq!(from, complete);
    for cursor in [complete, complete + 1, complete + 50] {
        let page = host.events_page(run, cursor).await;
        assert_eq!(page, json!({ "events": [], "next_from": cursor, "terminal": true }), "from={cursor}");
    }

    // SSE: from the start, exactly the journal; from the complete, nothing.
    let mut client = SseClient::connect(&host.events_url(run), &host.token, None).await;
    let frames = client.collect(LONG).await;
    assert_eq!(frames.len(), j.len());
    assert_eq!(frames.iter().filter(|f| f.event == "complete").count(), 1);
    for cursor in [complete, complete + 3] {
        let body = sse_body(&host, run, cursor, LONG).await;
        assert!(frames_in(&body).is_empty(), "Last-Event-ID {cursor} got frames: {body:?}");
    }
    // One before the end: just the complete.
    let mut client = SseClient::connect(&host.events_url(run), &host.token, Some(complete as i32 - 1)).await;
    let rest = client.collect(LONG).await;
    assert_eq!(rest.iter().map(|f| f.event.as_str()).collect::<Vec<_>>(), ["complete"]);
    host.stop().await;
}

/// `agent-host runs tail --from <the complete's seq>` of a completed run:
/// the stream ends at once without a frame, and the CLI says how the run
/// ended instead of rejoining until it gives up.
#[tokio::test]
async fn the_cli_tail_from_the_ending_reports_the_status() {
    let db = TestDb::new().await;
    let host = TestHost::builtins(&db).await;
    let e = enqueue(&db.pool, None, "echo", json!({})).await;
    wait_status(&db.pool, e.run_id, "completed", LONG).await;
    let complete = assert_journal_sound(&db.pool, e.run_id).await.last().unwrap().0;
    let tail = tokio::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .env("AGENT_HOST_URL", &host.base)
        .env("AGENT_HOST_TOKEN", &host.token)
        .args(["runs", "tail", &e.run_id.to_string(), "--from", &complete.to_string()])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(LONG, tail).await.expect("the CLI kept rejoining").unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(out.stdout.is_empty(), "nothing after the cursor is printed");
    assert!(stderr.contains("[completed]"), "{stderr}");
    host.stop().await;
}

/// A run that went terminal without its `complete` (a finalizer died): the
/// ending is synthesized once, at the journal's end + 1; a reader at or past
/// it gets nothing more.
#[tokio::test]
async fn a_synthesized_ending_is_given_once() {
    let db = TestDb::new().await;
    let host = TestHost::undispatched(&db, |_| {}).await;
    let e = enqueue(&db.pool, None, "noop", json!({})).await;
    update_run(&db.pool, e.run_id, "status = 'cancelled', finished_at = now()").await;
    let page = host.events_page(e.run_id, 0).await;
    assert_eq!(page["terminal"], true);
    let events = page["events"].as_array().unwrap();
    let last = events.last().unwrap();
    assert_eq!((last["type"].as_str(), last["seq"].as_i64()), (Some("complete"), Some(3)), "{page}");
    assert_eq!((last["status"].as_str(), last["synthesized"].as_bool()), (Some("cancelled"), Some(true)));
    assert_eq!(page["next_from"], 3);
    for cursor in [3, 4] {
        let page = host.events_page(e.run_id, cursor).await;
        assert_eq!(page, json!({ "events": [], "next_from": cursor, "terminal": true }), "from={cursor}");
    }
    let body = sse_body(&host, e.run_id, 3, LONG).await;
    assert!(frames_in(&body).is_empty(), "{body:?}");
    // From the journal's end (2): the synthesized ending, then the end.
    let mut client = SseClient::connect(&host.events_url(e.run_id), &host.token, Some(2)).await;
    let rest = client.collect(LONG).await;
    assert_eq!(rest.len(), 1);
    assert_eq!((rest[0].event.as_str(), rest[0].data["seq"].as_i64()), ("complete", Some(3)));
    // A run still queued is not terminal, and its page says so.
    let queued = enqueue(&db.pool, None, "noop", json!({})).await;
    let page = host.events_page(queued.run_id, 2).await;
    assert_eq!(page, json!({ "events": [], "next_from": 2, "terminal": false }));
    host.stop().await;
}

// ------------------------------------------------------------ U+0000, errors

/// Text PostgreSQL cannot store (U+0000) is refused at the edge with 422
/// naming the field; before, content answered 500 `internal error`.
#[tokio::test]
async fn text_postgres_cannot_store_is_refused_with_422_naming_the_field() {
    let edge = Edge::new().await;
    let (_, conv) = {
        let a = edge.post_json("/v1/conversations", "").await;
        (a.status, a.json()["id"].as_str().unwrap().to_string())
    };
    let cases: Vec<(Value, &str)> = vec![
        (json!({ "content": "a\u{0}b", "plugin": "echo" }), "content"),
        (json!({ "content": "hi", "plugin": "ec\u{0}ho" }), "plugin"),
        (json!({ "content": "hi", "plugin": "echo", "config": { "k": "v\u{0}" } }), "config"),
        (json!({ "content": "hi", "plugin": "echo", "config": { "k\u{0}": 1 } }), "config"),
        (json!({ "content": "hi", "plugin": "echo", "config": { "a": [1, { "b": ["\u{0}"] }] } }), "config"),
    ];
    for (body, field) in &cases {
        for uri in ["/v1/runs".to_string(), format!("/v1/conversations/{conv}/runs")] {
            let a = edge.post_json(&uri, &body.to_string()).await;
            let (status, code, message) = error(&a);
            assert_eq!(
                (status, code.as_str()),
                (StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
                "{uri} {body}: {message}"
            );
            assert_eq!(message, format!("{field} contains U+0000, which cannot be stored"), "{uri} {body}");
        }
    }
    // The form a plugin arrives in: its name and its manifest.
    let junk: &[u8] = b"not wasm";
    let manifest: &[u8] = br#"{"tools": ["a\u0000"]}"#;
    for (fields, field) in [
        (vec![("name", &b"ec\0ho"[..]), ("component", junk)], "name"),
        (vec![("name", &b"echo"[..]), ("component", junk), ("manifest", manifest)], "manifest"),
    ] {
        let (ct, body) = multipart(&fields);
        let a = oneshot(&edge.router, "POST", "/v1/plugins", Some(&edge.alice), &[], Some((&ct, body))).await;
        let (status, code, message) = error(&a);
        assert_eq!((status, code.as_str()), (StatusCode::UNPROCESSABLE_ENTITY, "invalid"), "{message}");
        assert_eq!(message, format!("{field} contains U+0000, which cannot be stored"));
    }
    assert_eq!(edge.runs().await, 0, "nothing was enqueued");
}

/// A database error answers 500 with a fixed message: nothing of the
/// driver's or the server's text reaches the client.
#[tokio::test]
async fn a_database_error_shows_no_driver_text() {
    let edge = Edge::new().await;
    fail_inserts(&edge.db.pool, "edge_refuse", "edge_refuse", "message", "secret-server-detail in relation message")
        .await;
    let a = edge.post_json("/v1/runs", r#"{"content":"hi","plugin":"echo"}"#).await;
    assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(a.json(), json!({ "error": { "code": "internal", "message": "internal error" } }));
    sqlx::query("ALTER TABLE conversation RENAME TO conversation_gone").execute(&edge.db.pool).await.unwrap();
    for uri in ["/v1/conversations", "/v1/conversations/00000000-0000-0000-0000-000000000000/messages"] {
        let a = edge.get(uri).await;
        assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR, "{uri}");
        assert_eq!(a.json(), json!({ "error": { "code": "internal", "message": "internal error" } }), "{uri}");
        for leak in ["secret", "relation", "conversation_gone", "does not exist", "database", "sqlx"] {
            assert!(!a.text().contains(leak), "{uri} leaks {leak:?}: {}", a.text());
        }
    }
}

/// Ids in paths: 400 naming what was not a UUID; 404 for a missing id and
/// for another user's, alike.
#[tokio::test]
async fn path_ids_are_checked_once_and_another_users_object_is_not_found() {
    let edge = Edge::new().await;
    for (uri, what) in [
        ("/v1/runs/nope", "run id \"nope\" is not a UUID"),
        ("/v1/runs/nope/events", "run id \"nope\" is not a UUID"),
        ("/v1/conversations/nope", "conversation id \"nope\" is not a UUID"),
        ("/v1/conversations/nope/messages", "conversation id \"nope\" is not a UUID"),
    ] {
        let (status, code, message) = error(&edge.get(uri).await);
        assert_eq!((status, code.as_str(), message.as_str()), (StatusCode::BAD_REQUEST, "bad_request", what));
    }
    let bobs = oneshot(&edge.router, "POST", "/v1/conversations", Some(&edge.bob), &[], None).await.json();
    let id = bobs["id"].as_str().unwrap();
    let missing = uuid::Uuid::new_v4();
    for uri in [format!("/v1/conversations/{id}"), format!("/v1/conversations/{missing}")] {
        let (status, code, message) = error(&edge.get(&uri).await);
        assert_eq!((status, code.as_str()), (StatusCode::NOT_FOUND, "not_found"), "{uri}");
        assert!(message.starts_with("conversation ") && message.ends_with(" not found"), "{message}");
    }
}

// ------------------------------------------------------------------- paging

/// Walks a list endpoint by `next_cursor`; returns every item's `key`.
async fn walk(edge: &Edge, path: &str, field: &str, key: &str, limit: usize) -> Vec<String> {
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    for _ in 0..1000 {
        let sep = if path.contains('?') { '&' } else { '?' };
        let uri = match &after {
            Some(c) => format!("{path}{sep}limit={limit}&after={c}"),
            None => format!("{path}{sep}limit={limit}"),
        };
        let a = edge.get(&uri).await;
        assert_eq!(a.status, StatusCode::OK, "{uri}: {}", a.text());
        let page = a.json();
        let items = page[field].as_array().unwrap_or_else(|| panic!("{uri}: no {field}: {page}"));
        assert!(items.len() <= limit, "{uri}: {} items over limit {limit}", items.len());
        seen.extend(items.iter().map(|i| i[key].as_str().unwrap().to_string()));
        match page["next_cursor"].as_str() {
            Some(c) => {
                assert!(!items.is_empty(), "{uri}: a cursor after an empty page");
                after = Some(c.to_string());
            }
            None => {
                assert!(page.get("next_cursor").is_some(), "{uri}: next_cursor is always there: {page}");
                return seen;
            }
        }
    }
    panic!("{path} never ended");
}

/// Past the old caps (100 conversations, 1,000 messages): every item once,
/// in the list's order, pages bounded by `limit`, `next_cursor` null at the
/// end. Ties in time are broken by id, so no item is skipped or repeated.
#[tokio::test]
async fn lists_page_with_a_cursor_past_the_old_caps() {
    let edge = Edge::new().await;
    let pool = &edge.db.pool;
    // 150 conversations, 60 of them created in one instant.
    sqlx::query(
        "INSERT INTO conversation (id, owner_id, tenant_id, created_at)
         SELECT gen_random_uuid(), 'alice', 'acme',
                CASE WHEN i <= 60 THEN timestamptz '2024-01-01' ELSE timestamptz '2024-01-01' + i * interval '1 s' END
         FROM generate_series(1, 150) i",
    )
    .execute(pool)
    .await
    .unwrap();
    // Bob's are not alice's.
    sqlx::query("INSERT INTO conversation (id, owner_id, tenant_id) VALUES (gen_random_uuid(), 'bob', 'acme')")
        .execute(pool)
        .await
        .unwrap();
    let want: Vec<String> = sqlx::query_scalar(
        "SELECT id::text FROM conversation WHERE owner_id = 'alice' ORDER BY created_at DESC, id DESC",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(walk(&edge, "/v1/conversations", "conversations", "id", 40).await, want);
    assert_eq!(walk(&edge, "/v1/conversations", "conversations", "id", 1000).await, want);
    // Without a limit: the old page size, and a cursor to the rest.
    let first = edge.get("/v1/conversations").await.json();
    assert_eq!(first["conversations"].as_array().unwrap().len(), 100);
    assert!(first["next_cursor"].is_string());

    // 1,100 messages in one conversation, in pairs of one instant.
    let conv: String = want[0].clone();
    sqlx::query(
        "INSERT INTO message (id, conversation_id, role, content, status, created_at)
         SELECT gen_random_uuid(), $1::uuid, 'user', 'm' || i, 'complete',
                timestamptz '2024-01-01' + (i / 2) * interval '1 ms'
         FROM generate_series(1, 1100) i",
    )
    .bind(&conv)
    .execute(pool)
    .await
    .unwrap();
    let want: Vec<String> =
        sqlx::query_scalar("SELECT id::text FROM message WHERE conversation_id = $1::uuid ORDER BY created_at, id")
            .bind(&conv)
            .fetch_all(pool)
            .await
            .unwrap();
    let path = format!("/v1/conversations/{conv}/messages");
    assert_eq!(walk(&edge, &path, "messages", "id", 1000).await, want);
    assert_eq!(walk(&edge, &path, "messages", "id", 333).await, want);

    // Plugins: registered and built-in, one list in name order.
    for name in ["zeta", "alpha", "mid", "echo"] {
        plugins::put(pool, name, name.as_bytes(), &json!({})).await.unwrap();
    }
    let names = walk(&edge, "/v1/plugins", "plugins", "name", 2).await;
    let mut sorted = names.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(names, sorted, "every plugin once, in name order");
    for name in ["zeta", "alpha", "mid", "echo", "noop", "sleep"] {
        assert!(names.contains(&name.to_string()), "{name} missing from {names:?}");
    }

    // Bounds and cursors are checked.
    for uri in [
        "/v1/conversations?limit=0",
        "/v1/conversations?limit=1001",
        "/v1/conversations?limit=x",
        "/v1/conversations?after=not-a-cursor",
        "/v1/plugins?after=%00",
    ] {
        let (status, code, _) = error(&edge.get(uri).await);
        assert_eq!((status, code.as_str()), (StatusCode::BAD_REQUEST, "bad_request"), "{uri}");
    }
}

/// The OpenAPI document says what the list and stream routes take and answer.
#[tokio::test]
async fn the_openapi_document_describes_paging_and_the_stream_bound() {
    let edge = Edge::new().await;
    let doc = edge.get("/openapi.json").await.json();
    for path in ["/v1/conversations", "/v1/conversations/{id}/messages", "/v1/plugins"] {
        let op = &doc["paths"][path]["get"];
        let params: Vec<&str> =
            op["parameters"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
        assert!(params.contains(&"limit") && params.contains(&"after"), "{path}: {params:?}");
        assert!(op["responses"]["200"]["description"].as_str().unwrap().contains("next_cursor"), "{path}");
        assert!(op["responses"]["400"].is_object(), "{path} documents its 400");
    }
    let events = &doc["paths"]["/v1/runs/{id}/events"]["get"];
    assert!(events["responses"]["503"].is_object());
    let codes = doc["components"]["schemas"]["Error"]["properties"]["error"]["properties"]["code"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect::<Vec<_>>();
    for code in ["bad_request", "not_found", "invalid", "too_many_streams", "internal"] {
        assert!(codes.contains(&code), "{code} not in {codes:?}");
    }
}

// ------------------------------------------------------------- tail bound

/// Live SSE tails are bounded per process: past the bound a new one answers
/// 503 `too_many_streams` with Retry-After (JSON pages still answer); the
/// count and the refusals are in /metrics; a tail whose client left gives
/// its place back.
#[tokio::test]
async fn live_sse_tails_are_bounded_per_process() {
    let db = TestDb::new().await;
    let host = TestHost::undispatched(&db, |state| {
        state.live_tails = LiveTails::new(2);
        // The server notices a client that left on its next write.
        state.keepalive = Duration::from_millis(50);
    })
    .await;
    // Queued and never claimed: their tails stay live.
    let a = enqueue(&db.pool, None, "noop", json!({})).await;
    let b = enqueue(&db.pool, None, "noop", json!({})).await;
    let mut first = SseClient::connect(&host.events_url(a.run_id), &host.token, None).await;
    let mut second = SseClient::connect(&host.events_url(b.run_id), &host.token, None).await;
    assert_eq!(first.next(LONG).await.unwrap().event, "user_message_created");
    assert_eq!(second.next(LONG).await.unwrap().event, "user_message_created");
    let refused = host.events(a.run_id, "text/event-stream", None, None).await;
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    let retry_after: u64 = refused.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry_after >= 1);
    let v: Value = refused.json().await.unwrap();
    assert_eq!(v["error"]["code"], "too_many_streams", "{v}");
    // A JSON page is not a live tail.
    assert_eq!(host.events_page(a.run_id, 0).await["events"].as_array().unwrap().len(), 2);
    let m = host.scrape().await;
    assert_eq!((m["agent_host_sse_tails"], m["agent_host_sse_tails_refused_total"]), (2.0, 1.0));
    assert_eq!(m["agent_host_sse_tails_max"], 2.0);

    drop(second);
    let h = &host;
    wait_for("the left tail to give its place back", LONG, || async move {
        h.scrape().await["agent_host_sse_tails"] == 1.0
    })
    .await;
    let mut third = SseClient::connect(&host.events_url(b.run_id), &host.token, None).await;
    assert_eq!(third.next(LONG).await.unwrap().event, "user_message_created");
    drop((first, third));
    host.stop().await;
}
