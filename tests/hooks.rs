//! What run APIs users know also offer, with real processes: completion
//! webhooks (an outbox row in the terminal write's transaction, delivered
//! once, signed, retried with the same id, failed after the bound), a
//! strategy for a busy conversation (enqueue, reject, interrupt), and cron
//! schedules (one run per firing across processes, one catch-up firing after
//! every process was down).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::support::process::{HostProcess, FAST};
use crate::support::*;
use agent_host::db::{tokens, ConversationId, RunId};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use base64::Engine;
use hmac::{Hmac, Mac};
use nix::sys::signal::Signal;
use serde_json::{json, Value};
use sha2::Sha256;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// One delivery as the receiver saw it: route, webhook-id, timestamp, signature, body.
#[derive(Debug, Clone)]
struct Delivery {
    route: String,
    id: String,
    timestamp: String,
    signature: String,
    body: String,
}

#[derive(Default)]
struct Receiver {
    got: Mutex<Vec<Delivery>>,
}

/// `/ok` answers 204; `/flaky` fails its first two attempts of each id; `/down` always 503.
async fn receive(State(r): State<Arc<Receiver>>, Path(route): Path<String>, h: HeaderMap, body: String) -> StatusCode {
    let header = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let d = Delivery {
        route: route.clone(),
        id: header("webhook-id"),
        timestamp: header("webhook-timestamp"),
        signature: header("webhook-signature"),
        body,
    };
    let seen = {
        let mut got = r.got.lock().unwrap();
        got.push(d.clone());
        got.iter().filter(|x| x.id == d.id).count()
    };
    match route.as_str() {
        "ok" => StatusCode::NO_CONTENT,
        "flaky" if seen > 2 => StatusCode::OK,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    }
}

struct Env {
    db: TestDb,
    token: String,
    receiver: Arc<Receiver>,
    base: String,
}

impl Env {
    async fn new() -> Env {
        let db = TestDb::new().await;
        let token = tokens::create(&db.pool, "alice", "acme", false).await.unwrap();
        let receiver = Arc::new(Receiver::default());
        let router = Router::new().route("/hook/{route}", post(receive)).with_state(receiver.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        Env { db, token, receiver, base }
    }

    fn spawn(&self, worker: &str, extra: &[&str]) -> HostProcess {
        let allow = format!("{}/hook/", self.base);
        let mut args: Vec<&str> = FAST.to_vec();
        args.extend(["--completion-webhook-allow", &allow, "--webhook-secret", SECRET]);
        args.extend(["--webhook-poll-ms", "100", "--webhook-backoff-ms", "50", "--schedule-tick-ms", "100"]);
        // The tests' schedules fire every second.
        args.extend(["--schedule-min-interval-s", "1"]);
        args.extend(extra);
        HostProcess::spawn(&self.db.url, worker, &args)
    }

    async fn call(&self, host: &HostProcess, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut req =
            reqwest::Client::new().request(method, format!("http://{}{path}", host.addr)).bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let res = req.send().await.unwrap();
        let status = res.status().as_u16();
        (status, res.json().await.unwrap_or(Value::Null))
    }

    async fn post_run(&self, host: &HostProcess, body: Value) -> (u16, Value) {
        self.call(host, reqwest::Method::POST, "/v1/runs", Some(body)).await
    }

    fn deliveries(&self, route: &str) -> Vec<Delivery> {
        self.receiver.got.lock().unwrap().iter().filter(|d| d.route == route).cloned().collect()
    }
}

fn run_id(v: &Value) -> RunId {
    v["run_id"].as_str().unwrap().parse().unwrap()
}

/// The key tenant `acme`'s deliveries are signed with, derived as the
/// documentation says: HMAC-SHA256 under the operator's secret of
/// `agent-host webhook key for tenant acme`.
fn acme_key() -> Vec<u8> {
    let secret = base64::engine::general_purpose::STANDARD.decode(SECRET.trim_start_matches("whsec_")).unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&secret).unwrap();
    mac.update(b"agent-host webhook key for tenant acme");
    mac.finalize().into_bytes().to_vec()
}

