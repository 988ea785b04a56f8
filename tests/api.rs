//! The HTTP API in-process (tower oneshot) against a real PostgreSQL.

use crate::support::*;
use agent_host::agent::AgentRegistry;
use agent_host::api::{self, AppState};
use agent_host::db::tokens;
use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::Router;
use serde_json::{json, Value};

struct Api {
    router: Router,
    db: TestDb,
    alice: String,
    bob: String,
}

impl Api {
    async fn new() -> Api {
        let db = TestDb::new().await;
        let alice = tokens::create(&db.pool, "alice", "acme", false).await.unwrap();
        // Same tenant, another user: must see nothing of alice's.
        let bob = tokens::create(&db.pool, "bob", "acme", false).await.unwrap();
        let router = api::router(AppState::new(db.pool.clone(), AgentRegistry::with_builtins(), None));
        Api { router, db, alice, bob }
    }

    async fn call(
        &self,
        method: &str,
        uri: &str,
        token: Option<&str>,
        body: Option<(&str, &str)>,
    ) -> (StatusCode, Value) {
        let req = request(method, uri, token);
        let req = match body {
            Some((content_type, body)) => {
                req.header(header::CONTENT_TYPE, content_type).body(Body::from(body.to_string()))
            }
            None => req.body(Body::empty()),
        }
        .unwrap();
        let (status, _, value) = oneshot(&self.router, req).await;
        (status, value)
    }

    async fn post_run(&self, token: &str, body: Value) -> (StatusCode, Value) {
        self.call("POST", "/v1/runs", Some(token), Some(("application/json", &body.to_string()))).await
    }
}

fn error_code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or_else(|| panic!("not an error body: {v}"))
}