/// Checks a delivery's signature as a Standard Webhooks receiver does, with
/// its tenant's key.
fn assert_signed(d: &Delivery) {
    let key = acme_key();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{}.{}.{}", d.id, d.timestamp, d.body).as_bytes());
    let want = format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes()));
    assert_eq!(d.signature, want, "signature of {d:?}");
    let ts: i64 = d.timestamp.parse().unwrap();
    assert!((chrono::Utc::now().timestamp() - ts).abs() < 300, "a fresh timestamp: {ts}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_webhook_survives_a_kill_between_the_ending_and_the_post_and_arrives_once_signed() {
    let env = Env::new().await;
    // A never sends (its sender waits an hour between looks).
    let a = env.spawn("A", &["--webhook-poll-ms", "3600000"]);
    let url = format!("{}/hook/ok", env.base);
    let (code, v) = env.post_run(&a, json!({ "plugin": "echo", "content": "hello", "webhook": url })).await;
    assert_eq!(code, 202, "{v}");
    let run = run_id(&v);
    assert_eq!(wait_terminal(&env.db.pool, run, LONG).await, "completed");
    let (_, view) = env.call(&a, reqwest::Method::GET, &format!("/v1/runs/{run}"), None).await;
    assert_eq!(view["webhook"]["status"], "pending", "the outbox row came with the ending: {view}");
    a.signal(Signal::SIGKILL);
    drop(a);
    assert!(env.deliveries("ok").is_empty());

    let b = env.spawn("B", &[]);
    wait_for("the delivery", LONG, || async { !env.deliveries("ok").is_empty() }).await;
    wait_for("the delivery recorded", LONG, || async {
        env.call(&b, reqwest::Method::GET, &format!("/v1/runs/{run}"), None).await.1["webhook"]["status"] == "delivered"
    })
    .await;
    let got = env.deliveries("ok");
    assert_eq!(got.len(), 1, "exactly one delivery: {got:?}");
    assert_signed(&got[0]);
    let body: Value = serde_json::from_str(&got[0].body).unwrap();
    assert_eq!(body["run_id"], run.to_string());
    assert_eq!(body["status"], "completed");
    assert!(body["finished_at"].is_string() && body["conversation_id"].is_string(), "{body}");
    assert!(body.get("error").is_none(), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_receiver_gets_the_same_id_on_every_attempt_until_it_answers_or_the_bound() {
    let env = Env::new().await;
    let a = env.spawn("A", &["--webhook-attempts", "3"]);
    let (_, flaky) = env
        .post_run(&a, json!({ "plugin": "echo", "content": "x", "webhook": format!("{}/hook/flaky", env.base) }))
        .await;
    let (_, down) = env
        .post_run(&a, json!({ "plugin": "echo", "content": "y", "webhook": format!("{}/hook/down", env.base) }))
        .await;
    let (flaky, down) = (run_id(&flaky), run_id(&down));
    let status = |run: RunId| {
        let (env, a) = (&env, &a);
        async move { env.call(a, reqwest::Method::GET, &format!("/v1/runs/{run}"), None).await.1["webhook"].clone() }
    };
    wait_for("the flaky delivery", LONG, || async { status(flaky).await["status"] == "delivered" }).await;
    wait_for("the failed delivery", LONG, || async { status(down).await["status"] == "failed" }).await;
    let got = env.deliveries("flaky");
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(got.iter().all(|d| d.id == got[0].id), "one webhook-id for every attempt: {got:?}");
    got.iter().for_each(assert_signed);
    let failed = status(down).await;
    assert_eq!(
        (failed["attempts"].clone(), failed["last_error"].clone()),
        (json!(3), json!("the receiver answered 503 Service Unavailable"))
    );
    assert_eq!(env.deliveries("down").len(), 3, "no attempt past the bound");
    let metrics = reqwest::get(format!("http://{}/metrics", a.addr)).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("agent_host_webhooks_failed_total 1"), "{metrics}");
    assert!(metrics.contains("agent_host_webhooks_delivered_total 1"), "{metrics}");
    // A URL outside the allow-list is refused, naming it.
    let (code, v) =
        env.post_run(&a, json!({ "plugin": "echo", "content": "z", "webhook": "http://example.com/x" })).await;
    assert_eq!((code, v["error"]["code"].clone()), (422, json!("invalid")), "{v}");
    let _ = flaky;
}

/// The conversation a run is in.
async fn conversation_of(env: &Env, run: RunId) -> ConversationId {
    sqlx::query_scalar("SELECT conversation_id FROM agent_run WHERE id = $1")
        .bind(run)
        .fetch_one(&env.db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_refuses_a_busy_conversation_and_interrupt_stops_it_and_runs_next() {
    let env = Env::new().await;
    install_audit(&env.db.pool).await;
    let a = env.spawn("A", &[]);
    let (_, first) = env
        .post_run(&a, json!({ "plugin": "sleep", "content": "long", "config": { "steps": 100000, "step_ms": 20 } }))
        .await;
    let first = run_id(&first);
    let conv = conversation_of(&env, first).await;
    wait_for("streamed text", LONG, || async { deltas_text(&journal_payloads(&env.db.pool, first).await).len() > 5 })
        .await;
    let turn = |strategy: &str| json!({ "plugin": "echo", "content": format!("{strategy} me"), "conversation_id": conv, "multitask_strategy": strategy });

    // reject: 409 naming the active run; nothing enqueued.
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run").fetch_one(&env.db.pool).await.unwrap();
    let (code, v) = env.post_run(&a, turn("reject")).await;
    assert_eq!((code, v["error"]["code"].clone()), (409, json!("conversation_busy")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains(&first.to_string()), "{v}");
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run").fetch_one(&env.db.pool).await.unwrap();
    assert_eq!(before, after);

    // A retried reject (same Idempotency-Key) is answered as the first was,
    // although the conversation is now busy with the first's own run.
    let (_, fresh) = env.call(&a, reqwest::Method::POST, "/v1/conversations", Some(json!({}))).await;
    let body = json!({ "plugin": "sleep", "content": "once", "conversation_id": fresh["id"], "multitask_strategy": "reject",
                       "config": { "steps": 100000, "step_ms": 20 } });
    let post_keyed = || {
        reqwest::Client::new()
            .post(format!("http://{}/v1/runs", a.addr))
            .bearer_auth(&env.token)
            .header("Idempotency-Key", "reject-once")
            .json(&body)
            .send()
    };
    let first_try = post_keyed().await.unwrap();
    assert_eq!(first_try.status(), 202);
    let first_run = first_try.json::<Value>().await.unwrap()["run_id"].clone();
    let retry = post_keyed().await.unwrap();
    assert_eq!(retry.status(), 202, "a retry is replayed, not refused");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.json::<Value>().await.unwrap()["run_id"], first_run);
    let (_, stopped) =
        env.call(&a, reqwest::Method::POST, &format!("/v1/runs/{}/cancel", first_run.as_str().unwrap()), None).await;
    assert_eq!(stopped["cancel_requested"], true);

    // A queued turn behind it, then interrupt: both stopped, the new one next.
    let (_, queued) = env.post_run(&a, turn("enqueue")).await;
    let queued = run_id(&queued);
    let (code, v) = env.post_run(&a, turn("interrupt")).await;
    assert_eq!(code, 202, "{v}");
    let next = run_id(&v);
    assert_eq!(wait_terminal(&env.db.pool, next, LONG).await, "completed");
    assert_eq!(status(&env.db.pool, first).await, "cancelled");
    assert_eq!(status(&env.db.pool, queued).await, "cancelled");
    let partial: (String, String) =
        sqlx::query_as("SELECT content, status FROM message WHERE run_id = $1 AND role = 'assistant'")
            .bind(first)
            .fetch_one(&env.db.pool)
            .await
            .unwrap();
    assert_eq!(partial, (deltas_text(&journal_payloads(&env.db.pool, first).await), "partial".to_string()));
    // The audit: after the interrupt, the next turn to start was the new one.
    let audit: Vec<(RunId, String, String)> =
        sqlx::query_as("SELECT run_id, old, new FROM run_audit WHERE conversation_id = $1 ORDER BY n")
            .bind(conv)
            .fetch_all(&env.db.pool)
            .await
            .unwrap();
    let started: Vec<RunId> = audit.iter().filter(|(_, _, new)| new == "running").map(|(r, _, _)| *r).collect();
    assert_eq!(started, vec![first, next], "{audit:?}");
}

/// Firings of a schedule: its runs' idempotency keys, by firing time.
async fn firings(env: &Env, schedule: &str) -> Vec<i64> {
    let keys: Vec<String> = sqlx::query_scalar("SELECT idempotency_key FROM agent_run WHERE idempotency_key LIKE $1")
        .bind(format!("schedule-{schedule}-%"))
        .fetch_all(&env.db.pool)
        .await
        .unwrap();
    let mut times: Vec<i64> = keys.iter().map(|k| k.rsplit('-').next().unwrap().parse().unwrap()).collect();
    times.sort();
    times
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_fires_once_per_firing_across_three_processes_and_catches_up_once() {
    let env = Env::new().await;
    let hosts: Vec<HostProcess> = ["A", "B", "C"].iter().map(|w| env.spawn(w, &[])).collect();
    let (code, s) = env
        .call(
            &hosts[0],
            reqwest::Method::POST,
            "/v1/schedules",
            Some(json!({ "plugin": "noop", "content": "tick", "cron": "* * * * * *" })),
        )
        .await;
    assert_eq!(code, 201, "{s}");
    let id = s["id"].as_str().unwrap().to_string();
    wait_for("five firings", LONG, || async { firings(&env, &id).await.len() >= 5 }).await;
    let fired = firings(&env, &id).await;
    let mut distinct = fired.clone();
    distinct.dedup();
    assert_eq!(distinct, fired, "one run per firing");
    assert!(fired.windows(2).all(|w| w[1] - w[0] == 1_000_000), "a firing every second, none skipped: {fired:?}");
    let per_run: HashMap<i64, usize> = fired.iter().fold(HashMap::new(), |mut m, t| {
        *m.entry(*t).or_default() += 1;
        m
    });
    assert!(per_run.values().all(|n| *n == 1));

    // Every process down; the schedule's next firing goes five seconds past.
    drop(hosts);
    let stopped = firings(&env, &id).await.len();
    wait_for("five missed firings", LONG, || async {
        let late: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM now() - next_fire_at)::float8 FROM schedule WHERE id = $1::uuid",
        )
        .bind(&id)
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
        late > 5.0
    })
    .await;
    assert_eq!(firings(&env, &id).await.len(), stopped, "nothing fired while every process was down");
    let restarted = chrono::Utc::now().timestamp_micros();
    let a = env.spawn("A2", &[]);
    wait_for("the catch-up and the next firing", LONG, || async { firings(&env, &id).await.len() >= stopped + 2 })
        .await;
    let (code, _) = env.call(&a, reqwest::Method::POST, &format!("/v1/schedules/{id}/pause"), None).await;
    assert_eq!(code, 200);
    let after = firings(&env, &id).await;
    let missed: Vec<i64> = after[stopped..].iter().copied().filter(|t| *t < restarted - 1_000_000).collect();
    // One catch-up for the five-plus missed seconds (the first missed), then on from now.
    assert_eq!(missed, vec![fired.last().unwrap() + 1_000_000], "one catch-up, not one per missed tick: {after:?}");
    let resumed = &after[stopped + 1..];
    assert!(resumed[0] >= restarted - 1_000_000, "after the catch-up it goes on from now: {after:?}");
    // The CLI lists it (paused now), and deletes it.
    let cli = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
            .env("AGENT_HOST_URL", format!("http://{}", a.addr))
            .env("AGENT_HOST_TOKEN", &env.token)
            .args(args)
            .output()
            .unwrap()
    };
    let out = cli(&["schedules", "list"]);
    let listed = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && listed.contains(&id) && listed.contains("* * * * * *\tUTC\tnoop\tpaused"),
        "{listed}"
    );
    let out = cli(&["schedules", "delete", &id]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (code, _) = env.call(&a, reqwest::Method::DELETE, &format!("/v1/schedules/{id}"), None).await;
    assert_eq!(code, 404, "deleted already");
    let (code, v) = env
        .call(
            &a,
            reqwest::Method::POST,
            "/v1/schedules",
            Some(json!({ "plugin": "noop", "content": "x", "cron": "nonsense" })),
        )
        .await;
    assert_eq!(code, 422, "{v}");
}

/// Issue 40: completion webhooks are signed per tenant. A tenant's admin
/// reads its key (`GET /v1/webhooks/signing-key`, the key its deliveries are
/// signed with, which `assert_signed` checks); another tenant's key differs,
/// and neither is the operator's secret. A user who is not an admin is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_has_its_own_webhook_signing_key() {
    let env = Env::new().await;
    let a = env.spawn("A", &[]);
    let key_of = |token: String| {
        let url = format!("http://{}/v1/webhooks/signing-key", a.addr);
        async move {
            let res = reqwest::Client::new().get(url).bearer_auth(token).send().await.unwrap();
            (res.status().as_u16(), res.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let acme_admin = tokens::create(&env.db.pool, "ada", "acme", true).await.unwrap();
    let other_admin = tokens::create(&env.db.pool, "olaf", "other", true).await.unwrap();
    let (code, acme) = key_of(acme_admin).await;
    assert_eq!(code, 200, "{acme}");
    let want = format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(acme_key()));
    assert_eq!(acme["key"], json!(want), "{acme}");
    let (_, other) = key_of(other_admin).await;
    assert_ne!(other["key"], acme["key"]);
    assert_ne!(acme["key"], json!(SECRET), "not the operator's secret");
    assert_eq!(key_of(env.token.clone()).await.0, 403, "a user who is not an admin");
}