#[tokio::test]
async fn post_run_answers_202_and_the_owner_can_read_it() {
    let api = Api::new().await;
    let (status, body) = api.post_run(&api.alice, json!({ "content": "hi", "plugin": "echo" })).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(body["status"], "queued");
    for field in ["run_id", "conversation_id", "user_message_id"] {
        assert!(body[field].is_string(), "{field} missing: {body}");
    }
    let run_id = body["run_id"].as_str().unwrap();
    let (status, run) = api.call("GET", &format!("/v1/runs/{run_id}"), Some(&api.alice), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(run["id"], run_id);
    assert_eq!(run["status"], "queued");
    assert_eq!(run["plugin"], "echo");
    assert_eq!(run["last_seq"], 2);
    assert_eq!(run["cancel_requested"], false);
    for field in ["conversation_id", "created_at"] {
        assert!(run[field].is_string(), "{field}: {run}");
    }
    for field in ["started_at", "finished_at", "error", "plugin_digest"] {
        assert!(run.get(field).is_some(), "{field} absent: {run}");
    }

    // Another user of the same tenant: 404, as if it did not exist.
    let (status, body) = api.call("GET", &format!("/v1/runs/{run_id}"), Some(&api.bob), None).await;
    assert_eq!((status, error_code(&body)), (StatusCode::NOT_FOUND, "not_found"));

    // A second turn in the same conversation, by body and by path.
    let conv = run["conversation_id"].as_str().unwrap();
    let (status, second) =
        api.post_run(&api.alice, json!({ "content": "again", "plugin": "echo", "conversation_id": conv })).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    assert_eq!(second["conversation_id"], conv);
    let body = json!({ "content": "third", "plugin": "noop" }).to_string();
    let (status, third) = api
        .call("POST", &format!("/v1/conversations/{conv}/runs"), Some(&api.alice), Some(("application/json", &body)))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{third}");
    // Bob cannot post into alice's conversation.
    let (status, _) =
        api.post_run(&api.bob, json!({ "content": "x", "plugin": "echo", "conversation_id": conv })).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn every_v1_route_requires_a_valid_token() {
    let api = Api::new().await;
    let body = json!({ "content": "hi", "plugin": "echo" }).to_string();
    let (status, v) = api.call("POST", "/v1/runs", None, Some(("application/json", &body))).await;
    assert_eq!((status, error_code(&v)), (StatusCode::UNAUTHORIZED, "unauthenticated"));
    let (status, _) = api.call("POST", "/v1/runs", Some("ah_not_a_token"), Some(("application/json", &body))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = api.call("GET", &format!("/v1/runs/{}", uuid::Uuid::new_v4()), None, None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = api.call("POST", "/v1/conversations", None, None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, v) = api.call("POST", "/v1/conversations", Some(&api.alice), None).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(v["id"].is_string() && v["created_at"].is_string());
}

#[tokio::test]
async fn bad_input_gets_a_clear_error_never_a_500() {
    let api = Api::new().await;
    let t = Some(api.alice.as_str());
    let cases: Vec<(&str, &str, StatusCode, &str)> = vec![
        ("application/json", "{not json", StatusCode::BAD_REQUEST, "bad_request"),
        (
            "text/plain",
            r#"{"content":"hi","plugin":"echo"}"#,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        ("application/json", r#"{"plugin":"echo"}"#, StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
        ("application/json", r#"{"content":"hi","plugin":"nope"}"#, StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
        ("application/json", r#"{"content":"  ","plugin":"echo"}"#, StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
        (
            "application/json",
            r#"{"content":"hi","plugin":"echo","config":[1]}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid",
        ),
        (
            "application/json",
            r#"{"content":"hi","plugin":"echo","extra":1}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid",
        ),
        (
            "application/json",
            r#"{"content":"hi","plugin":"echo","conversation_id":"zzz"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid",
        ),
    ];
    for (ct, body, want, code) in cases {
        let (status, v) = api.call("POST", "/v1/runs", t, Some((ct, body))).await;
        assert_eq!((status, error_code(&v)), (want, code), "{body}: {v}");
        assert!(!v["error"]["message"].as_str().unwrap().is_empty());
    }
    let huge = json!({ "content": "x".repeat(2 << 20), "plugin": "echo" }).to_string();
    let (status, v) = api.call("POST", "/v1/runs", t, Some(("application/json", &huge))).await;
    assert_eq!((status, error_code(&v)), (StatusCode::PAYLOAD_TOO_LARGE, "too_large"));
    let long = json!({ "content": "x".repeat(70_000), "plugin": "echo" }).to_string();
    let (status, v) = api.call("POST", "/v1/runs", t, Some(("application/json", &long))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("65536"));
    let (status, v) = api.call("GET", "/v1/runs/not-a-uuid", t, None).await;
    assert_eq!((status, error_code(&v)), (StatusCode::BAD_REQUEST, "bad_request"));
    let (status, v) = api.call("GET", &format!("/v1/runs/{}", uuid::Uuid::new_v4()), t, None).await;
    assert_eq!((status, error_code(&v)), (StatusCode::NOT_FOUND, "not_found"));
    let (status, v) = api.call("GET", "/nowhere", t, None).await;
    assert_eq!((status, error_code(&v)), (StatusCode::NOT_FOUND, "not_found"));
    // Nothing was enqueued by any of it.
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run").fetch_one(&api.db.pool).await.unwrap();
    assert_eq!(n, 0);
}

#[tokio::test]
async fn health_and_readiness() {
    let api = Api::new().await;
    let (status, v) = api.call("GET", "/healthz", None, None).await;
    assert_eq!((status, v["status"].as_str()), (StatusCode::OK, Some("ok")));
    let (status, v) = api.call("GET", "/readyz", None, None).await;
    assert_eq!((status, v["status"].as_str()), (StatusCode::OK, Some("ready")));
    // Readiness follows the database.
    api.db.pool.close().await;
    let (status, v) = api.call("GET", "/readyz", None, None).await;
    assert_eq!((status, error_code(&v)), (StatusCode::SERVICE_UNAVAILABLE, "unavailable"));
}

#[tokio::test]
async fn idempotent_enqueue_replays_the_first_run_and_refuses_a_different_body() {
    let api = Api::new().await;
    let post = |key: &'static str, body: Value| {
        let router = api.router.clone();
        let token = api.alice.clone();
        async move {
            let req = request("POST", "/v1/runs", Some(&token))
                .header(header::CONTENT_TYPE, "application/json")
                .header("Idempotency-Key", key)
                .body(Body::from(body.to_string()))
                .unwrap();
            let (status, headers, value) = oneshot(&router, req).await;
            let replayed = headers.get("idempotent-replayed").map(|v| v.to_str().unwrap().to_string());
            assert!(!value.is_null(), "a JSON answer");
            (status, replayed, value)
        }
    };
    let body = json!({ "content": "once", "plugin": "echo" });
    // Concurrent retries with one key: exactly one run.
    let results = futures::future::join_all((0..8).map(|_| post("k-1", body.clone()))).await;
    let first = &results[0].2;
    for (status, replayed, v) in &results {
        assert_eq!(*status, StatusCode::ACCEPTED, "{v}");
        assert_eq!(v, first, "every retry answers like the first request");
        assert!(replayed.is_none() || replayed.as_deref() == Some("true"));
    }
    assert_eq!(results.iter().filter(|r| r.1.is_none()).count(), 1, "exactly one original answer");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run").fetch_one(&api.db.pool).await.unwrap();
    assert_eq!(n, 1);

    let (status, replayed, v) = post("k-1", body.clone()).await;
    assert_eq!((status, replayed.as_deref()), (StatusCode::ACCEPTED, Some("true")));
    assert_eq!(&v, first);
    let (status, _, v) = post("k-1", json!({ "content": "other", "plugin": "echo" })).await;
    assert_eq!((status, error_code(&v)), (StatusCode::CONFLICT, "idempotency_key_reused"));
    // Keys are per owner: bob's k-1 is his own.
    let (status, _) = {
        let req = request("POST", "/v1/runs", Some(&api.bob))
            .header(header::CONTENT_TYPE, "application/json")
            .header("Idempotency-Key", "k-1")
            .body(Body::from(body.to_string()))
            .unwrap();
        (oneshot(&api.router, req).await.0, ())
    };
    assert_eq!(status, StatusCode::ACCEPTED);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run").fetch_one(&api.db.pool).await.unwrap();
    assert_eq!(n, 2);
}

/// A scrape's samples: metric line (name with labels) to value.
async fn scrape(host: &crate::support::http::TestHost) -> std::collections::HashMap<String, f64> {
    let (headers, samples) = host.scrape_with_headers().await;
    assert!(headers[header::CONTENT_TYPE].to_str().unwrap().starts_with("text/plain"));
    samples
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_as_runs_move() {
    let db = TestDb::new().await;
    let hub = agent_host::hub::Hub::start(db.url.clone());
    let host =
        crate::support::http::TestHost::start(&db, Some(hub), AgentRegistry::with_builtins(), fast_config("w")).await;
    let before = scrape(&host).await;
    assert_eq!(before["agent_host_queue_depth"], 0.0);
    assert_eq!(before["agent_host_runs_claimed_total"], 0.0);
    assert_eq!(before["agent_host_ending_commits_total"], 0.0);

    let body = json!({ "content": "hi", "plugin": "sleep", "config": { "steps": 100000, "step_ms": 20 } });
    let (code, v) = host.call("POST", "/v1/runs", Some(body)).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{v}");
    let run: agent_host::db::RunId = v["run_id"].as_str().unwrap().parse().unwrap();
    wait_status(&db.pool, run, "running", std::time::Duration::from_secs(30)).await;
    let during = scrape(&host).await;
    assert_eq!(during["agent_host_runs_running"], 1.0);
    assert_eq!(during["agent_host_runs_in_flight"], 1.0);
    assert_eq!(during["agent_host_runs_claimed_total"], 1.0);
    assert_eq!(during["agent_host_pickup_seconds_count"], 1.0);
    assert_eq!(during["agent_host_hub_connected"], 1.0);

    let pool = &db.pool;
    wait_for("a delta", std::time::Duration::from_secs(30), || async move {
        journal(pool, run).await.iter().any(|(_, t)| t == "content_delta")
    })
    .await;
    host.call("POST", &format!("/v1/runs/{run}/cancel"), None).await;
    wait_status(&db.pool, run, "cancelled", std::time::Duration::from_secs(30)).await;
    let p = &host;
    wait_for("the run task to let go", std::time::Duration::from_secs(10), || async move {
        scrape(p).await["agent_host_runs_in_flight"] == 0.0
    })
    .await;
    let after = scrape(&host).await;
    assert_eq!(after["agent_host_runs_running"], 0.0);
    assert_eq!(after["agent_host_runs_ended_total{status=\"cancelled\",reason=\"none\"}"], 1.0);
    // The one ending was one group-committed statement.
    assert_eq!(after["agent_host_ending_commits_total"], 1.0);
    assert!(after["agent_host_journal_rows_total"] >= 1.0);
    host.stop().await;
}

/// `/openapi.json` is generated from the route table the router is built
/// from; every documented operation is served, asks for a token when it says
/// so, and answers 404 for another user's run or conversation.
#[tokio::test]
async fn every_documented_route_is_served_guarded_and_owner_scoped() {
    let api = Api::new().await;
    let (status, doc) = api.call("GET", "/openapi.json", None, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(doc["openapi"], "3.1.0");
    // Bob's run and conversation: alice must see none of them.
    let (_, bobs) = api.post_run(&api.bob, json!({ "content": "mine", "plugin": "echo" })).await;
    let (run, conv) = (bobs["run_id"].as_str().unwrap(), bobs["conversation_id"].as_str().unwrap());
    let mut operations = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            operations += 1;
            let id = if path.starts_with("/v1/runs/") { run } else { conv };
            let uri = path.replace("{id}", id).replace("{call_id}", "1").replace("{plugin}", "echo");
            let method = method.to_uppercase();
            let secured = op.get("security").is_some();
            let guarded = path.starts_with("/v1/") || path.starts_with("/a2a/");
            assert_eq!(secured, guarded, "{method} {path}: every /v1 and /a2a route needs a token");
            let (status, v) = api.call(&method, &uri, None, None).await;
            if secured {
                assert_eq!((status, error_code(&v)), (StatusCode::UNAUTHORIZED, "unauthenticated"), "{method} {path}");
                assert!(op["responses"]["401"].is_object(), "{method} {path} documents its 401");
            } else {
                assert_ne!(status, StatusCode::NOT_FOUND, "{method} {path} is documented but not served");
            }
            if path.contains("{id}") {
                let body = match (method.as_str(), path.as_str()) {
                    ("POST", p) if p.ends_with("/runs") => {
                        Some(("application/json", r#"{"content":"hi","plugin":"echo"}"#))
                    }
                    ("POST", p) if p.ends_with("/approvals/{call_id}") => {
                        Some(("application/json", r#"{"decision":"approve"}"#))
                    }
                    ("POST", p) if p.ends_with("/fork") => Some(("application/json", r#"{"after_call":0}"#)),
                    ("POST", p) if p.ends_with("/steer") => Some(("application/json", r#"{"content":"shorter"}"#)),
                    _ => None,
                };
                let (status, v) = api.call(&method, &uri, Some(&api.alice), body).await;
                assert_eq!(status, StatusCode::NOT_FOUND, "{method} {path} with another user's id: {v}");
                assert!(!v["error"]["message"].as_str().unwrap().starts_with("route"), "{method} {path} is not routed");
                assert!(op["responses"]["404"].is_object(), "{method} {path} documents its 404");
            }
        }
    }
    assert_eq!(operations, agent_host::api::ROUTES.len());
    // The MCP server (JSON-RPC, not in the document) is guarded like /v1 and /a2a.
    let mcp = agent_host::api::MCP_PATH;
    let ping = r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#;
    for (method, body) in [("POST", Some(("application/json", ping))), ("GET", None), ("DELETE", None)] {
        let (status, v) = api.call(method, mcp, None, body).await;
        assert_eq!((status, error_code(&v)), (StatusCode::UNAUTHORIZED, "unauthenticated"), "{method} {mcp}");
    }
    assert!(doc["paths"].get(mcp).is_none(), "{mcp} is JSON-RPC, not a documented operation");
    let (status, v) = api.call("POST", mcp, Some(&api.bob), Some(("application/json", ping))).await;
    assert_eq!((status, &v), (StatusCode::OK, &json!({ "jsonrpc": "2.0", "id": 1, "result": {} })));
    // Bob still sees his own.
    let (status, _) = api.call("GET", &format!("/v1/runs/{run}"), Some(&api.bob), None).await;
    assert_eq!(status, StatusCode::OK);
}
