//! Operator controls: token lifecycle (revocation seen by two processes at
//! once, an open stream ended within its keepalive, expiry, a list that
//! never shows a secret), stream tickets instead of tokens in URLs, tenant
//! quotas and rate limits (429 with Retry-After, nothing written), plugins
//! owned by a tenant, and the append-only audit trail.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::http::{multipart, oneshot, TestHost};
use crate::support::process::{HostProcess, FAST};
use crate::support::sse::SseClient;
use crate::support::*;
use agent_host::db::tokens::{self, NewToken};
use agent_host::db::RunId;
use agent_host::service::quota::{QuotaConfig, Quotas};
use agent_host::service::submit::Policy;
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

/// A token of `user` in `tenant`: (id, secret).
async fn token(pool: &PgPool, user: &str, tenant: &str, admin: bool, operator: bool) -> (uuid::Uuid, String) {
    let new = NewToken { user_id: user, tenant_id: tenant, admin, operator, ..NewToken::default() };
    let (info, secret) = tokens::create_with(pool, &new).await.unwrap();
    (info.id, secret)
}

async fn get(client: &reqwest::Client, url: &str, token: &str) -> StatusCode {
    client.get(url).bearer_auth(token).send().await.unwrap().status()
}

/// Rows of the tables an enqueue writes.
async fn written(pool: &PgPool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM agent_run), (SELECT count(*) FROM message), (SELECT count(*) FROM run_event)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A revoked token is refused at the next request by either of two host
/// processes, and a stream it holds open ends within the keepalive interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_is_refused_by_every_process_and_its_open_stream_ends() {
    let db = TestDb::new().await;
    let keepalive_ms = 400;
    let mut args = FAST.to_vec();
    let keepalive = keepalive_ms.to_string();
    args.extend(["--sse-keepalive-ms", &keepalive]);
    let a = HostProcess::spawn(&db.url, "A", &args);
    let b = HostProcess::spawn(&db.url, "B", &args);
    let (alice_id, alice) = token(&db.pool, "alice", "acme", false, false).await;
    let (_, admin) = token(&db.pool, "root", "acme", true, false).await;
    let client = reqwest::Client::new();

    // A long run, and its stream open on A.
    let res = client
        .post(format!("http://{}/v1/runs", a.addr))
        .bearer_auth(&alice)
        .json(&json!({ "content": "slowly", "plugin": "sleep", "config": { "steps": 10000, "step_ms": 50 } }))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    let run: RunId = res.json::<Value>().await.unwrap()["run_id"].as_str().unwrap().parse().unwrap();
    let mut stream = SseClient::connect(&format!("http://{}/v1/runs/{run}/events", a.addr), &alice, None).await;
    let first = stream.next(LONG).await.expect("a first frame");
    assert_eq!(first.event, "user_message_created");
    for host in [&a, &b] {
        assert_eq!(get(&client, &format!("http://{}/v1/runs/{run}", host.addr), &alice).await, StatusCode::OK);
    }

    // Revoked through the admin API on B.
    let res =
        client.post(format!("http://{}/v1/tokens/{alice_id}/revoke", b.addr)).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK, "{}", res.text().await.unwrap());
    let revoked_at = Instant::now();
    for host in [&a, &b] {
        let res = client.get(format!("http://{}/v1/runs/{run}", host.addr)).bearer_auth(&alice).send().await.unwrap();
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "process {}", host.worker_id);
        let body: Value = res.json().await.unwrap();
        assert_eq!(body["error"]["code"], "unauthenticated");
    }
    // The open stream ends by itself (the run goes on): within one
    // keepalive interval, with slack for a loaded machine.
    while stream.next(LONG).await.is_some() {}
    let ended_after = revoked_at.elapsed();
    assert!(
        ended_after < Duration::from_millis(keepalive_ms * 2 + 1000),
        "the stream outlived its revoked token by {ended_after:?}"
    );
    assert_eq!(status(&db.pool, run).await, "running", "revoking a token does not touch its runs");
    // A repeat revoke is idempotent; another tenant's admin cannot see it.
    let (_, other_admin) = token(&db.pool, "eve", "evil", true, false).await;
    let res = client
        .post(format!("http://{}/v1/tokens/{alice_id}/revoke", a.addr))
        .bearer_auth(&other_admin)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
    let res = client.post(format!("http://{}/v1/runs/{run}/cancel", a.addr)).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::NOT_FOUND, "the admin is not the run's owner");
}

/// `tenants share`, `tenants ceiling` and `tenants list` at the command
/// line, each audited; a ceiling of no known limit is refused naming them.
#[tokio::test]
async fn tenants_shares_and_ceilings_at_the_command_line() {
    let db = TestDb::new().await;
    let cli = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
            .args(["tenants", "--database-url", &db.url])
            .args(args)
            .output()
            .unwrap()
    };
    let ok = |args: &[&str]| {
        let out = cli(args);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let said = ok(&["ceiling", "trial", "wall_ms=600000", "memory_bytes=134217728"]);
    assert_eq!(said.trim(), "tenant trial: its plugins may ask for at most memory_bytes=134217728 wall_ms=600000");
    ok(&["share", "trial", "25"]);
    ok(&["share", "big", "100"]);
    let listed = ok(&["list"]);
    let want = "tenant\tslot_share_pct\tceilings\nbig\t100\t-\ntrial\t25\tmemory_bytes=134217728 wall_ms=600000\n";
    assert_eq!(listed, want);
    let bad = cli(&["ceiling", "trial", "wall=1"]);
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("no limit named \"wall\"; limits are memory_bytes, cpu_ms, wall_ms"), "{stderr}");
    ok(&["share", "trial", "--clear"]);
    ok(&["ceiling", "big", "--clear"]);
    assert_eq!(
        ok(&["list"]),
        "tenant\tslot_share_pct\tceilings\nbig\t100\t-\ntrial\t-\tmemory_bytes=134217728 wall_ms=600000\n"
    );
    ok(&["ceiling", "trial", "--clear"]);
    assert_eq!(ok(&["list"]), "tenant\tslot_share_pct\tceilings\nbig\t100\t-\n");
    let audited: Vec<String> = sqlx::query_scalar("SELECT action FROM audit_event WHERE target = 'trial' ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let want = ["tenant.ceilings_set", "tenant.share_set", "tenant.share_set", "tenant.ceilings_set"];
    assert_eq!(audited, want);
}

/// `tokens create --expires-in`, `tokens list` (no secret) and `tokens
/// revoke` at the command line; an expired token is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_expire_and_the_list_never_shows_a_secret() {
    let db = TestDb::new().await;
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
            .args(["tokens", "--database-url", &db.url])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        (String::from_utf8_lossy(&out.stdout).to_string(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (short, _) = cli(&["create", "--user", "temp", "--tenant", "acme", "--expires-in", "1h"]);
    let short = short.trim().to_string();
    let (long, _) = cli(&["create", "--user", "keeper", "--tenant", "acme", "--admin"]);
    let long = long.trim().to_string();
    assert!(short.starts_with("ah_") && long.starts_with("ah_"));
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .args(["tokens", "--database-url", &db.url, "create", "--user", "u", "--tenant", "t", "--expires-in", "soon"])
        .output()
        .unwrap();
    assert!(!bad.status.success(), "a malformed duration is refused");

    let host = TestHost::builtins(&db).await;
    assert_eq!(host.call_as(&short, "GET", "/v1/conversations", None).await.0, StatusCode::OK);
    let (listed, _) = cli(&["list"]);
    for secret in [&short, &long, &host.token] {
        assert!(!listed.contains(secret.as_str()), "the list shows a secret: {listed}");
        assert!(!listed.contains(&secret[3..]), "the list shows part of a secret");
    }
    assert!(listed.contains("temp") && listed.contains("keeper") && listed.contains("admin"), "{listed}");
    let temp_line = listed.lines().find(|l| l.contains("\ttemp\t")).unwrap().to_string();
    let fields: Vec<&str> = temp_line.split('\t').collect();
    assert_ne!(fields[5], "-", "the short token was used: {temp_line}");
    assert_ne!(fields[6], "-", "it has an expiry: {temp_line}");
    // The HTTP list says the same, without secrets either.
    let (code, body) = host.call_as(&long, "GET", "/v1/tokens", None).await;
    assert_eq!(code, StatusCode::OK);
    assert!(!body.to_string().contains(&short[3..]) && !body.to_string().contains(&long[3..]));
    assert_eq!(body["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(host.call("GET", "/v1/tokens", None).await.0, StatusCode::FORBIDDEN, "not an admin");

    let ahead: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM expires_at - now())::float8 FROM api_token WHERE user_id = 'temp'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(ahead > 3500.0 && ahead <= 3600.0, "--expires-in 1h: {ahead}");
    // Past its expiry (by the database's clock): refused.
    sqlx::query("UPDATE api_token SET expires_at = now() - interval '1 second' WHERE user_id = 'temp'")
        .execute(&db.pool)
        .await
        .unwrap();
    let (code, body) = host.call_as(&short, "GET", "/v1/conversations", None).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED, "{body}");
    // Revoked at the command line.
    let id = fields[0];
    let (said, _) = cli(&["revoke", id]);
    assert!(said.contains("revoked"), "{said}");
    let (listed, _) = cli(&["list", "--tenant", "acme"]);
    let line = listed.lines().find(|l| l.starts_with(id)).unwrap();
    assert_ne!(line.split('\t').nth(7).unwrap(), "-", "the list shows when it was revoked: {line}");
    host.stop().await;
}

/// A stream ticket opens its own run's stream only, until it expires; a
/// token in the URL is refused; the console is served under a CSP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_tickets_open_one_run_until_they_expire_and_tokens_in_urls_are_refused() {
    let db = TestDb::new().await;
    let host = TestHost::builtins(&db).await;
    let run_of = |body: Value| -> RunId { body["run_id"].as_str().unwrap().parse().unwrap() };
    let (_, a) = host.call("POST", "/v1/runs", Some(json!({ "content": "a", "plugin": "echo" }))).await;
    let (_, b) = host.call("POST", "/v1/runs", Some(json!({ "content": "b", "plugin": "echo" }))).await;
    let (a, b) = (run_of(a), run_of(b));
    wait_terminal(&db.pool, a, LONG).await;
    let (code, ticket) = host.call("POST", &format!("/v1/runs/{a}/stream-ticket"), None).await;
    assert_eq!(code, StatusCode::CREATED, "{ticket}");
    let t = ticket["ticket"].as_str().unwrap().to_string();
    assert!(!t.contains(&host.token[3..]), "a ticket is not the token");
    assert_eq!(ticket["url"], format!("/v1/runs/{a}/events?ticket={t}"));
    let client = reqwest::Client::new();
    let open = |run: RunId, query: String| {
        let client = client.clone();
        let url = format!("{}/v1/runs/{run}/events?{query}", host.base);
        async move { client.get(url).header("Accept", "text/event-stream").send().await.unwrap() }
    };
    // Its run's stream, whole, with no header at all.
    let res = open(a, format!("ticket={t}")).await;
    assert_eq!(res.status(), StatusCode::OK);
    let body = res.text().await.unwrap();
    assert!(body.contains("event: complete"), "{body}");
    // Not another run's, not another route's.
    assert_eq!(open(b, format!("ticket={t}")).await.status(), StatusCode::UNAUTHORIZED);
    let res = client.get(format!("{}/v1/runs/{a}?ticket={t}", host.base)).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "a ticket opens the stream route only");
    // The long-lived token in the URL is refused, even with a valid ticket beside it.
    let res = open(a, format!("access_token={}", host.token)).await;
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    let body: Value = res.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("stream ticket"), "{body}");
    assert_eq!(open(a, format!("ticket={t}&access_token={}", host.token)).await.status(), StatusCode::UNAUTHORIZED);
    // Another user cannot mint one for alice's run.
    let (_, bob) = token(&db.pool, "bob", "acme", false, false).await;
    assert_eq!(host.call_as(&bob, "POST", &format!("/v1/runs/{a}/stream-ticket"), None).await.0, StatusCode::NOT_FOUND);
    // It expires (by the database's clock; its lifetime is a minute).
    let left: f64 = sqlx::query_scalar("SELECT extract(epoch FROM expires_at - now())::float8 FROM stream_ticket")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(left > 0.0 && left <= tokens::TICKET_TTL_S as f64, "{left}");
    sqlx::query("UPDATE stream_ticket SET expires_at = now() - interval '1 second'").execute(&db.pool).await.unwrap();
    assert_eq!(open(a, format!("ticket={t}")).await.status(), StatusCode::UNAUTHORIZED);

    // The console: its own script only.
    let res = client.get(format!("{}/", host.base)).send().await.unwrap();
    let csp = res.headers()["content-security-policy"].to_str().unwrap().to_string();
    assert!(csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"), "{csp}");
    let html = res.text().await.unwrap();
    assert!(html.contains(r#"<script src="/console.js"></script>"#) && !html.contains("<script>"), "no inline script");
    let js = client.get(format!("{}/console.js", host.base)).send().await.unwrap();
    assert!(js.headers()["content-type"].to_str().unwrap().starts_with("text/javascript"));
    assert!(!js.text().await.unwrap().contains("access_token"));
    host.stop().await;
}

/// Quotas: past the tenant's queue quota, 429 with Retry-After and nothing
/// written, another tenant unaffected; a burst past the enqueue rate is
/// shaped (every request lands, spread out); a user's live streams are bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_refuse_with_429_and_write_nothing_and_rates_shape_bursts() {
    let db = TestDb::new().await;
    let quotas =
        Quotas::new(QuotaConfig { tenant_max_queued: Some(2), user_max_streams: Some(1), ..QuotaConfig::default() });
    let host = TestHost::undispatched(&db, |s| s.policy = Arc::new(Policy { quotas, ..Policy::default() })).await;
    let run = json!({ "content": "hello", "plugin": "echo" });
    let (c1, first) = host.call("POST", "/v1/runs", Some(run.clone())).await;
    let (c2, _) = host.call("POST", "/v1/runs", Some(run.clone())).await;
    assert_eq!((c1, c2), (StatusCode::ACCEPTED, StatusCode::ACCEPTED));
    let before = written(&db.pool).await;
    let res = host
        .client
        .post(format!("{}/v1/runs", host.base))
        .bearer_auth(&host.token)
        .json(&json!({ "content": "one too many", "plugin": "echo" }))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = res.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry_after >= 1);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"]["code"], "quota_exceeded", "{body}");
    assert_eq!(written(&db.pool).await, before, "a refused enqueue writes no run, message or event");
    let content: i64 = sqlx::query_scalar("SELECT count(*) FROM message WHERE content = 'one too many'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(content, 0);
    // Another tenant is not affected.
    let (_, other) = token(&db.pool, "olga", "other", false, false).await;
    assert_eq!(host.call_as(&other, "POST", "/v1/runs", Some(run.clone())).await.0, StatusCode::ACCEPTED);
    let metrics = host.scrape().await;
    assert_eq!(metrics[r#"agent_host_quota_refusals_total{tenant="acme",limit="queued_runs"}"#], 1.0);
    // Issue 40: a scrape without an operator's token names no tenant.
    let public = host.client.get(format!("{}/metrics", host.base)).send().await.unwrap().text().await.unwrap();
    assert!(public.contains(r#"agent_host_quota_refusals_total{tenant="*",limit="queued_runs"} 1"#), "{public}");
    assert!(!public.contains("acme"), "{public}");
    let as_user = host
        .client
        .get(format!("{}/metrics", host.base))
        .bearer_auth(&host.token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!as_user.contains("acme"), "a tenant's user sees no tenant ids either");
    // Concurrent enqueues cannot both take the last place (the count is
    // taken under a per-tenant lock in the enqueue transaction).
    let (_, racer) = token(&db.pool, "rita", "race", false, false).await;
    let racing = (0..5).map(|i| {
        let body = json!({ "content": format!("race {i}"), "plugin": "echo" });
        let (host, racer) = (&host, &racer);
        async move { host.call_as(racer, "POST", "/v1/runs", Some(body)).await.0 }
    });
    let codes = futures::future::join_all(racing).await;
    let accepted = codes.iter().filter(|c| **c == StatusCode::ACCEPTED).count();
    let refused = codes.iter().filter(|c| **c == StatusCode::TOO_MANY_REQUESTS).count();
    assert_eq!((accepted, refused), (2, 3), "{codes:?}");

    // One live stream per user on this process.
    let first: RunId = first["run_id"].as_str().unwrap().parse().unwrap();
    let url = host.events_url(first);
    let _open = SseClient::connect(&url, &host.token, None).await;
    let res =
        host.client.get(&url).bearer_auth(&host.token).header("Accept", "text/event-stream").send().await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(res.headers().contains_key("retry-after"));
    host.stop().await;

    // A burst of 6 at 5/s with a bucket of 1 (another host, rates only):
    // shaped, not failed.
    let rates = Quotas::new(QuotaConfig {
        tenant_enqueue_per_s: NonZeroU32::new(5),
        tenant_enqueue_burst: NonZeroU32::new(1),
        ..QuotaConfig::default()
    });
    let host =
        TestHost::undispatched(&db, |s| s.policy = Arc::new(Policy { quotas: rates, ..Policy::default() })).await;
    let (_, fast) = token(&db.pool, "fiona", "fast", false, false).await;
    let started = Instant::now();
    let burst = (0..6).map(|i| {
        let body = json!({ "content": format!("burst {i}"), "plugin": "echo" });
        let (host, fast) = (&host, &fast);
        async move { host.call_as(fast, "POST", "/v1/runs", Some(body)).await.0 }
    });
    let codes = futures::future::join_all(burst).await;
    assert!(codes.iter().all(|c| *c == StatusCode::ACCEPTED), "{codes:?}");
    assert!(started.elapsed() >= Duration::from_millis(900), "the burst was spread out: {:?}", started.elapsed());
    host.stop().await;
}

/// Tenant B cannot see, run or overwrite tenant A's private plugin; an
/// operator's published plugin runs for both; a queued run keeps its digest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_belong_to_a_tenant_and_published_ones_run_for_all() {
    let db = TestDb::new().await;
    let (agents, router) = sandboxed_router(&db);
    let (_, admin_a) = token(&db.pool, "ann", "a", true, false).await;
    let (_, admin_b) = token(&db.pool, "ben", "b", true, false).await;
    let (_, operator) = token(&db.pool, "ops", "ops", true, true).await;
    let upload = |token: String, name: &'static str, wasm: &'static str, published: bool| {
        let router = router.clone();
        async move {
            let component = plugin_wasm(wasm);
            let mut fields: Vec<(&str, &[u8])> = vec![("name", name.as_bytes()), ("component", component.as_slice())];
            if published {
                fields.push(("published", "true".as_bytes()));
            }
            let (ct, body) = multipart(&fields);
            oneshot(&router, "POST", "/v1/plugins", Some(&token), &[], Some((&ct, body))).await
        }
    };
    let a = upload(admin_a.clone(), "private", "echo", false).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    assert_eq!(a.json()["tenant_id"], "a");
    let a_digest = a.json()["digest"].as_str().unwrap().to_string();
    // An admin cannot publish; an operator can.
    assert_eq!(upload(admin_a.clone(), "shared", "echo", true).await.status, StatusCode::FORBIDDEN);
    let published = upload(operator.clone(), "shared", "echo", true).await;
    assert_eq!(published.status, StatusCode::CREATED, "{}", published.text());
    assert_eq!(published.json()["published"], true);

    // B does not see A's plugin, and cannot run it: unknown, listing only
    // what B may use.
    let list = oneshot(&router, "GET", "/v1/plugins", Some(&admin_b), &[], None).await.json();
    let names: Vec<&str> = list["plugins"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"shared") && !names.contains(&"private"), "{names:?}");
    let host = TestHost::start(&db, None, agents, fast_config("w")).await;
    let enqueue = |token: String, plugin: &'static str| {
        let host = &host;
        async move { host.call_as(&token, "POST", "/v1/runs", Some(json!({ "content": "hi", "plugin": plugin }))).await }
    };
    let (code, refused) = enqueue(admin_b.clone(), "private").await;
    assert_eq!(code, StatusCode::UNPROCESSABLE_ENTITY, "{refused}");
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(message.contains("unknown plugin") && message.contains("shared"), "{message}");
    assert!(!message.contains("private,") && !message.ends_with("private"), "B is not told A's plugin: {message}");
    // Nor schedule it, nor ask the Responses API for it as a model.
    let schedule = json!({ "plugin": "private", "content": "hi", "cron": "0 0 1 1 *" });
    let (code, body) = host.call_as(&admin_b, "POST", "/v1/schedules", Some(schedule.clone())).await;
    assert_eq!(code, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("unknown plugin"), "{body}");
    let (code, body) =
        host.call_as(&admin_b, "POST", "/v1/responses", Some(json!({ "model": "private", "input": "hi" }))).await;
    assert_eq!(code, StatusCode::NOT_FOUND, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("not found") && message.contains("shared"), "{message}");
    assert!(!message.contains("private,") && !message.ends_with("private"), "B is not told A's plugin: {message}");
    assert_eq!(host.call_as(&admin_a, "POST", "/v1/schedules", Some(schedule)).await.0, StatusCode::CREATED);

    // B's upload of the same name is B's own: A's is untouched.
    let b = upload(admin_b.clone(), "private", "fixtures", false).await;
    assert_eq!(b.status, StatusCode::CREATED, "{}", b.text());
    let b_digest = b.json()["digest"].as_str().unwrap().to_string();
    assert_ne!(a_digest, b_digest);
    let row: String = sqlx::query_scalar("SELECT digest FROM plugin WHERE tenant_id = 'a' AND name = 'private'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(row, a_digest, "B did not overwrite A's plugin");

    // Each tenant's name resolves to its own; the published one runs for both.
    let (_, run_a) = enqueue(admin_a.clone(), "private").await;
    let digest = |run: &Value| {
        let pool = db.pool.clone();
        let id: RunId = run["run_id"].as_str().unwrap().parse().unwrap();
        async move {
            let d: String = sqlx::query_scalar("SELECT plugin_digest FROM agent_run WHERE id = $1")
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap();
            (id, d)
        }
    };
    let (run_a, pinned) = digest(&run_a).await;
    assert_eq!(pinned, a_digest);
    for t in [&admin_a, &admin_b] {
        let (code, run) = enqueue(t.clone(), "shared").await;
        assert_eq!(code, StatusCode::ACCEPTED, "{run}");
        let (id, d) = digest(&run).await;
        assert_eq!(d, published.json()["digest"].as_str().unwrap());
        assert_eq!(wait_terminal(&db.pool, id, LONG).await, "completed");
    }
    assert_eq!(wait_terminal(&db.pool, run_a, LONG).await, "completed");
    // Re-pointing A's name does not change what an already enqueued run
    // executes: one queued behind a slow turn, re-pointed while it waits.
    let (_, slow) = host
        .call_as(
            &admin_a,
            "POST",
            "/v1/runs",
            Some(json!({ "content": "wait", "plugin": "sleep", "config": { "steps": 30, "step_ms": 100 } })),
        )
        .await;
    let conversation = slow["conversation_id"].as_str().unwrap();
    let (_, queued) = host
        .call_as(
            &admin_a,
            "POST",
            &format!("/v1/conversations/{conversation}/runs"),
            Some(json!({ "content": "pinned words", "plugin": "private" })),
        )
        .await;
    let (queued, _) = digest(&queued).await;
    let repointed = upload(admin_a.clone(), "private", "fixtures", false).await;
    assert_eq!(repointed.status, StatusCode::CREATED);
    assert_ne!(repointed.json()["digest"].as_str().unwrap(), a_digest);
    // The two components answer differently: echo says the words back; the
    // fixtures component, given no mode, fails. The queued run ran echo.
    assert_eq!(wait_terminal(&db.pool, queued, LONG).await, "completed");
    let said: Vec<String> = sqlx::query_scalar("SELECT content FROM message WHERE run_id = $1 AND role = 'assistant'")
        .bind(queued)
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(said, ["pinned words"], "the queued run executed its pinned (echo) component");
    let (_, after) = enqueue(admin_a.clone(), "private").await;
    let (after, d) = digest(&after).await;
    assert_ne!(d, a_digest, "a new run gets the re-pointed component");
    assert_eq!(wait_terminal(&db.pool, after, LONG).await, "failed");
    assert!(run_error(&db.pool, after).await.contains("unknown fixture mode"), "{}", run_error(&db.pool, after).await);
    host.stop().await;
}

/// Every audited action leaves exactly one row, readable by admins, and no
/// row holds a secret or message text; the table refuses edits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_audited_action_leaves_one_row_without_secrets() {
    let db = TestDb::new().await;
    let (_, router) = sandboxed_router(&db);
    let host = TestHost::undispatched(&db, |_| {}).await;
    let (_, admin) = token(&db.pool, "root", "acme", true, false).await;
    let secret_text = "the launch code is 0000";

    // Token created and revoked over HTTP.
    let (code, created) =
        host.call_as(&admin, "POST", "/v1/tokens", Some(json!({ "user_id": "carol", "expires_in_s": 3600 }))).await;
    assert_eq!(code, StatusCode::CREATED, "{created}");
    let carol = created["token"].as_str().unwrap().to_string();
    let carol_id = created["id"].as_str().unwrap().to_string();
    assert_eq!(
        host.call_as(&admin, "POST", "/v1/tokens", Some(json!({ "user_id": "x", "tenant_id": "other" }))).await.0,
        StatusCode::FORBIDDEN,
        "an admin creates tokens in its own tenant only"
    );
    // Plugin uploaded, then re-pointed.
    for wasm in ["echo", "fixtures"] {
        let component = plugin_wasm(wasm);
        let fields: [(&str, &[u8]); 2] = [("name", "tool".as_bytes()), ("component", component.as_slice())];
        let (ct, body) = multipart(&fields);
        assert_eq!(oneshot(&router, "POST", "/v1/plugins", Some(&admin), &[], Some((&ct, body))).await.status, 201);
    }
    // A run cancelled (queued: nothing dispatches), its conversation stopped, the run retried.
    let (_, run) = host.call("POST", "/v1/runs", Some(json!({ "content": secret_text, "plugin": "echo" }))).await;
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let conversation = run["conversation_id"].as_str().unwrap().to_string();
    assert_eq!(host.call("POST", &format!("/v1/runs/{run_id}/cancel"), None).await.0, StatusCode::ACCEPTED);
    assert_eq!(host.call("POST", &format!("/v1/runs/{run_id}/cancel"), None).await.0, StatusCode::OK, "a repeat");
    let (code, retried) = host.call("POST", &format!("/v1/runs/{run_id}/retry"), None).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{retried}");
    assert_eq!(host.call("POST", &format!("/v1/conversations/{conversation}/stop"), None).await.0, StatusCode::OK);
    // A schedule created, paused, resumed and deleted.
    let schedule = json!({ "plugin": "echo", "content": secret_text, "cron": "0 0 1 1 *" });
    let (code, s) = host.call("POST", "/v1/schedules", Some(schedule)).await;
    assert_eq!(code, StatusCode::CREATED, "{s}");
    let sid = s["id"].as_str().unwrap();
    assert_eq!(host.call("POST", &format!("/v1/schedules/{sid}/pause"), None).await.0, StatusCode::OK);
    assert_eq!(host.call("POST", &format!("/v1/schedules/{sid}/resume"), None).await.0, StatusCode::OK);
    assert_eq!(host.call("DELETE", &format!("/v1/schedules/{sid}"), None).await.0, StatusCode::NO_CONTENT);
    let (code, _) = host.call_as(&admin, "POST", &format!("/v1/tokens/{carol_id}/revoke"), None).await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(host.call_as(&admin, "POST", &format!("/v1/tokens/{carol_id}/revoke"), None).await.0, StatusCode::OK);

    let (code, trail) = host.call_as(&admin, "GET", "/v1/audit", None).await;
    assert_eq!(code, StatusCode::OK, "{trail}");
    let rows = trail["events"].as_array().unwrap();
    let actions: Vec<&str> = rows.iter().map(|r| r["action"].as_str().unwrap()).collect();
    for action in [
        "token.created",
        "token.revoked",
        "plugin.uploaded",
        "plugin.repointed",
        "run.cancelled",
        "run.retried",
        "conversation.stopped",
        "schedule.created",
        "schedule.paused",
        "schedule.resumed",
        "schedule.deleted",
    ] {
        assert_eq!(actions.iter().filter(|a| **a == action).count(), 1, "{action} in {actions:?}");
    }
    assert_eq!(rows.len(), 11, "{actions:?}");
    let cancelled = rows.iter().find(|r| r["action"] == "run.cancelled").unwrap();
    assert_eq!((cancelled["target"].as_str().unwrap(), cancelled["actor_user"].as_str().unwrap()), (&*run_id, "alice"));
    let text = trail.to_string();
    for secret in [carol.as_str(), &carol[3..], &admin[3..], &host.token[3..], secret_text, "launch code"] {
        assert!(!text.contains(secret), "an audit row holds {secret:?}: {text}");
    }
    // Admins only, and their tenant's rows only.
    assert_eq!(host.call("GET", "/v1/audit", None).await.0, StatusCode::FORBIDDEN);
    let (_, other_admin) = token(&db.pool, "olaf", "other", true, false).await;
    let (_, theirs) = host.call_as(&other_admin, "GET", "/v1/audit", None).await;
    assert_eq!(theirs["events"], json!([]), "another tenant's admin sees none of them");
    // Append-only in the schema.
    for sql in ["UPDATE audit_event SET target = 'x'", "DELETE FROM audit_event"] {
        let err = sqlx::query(sql).execute(&db.pool).await.unwrap_err();
        assert!(err.to_string().contains("append-only"), "{err}");
    }
    // The command line reads the same trail.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .args(["audit", "--database-url", &db.url, "--tenant", "acme"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 11);
    host.stop().await;
}

/// A user id names one user of one tenant: an admin of another tenant
/// cannot mint a token for it (over HTTP or the command line) and so cannot
/// act on that user's runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_id_belongs_to_one_tenant() {
    let db = TestDb::new().await;
    let host = TestHost::undispatched(&db, |_| {}).await;
    let (code, run) = host.call("POST", "/v1/runs", Some(json!({ "content": "mine", "plugin": "echo" }))).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_string();
    let (_, evil) = token(&db.pool, "mallory", "evil", true, false).await;

    let (code, body) = host.call_as(&evil, "POST", "/v1/tokens", Some(json!({ "user_id": "alice" }))).await;
    assert_eq!(code, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["code"], "conflict", "{body}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .args(["tokens", "--database-url", &db.url, "create", "--user", "alice", "--tenant", "evil"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "the command line refuses it too");
    assert!(String::from_utf8_lossy(&out.stderr).contains("belongs to tenant acme"), "{out:?}");
    let tokens: i64 =
        sqlx::query_scalar("SELECT count(*) FROM api_token WHERE user_id = 'alice'").fetch_one(&db.pool).await.unwrap();
    assert_eq!(tokens, 1, "only alice's own token");
    // Her own tenant's admin may still give her another.
    let (_, admin) = token(&db.pool, "root", "acme", true, false).await;
    let (code, body) = host.call_as(&admin, "POST", "/v1/tokens", Some(json!({ "user_id": "alice" }))).await;
    assert_eq!(code, StatusCode::CREATED, "{body}");
    let second = body["token"].as_str().unwrap();
    assert_eq!(host.call_as(second, "GET", &format!("/v1/runs/{run_id}"), None).await.0, StatusCode::OK);
    host.stop().await;
}

/// The Responses API's streams are held like the native one: each counts
/// against `--user-max-streams` (a refused `stream: true` create enqueues
/// nothing) and ends within a keepalive once its token is revoked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_streams_count_per_user_and_end_when_their_token_is_revoked() {
    let db = TestDb::new().await;
    let keepalive_ms = 400;
    let mut args = FAST.to_vec();
    let keepalive = keepalive_ms.to_string();
    args.extend(["--sse-keepalive-ms", &keepalive, "--user-max-streams", "1"]);
    let a = HostProcess::spawn(&db.url, "A", &args);
    let (alice_id, alice) = token(&db.pool, "alice", "acme", false, false).await;
    let client = reqwest::Client::new();
    let slow = json!({ "model": "sleep", "input": "slowly", "background": true,
                       "config": { "steps": 10000, "step_ms": 50 } });
    let res = client.post(format!("http://{}/v1/responses", a.addr)).bearer_auth(&alice).json(&slow).send().await;
    let res = res.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let id = res.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
    let url = format!("http://{}/v1/responses/{id}?stream=true", a.addr);
    let mut stream = SseClient::connect(&url, &alice, None).await;
    assert!(stream.next(LONG).await.is_some(), "a first frame");

    // A second stream of hers, either way, is refused; the create writes nothing.
    let before = written(&db.pool).await;
    let res = client.get(&url).bearer_auth(&alice).header("Accept", "text/event-stream").send().await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(res.headers().contains_key("retry-after"));
    let streamed = json!({ "model": "sleep", "input": "again", "stream": true });
    let res = client.post(format!("http://{}/v1/responses", a.addr)).bearer_auth(&alice).json(&streamed).send().await;
    let res = res.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "{}", res.text().await.unwrap());
    let after = written(&db.pool).await;
    assert_eq!((after.0, after.1), (before.0, before.1), "a refused stream enqueues no run or message");

    // Revoked: the open stream ends within its keepalive interval.
    sqlx::query("UPDATE api_token SET revoked_at = now() WHERE id = $1")
        .bind(alice_id)
        .execute(&db.pool)
        .await
        .unwrap();
    let revoked_at = Instant::now();
    while stream.next(LONG).await.is_some() {}
    let ended_after = revoked_at.elapsed();
    assert!(
        ended_after < Duration::from_millis(keepalive_ms * 2 + 1000),
        "the stream outlived its revoked token by {ended_after:?}"
    );
    // Its place is given back.
    let (_, again) = token(&db.pool, "alice", "acme", false, false).await;
    drop(SseClient::connect(&url, &again, None).await);
}

/// A retry is held to the tenant's queue quota like any enqueue (429,
/// nothing written); an idempotent replay starts nothing and so takes no
/// rate token: a burst of replays is answered at once, none refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_are_held_to_quotas_and_replays_take_no_rate_tokens() {
    let db = TestDb::new().await;
    let quotas = Quotas::new(QuotaConfig { tenant_max_queued: Some(1), ..QuotaConfig::default() });
    let host = TestHost::undispatched(&db, |s| s.policy = Arc::new(Policy { quotas, ..Policy::default() })).await;
    let run = json!({ "content": "hello", "plugin": "echo" });
    let (code, first) = host.call("POST", "/v1/runs", Some(run.clone())).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{first}");
    let first = first["run_id"].as_str().unwrap().to_string();
    assert_eq!(host.call("POST", &format!("/v1/runs/{first}/cancel"), None).await.0, StatusCode::ACCEPTED);
    let (code, second) = host.call("POST", "/v1/runs", Some(run.clone())).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{second}");
    let before = written(&db.pool).await;
    let res =
        host.client.post(format!("{}/v1/runs/{first}/retry", host.base)).bearer_auth(&host.token).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(res.headers().contains_key("retry-after"));
    assert_eq!(res.json::<Value>().await.unwrap()["error"]["code"], "quota_exceeded");
    assert_eq!(written(&db.pool).await, before, "a refused retry writes nothing");
    // With a place free, the retry goes ahead.
    let second = second["run_id"].as_str().unwrap();
    assert_eq!(host.call("POST", &format!("/v1/runs/{second}/cancel"), None).await.0, StatusCode::ACCEPTED);
    assert_eq!(host.call("POST", &format!("/v1/runs/{first}/retry"), None).await.0, StatusCode::ACCEPTED);
    host.stop().await;

    // 1 enqueue a second, a bucket of 1: were replays to take tokens, a
    // burst of 6 would be refused past the 2 s wait.
    let rates = Quotas::new(QuotaConfig {
        tenant_enqueue_per_s: NonZeroU32::new(1),
        tenant_enqueue_burst: NonZeroU32::new(1),
        ..QuotaConfig::default()
    });
    let host =
        TestHost::undispatched(&db, |s| s.policy = Arc::new(Policy { quotas: rates, ..Policy::default() })).await;
    let (_, slow) = token(&db.pool, "sam", "slow", false, false).await;
    let post = |body: Value| {
        let (host, slow) = (&host, &slow);
        async move {
            let res = host
                .client
                .post(format!("{}/v1/runs", host.base))
                .bearer_auth(slow)
                .header("Idempotency-Key", "once")
                .json(&body)
                .send()
                .await
                .unwrap();
            (res.status(), res.json::<Value>().await.unwrap())
        }
    };
    let (code, original) = post(run.clone()).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{original}");
    let started = Instant::now();
    let replays = futures::future::join_all((0..6).map(|_| post(run.clone()))).await;
    for (code, body) in &replays {
        assert_eq!(*code, StatusCode::ACCEPTED, "{body}");
        assert_eq!(body["run_id"], original["run_id"]);
    }
    assert!(started.elapsed() < Duration::from_millis(1900), "replays waited: {:?}", started.elapsed());
    host.stop().await;
}

/// A token created over HTTP expires no later than the admin token that
/// created it: an expiring admin cannot mint a lasting one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_created_token_expires_no_later_than_its_creator() {
    let db = TestDb::new().await;
    let host = TestHost::undispatched(&db, |_| {}).await;
    let new =
        NewToken { user_id: "temp", tenant_id: "acme", admin: true, expires_in_s: Some(600), ..NewToken::default() };
    let (creator, admin) = tokens::create_with(&db.pool, &new).await.unwrap();
    let cap = creator.expires_at.unwrap();
    for body in [json!({ "user_id": "carl" }), json!({ "user_id": "carl", "expires_in_s": 86_400 })] {
        let (code, created) = host.call_as(&admin, "POST", "/v1/tokens", Some(body)).await;
        assert_eq!(code, StatusCode::CREATED, "{created}");
        let expires: chrono::DateTime<chrono::Utc> = created["expires_at"].as_str().unwrap().parse().unwrap();
        assert_eq!(expires, cap, "{created}");
    }
    let (_, created) =
        host.call_as(&admin, "POST", "/v1/tokens", Some(json!({ "user_id": "carl", "expires_in_s": 60 }))).await;
    let expires: chrono::DateTime<chrono::Utc> = created["expires_at"].as_str().unwrap().parse().unwrap();
    assert!(expires < cap, "a shorter expiry stays");
    host.stop().await;
}

/// A schedule's firing past a tenant quota is not dropped: it waits for
/// no rate token inside its transaction, is counted as refused, backs off
/// (it does not head every pass while held), and is made at a later pass
/// once the quota allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_held_by_a_quota_fires_later_not_never() {
    use agent_host::agent::AgentRegistry;
    use agent_host::service::schedules::fire_due;
    let db = TestDb::new().await;
    let quotas = Quotas::new(QuotaConfig {
        tenant_max_queued: Some(1),
        tenant_enqueue_per_s: NonZeroU32::new(1),
        tenant_enqueue_burst: NonZeroU32::new(1),
        ..QuotaConfig::default()
    });
    let policy = Arc::new(Policy { quotas, ..Policy::default() });
    // The host's own firing loop stays out of the way (an hour a tick).
    let config = agent_host::worker::WorkerConfig {
        dispatch: false,
        schedule_tick: Duration::from_secs(3600),
        ..fast_config("w")
    };
    let p = policy.clone();
    let host = TestHost::start_with(&db, None, AgentRegistry::with_builtins(), config, |s| s.policy = p).await;
    let agents = AgentRegistry::with_builtins();
    let (code, s) = host
        .call("POST", "/v1/schedules", Some(json!({ "plugin": "echo", "content": "tick", "cron": "0 0 1 1 *" })))
        .await;
    assert_eq!(code, StatusCode::CREATED, "{s}");
    let sid = s["id"].as_str().unwrap().to_string();
    let due = || async {
        sqlx::query("UPDATE schedule SET next_fire_at = now() - interval '1 second' WHERE id = $1::uuid")
            .bind(&sid)
            .execute(&db.pool)
            .await
            .unwrap();
    };
    let runs = || async { written(&db.pool).await.0 };
    // Out of rate tokens (the burst of 1 just taken): refused at once, not waited for.
    let (code, queued) = host.call("POST", "/v1/runs", Some(json!({ "content": "first", "plugin": "echo" }))).await;
    assert_eq!(code, StatusCode::ACCEPTED);
    due().await;
    assert_eq!(fire_due(&db.pool, &agents, &policy, None).await.unwrap(), 1);
    assert_eq!(runs().await, 1, "no firing without a rate token");
    let fire_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT next_fire_at FROM schedule WHERE id = $1::uuid")
            .bind(&sid)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let backoff = chrono::Duration::from_std(agent_host::service::schedules::HELD_BACKOFF).unwrap();
    let now = chrono::Utc::now();
    assert!(fire_at > now && fire_at <= now + backoff, "a held firing backs off: {fire_at} (now {now})");
    // Then past the queue quota (one queued run): still held.
    // Tried until the rate bucket has refilled (a refusal by rate takes no
    // token) and the queue quota is what holds it.
    let queue_refused = || policy.quotas.refusals().iter().any(|(t, l, _)| t == "acme" && *l == "queued_runs");
    wait_for("a refusal by the queue quota", LONG, || async {
        due().await; // its backoff over
        assert_eq!(fire_due(&db.pool, &agents, &policy, None).await.unwrap(), 1);
        queue_refused()
    })
    .await;
    assert_eq!(runs().await, 1, "no firing past the queue quota");
    let refusals = policy.quotas.refusals();
    for limit in ["enqueue_rate", "queued_runs"] {
        assert!(refusals.iter().any(|(t, l, n)| t == "acme" && *l == limit && *n >= 1), "{limit}: {refusals:?}");
    }
    // With room, the same firing is made.
    let queued = queued["run_id"].as_str().unwrap();
    assert_eq!(host.call("POST", &format!("/v1/runs/{queued}/cancel"), None).await.0, StatusCode::ACCEPTED);
    // Tried until a rate token is there again and the firing is made.
    wait_for("the held firing to be made", LONG, || async {
        due().await; // its backoff over
        assert_eq!(fire_due(&db.pool, &agents, &policy, None).await.unwrap(), 1);
        runs().await >= 2
    })
    .await;
    let key: String =
        sqlx::query_scalar("SELECT idempotency_key FROM agent_run WHERE idempotency_key LIKE 'schedule-%'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(key.starts_with(&format!("schedule-{sid}-")), "{key}");
    assert_eq!(runs().await, 2, "the held firing made once, when the quota allowed");
    host.stop().await;
}

/// A repeated cancel of a running run re-flags it but is audited once: the
/// trail records the cancel that set the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_cancel_of_a_running_run_is_audited_once() {
    let db = TestDb::new().await;
    let host = TestHost::undispatched(&db, |_| {}).await;
    let (code, run) = host.call("POST", "/v1/runs", Some(json!({ "content": "hi", "plugin": "echo" }))).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{run}");
    let run = run["run_id"].as_str().unwrap().to_string();
    let claimed = claim_one(&db.pool, "w-test", Duration::from_secs(60)).await;
    assert_eq!(claimed.id.to_string(), run);
    for _ in 0..3 {
        let (code, body) = host.call("POST", &format!("/v1/runs/{run}/cancel"), None).await;
        assert_eq!((code, body["status"].as_str()), (StatusCode::ACCEPTED, Some("running")), "{body}");
    }
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_event WHERE action = 'run.cancelled' AND target = $1")
            .bind(&run)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(rows, 1);
    host.stop().await;
}

/// A tenant's admin neither sees nor revokes an operator's token of that
/// tenant; the operator does both. The list says whether it was truncated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_admin_cannot_touch_an_operator_token() {
    let db = TestDb::new().await;
    let host = TestHost::undispatched(&db, |_| {}).await;
    let (op_id, op) = token(&db.pool, "ops", "acme", true, true).await;
    let (_, admin) = token(&db.pool, "root", "acme", true, false).await;
    let (code, list) = host.call_as(&admin, "GET", "/v1/tokens", None).await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(list["truncated"], false);
    let ids: Vec<&str> = list["tokens"].as_array().unwrap().iter().map(|t| t["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 2, "alice's and the admin's: {ids:?}");
    assert!(!ids.contains(&op_id.to_string().as_str()), "{ids:?}");
    let revoke = format!("/v1/tokens/{op_id}/revoke");
    assert_eq!(host.call_as(&admin, "POST", &revoke, None).await.0, StatusCode::NOT_FOUND);
    // Every tenant's: alice's, the admin's, its own and the test host's operator (for /metrics).
    assert_eq!(host.call_as(&op, "GET", "/v1/tokens", None).await.1["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(host.call_as(&op, "GET", "/v1/conversations", None).await.0, StatusCode::OK, "still valid");
    assert_eq!(host.call_as(&op, "POST", &revoke, None).await.0, StatusCode::OK, "an operator revokes its own");
    host.stop().await;
}

/// Two concurrent first uploads of one name: one is the upload, the other
/// re-points it (one `plugin.uploaded` row, not two).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_uploads_of_a_name_record_one_upload() {
    let db = TestDb::new().await;
    let (_, router) = sandboxed_router(&db);
    let (_, admin) = token(&db.pool, "ann", "a", true, false).await;
    for round in 0..3 {
        let name = format!("racy{round}");
        let uploads = ["echo", "fixtures"].map(|wasm| {
            let (router, admin, name) = (router.clone(), admin.clone(), name.clone());
            async move {
                let component = plugin_wasm(wasm);
                let fields: [(&str, &[u8]); 2] = [("name", name.as_bytes()), ("component", component.as_slice())];
                let (ct, body) = multipart(&fields);
                oneshot(&router, "POST", "/v1/plugins", Some(&admin), &[], Some((&ct, body))).await.status
            }
        });
        let codes = futures::future::join_all(uploads).await;
        assert!(codes.iter().all(|c| *c == StatusCode::CREATED), "{codes:?}");
        let actions: Vec<String> =
            sqlx::query_scalar("SELECT action FROM audit_event WHERE target = $1 ORDER BY action")
                .bind(&name)
                .fetch_all(&db.pool)
                .await
                .unwrap();
        assert_eq!(actions, ["plugin.repointed", "plugin.uploaded"], "{name}");
    }
}

/// Issue 40: a tenant's admin reads its audit trail without learning an
/// operator's token id. An operator creates and revokes a token of tenant
/// `acme`: both rows are acme's, and acme's admin sees who acted but not
/// with which token; its own actions still name its token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_reading_its_audit_trail_sees_no_operator_token_id() {
    let db = TestDb::new().await;
    let host = TestHost::undispatched(&db, |_| {}).await;
    let (operator_id, operator) = token(&db.pool, "root", "ops", true, true).await;
    let (admin_id, admin) = token(&db.pool, "ada", "acme", true, false).await;
    let body = json!({ "user_id": "bob", "tenant_id": "acme" });
    let (code, created) = host.call_as(&operator, "POST", "/v1/tokens", Some(body)).await;
    assert_eq!(code, StatusCode::CREATED, "{created}");
    let bob = created["id"].as_str().unwrap().to_string();
    let (code, _) = host.call_as(&operator, "POST", &format!("/v1/tokens/{bob}/revoke"), None).await;
    assert_eq!(code, StatusCode::OK);
    let body = json!({ "user_id": "carl" });
    assert_eq!(host.call_as(&admin, "POST", "/v1/tokens", Some(body)).await.0, StatusCode::CREATED);

    let (code, trail) = host.call_as(&admin, "GET", "/v1/audit", None).await;
    assert_eq!(code, StatusCode::OK, "{trail}");
    let rows = trail["events"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "{trail}");
    for row in &rows[..2] {
        assert_eq!(row["actor_user"], "root", "{row}");
        assert_eq!(row["actor_token"], Value::Null, "an operator's token id shown to a tenant: {row}");
    }
    assert_eq!(rows[2]["actor_token"], json!(admin_id), "the tenant's own token is named");
    assert!(!trail.to_string().contains(&operator_id.to_string()), "{trail}");
    // The operator reads every row whole.
    let (_, all) = host.call_as(&operator, "GET", "/v1/audit", None).await;
    assert!(all.to_string().contains(&operator_id.to_string()), "{all}");
    host.stop().await;
}

/// Issue 40: waits count as streams do. A blocking `POST /v1/responses`
/// (neither `stream` nor `background`) holds its user's and its tenant's
/// place while it waits: with one place per user and two per tenant, a
/// second blocking request of the same user is refused (429,
/// `user_streams`), a third user of the tenant too (`tenant_streams`), while
/// another tenant's goes through; the places come back with the answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_responses_request_holds_a_stream_place_per_user_and_tenant() {
    let db = TestDb::new().await;
    let config = QuotaConfig { user_max_streams: Some(1), tenant_max_streams: Some(2), ..QuotaConfig::default() };
    let quotas = Quotas::new(config);
    let hub = connected_hub(&db).await;
    let agents = agent_host::agent::AgentRegistry::with_builtins();
    let host = TestHost::start_with(&db, Some(hub), agents, fast_config("w"), |s| {
        s.policy = Arc::new(Policy { quotas, ..Policy::default() })
    })
    .await;
    let long = json!({ "model": "sleep", "input": "wait", "config": { "steps": 1, "step_ms": 60_000 } });
    let quick = json!({ "model": "echo", "input": "hi" });
    let (_, bob) = token(&db.pool, "bob", "acme", false, false).await;
    let (_, carol) = token(&db.pool, "carol", "acme", false, false).await;
    let (_, olga) = token(&db.pool, "olga", "other", false, false).await;
    let wait_in_task = |token: String| {
        let (client, url, body) = (host.client.clone(), format!("{}/v1/responses", host.base), long.clone());
        tokio::spawn(async move { client.post(url).bearer_auth(token).json(&body).send().await.unwrap().status() })
    };
    let running = |n: i64| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM agent_run WHERE status = 'running'")
                .fetch_one(&pool)
                .await
                .unwrap()
                == n
        }
    };
    let alices = wait_in_task(host.token.clone());
    wait_for("alice's wait to start", LONG, || running(1)).await;
    let (code, body) = host.call("POST", "/v1/responses", Some(quick.clone())).await;
    assert_eq!(code, StatusCode::TOO_MANY_REQUESTS, "{body}");
    let bobs = wait_in_task(bob.clone());
    wait_for("bob's wait to start", LONG, || running(2)).await;
    let (code, body) = host.call_as(&carol, "POST", "/v1/responses", Some(quick.clone())).await;
    assert_eq!(code, StatusCode::TOO_MANY_REQUESTS, "{body}");
    let (code, body) = host.call_as(&olga, "POST", "/v1/responses", Some(quick.clone())).await;
    assert_eq!(code, StatusCode::OK, "another tenant is not held back: {body}");
    let metrics = host.scrape().await;
    assert_eq!(metrics[r#"agent_host_quota_refusals_total{tenant="acme",limit="user_streams"}"#], 1.0);
    assert_eq!(metrics[r#"agent_host_quota_refusals_total{tenant="acme",limit="tenant_streams"}"#], 1.0);
    // The waits end (their runs stopped): their places come back.
    let runs: Vec<(RunId, String)> = sqlx::query_as("SELECT id, owner_id FROM agent_run WHERE status = 'running'")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    for (run, owner) in runs {
        agent_host::db::lifecycle::cancel(&db.pool, run, &owner).await.unwrap();
    }
    assert_eq!(alices.await.unwrap(), StatusCode::OK);
    assert_eq!(bobs.await.unwrap(), StatusCode::OK);
    let (code, body) = host.call_as(&carol, "POST", "/v1/responses", Some(quick)).await;
    assert_eq!(code, StatusCode::OK, "{body}");
    host.stop().await;
}

/// The policy of the schedule tests: two schedules a tenant, an hour apart at least.
fn schedule_policy(tenant_max: u32) -> Arc<Policy> {
    let schedules =
        agent_host::service::schedules::SchedulePolicy { tenant_max, min_interval: Duration::from_secs(3600) };
    Arc::new(Policy { schedules, ..Policy::default() })
}

/// Issue 40: schedules are bounded. A cron firing more often than the host's
/// minimum interval is refused, naming it; a tenant past its cap is refused
/// (its users together), another tenant is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_are_capped_per_tenant_and_short_intervals_are_refused() {
    let db = TestDb::new().await;
    let host = TestHost::undispatched(&db, |s| s.policy = schedule_policy(2)).await;
    let every = |cron: &str| json!({ "plugin": "echo", "content": "tick", "cron": cron });
    let (code, body) = host.call("POST", "/v1/schedules", Some(every("* * * * * *"))).await;
    assert_eq!(code, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(body.to_string().contains("the shortest interval this host allows is 3600 s"), "{body}");
    let (code, body) = host.call("POST", "/v1/schedules", Some(every("*/30 * * * *"))).await;
    assert_eq!(code, StatusCode::UNPROCESSABLE_ENTITY, "every 30 minutes is too often: {body}");
    assert_eq!(host.call("POST", "/v1/schedules", Some(every("0 * * * *"))).await.0, StatusCode::CREATED);
    let (_, bob) = token(&db.pool, "bob", "acme", false, false).await;
    assert_eq!(host.call_as(&bob, "POST", "/v1/schedules", Some(every("0 9 * * *"))).await.0, StatusCode::CREATED);
    let (code, body) = host.call_as(&bob, "POST", "/v1/schedules", Some(every("0 10 * * *"))).await;
    assert_eq!(code, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(body.to_string().contains("has 2 schedules, the most this host allows (2)"), "{body}");
    let (_, olga) = token(&db.pool, "olga", "other", false, false).await;
    assert_eq!(host.call_as(&olga, "POST", "/v1/schedules", Some(every("0 10 * * *"))).await.0, StatusCode::CREATED);
    host.stop().await;
}

/// Issue 40: a tenant's admin lists, pauses, resumes and deletes any
/// schedule of its tenant (a user's own view is unchanged); another
/// tenant's admin cannot reach them, and a user cannot ask for all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_lists_pauses_and_deletes_any_schedule_of_its_tenant() {
    let db = TestDb::new().await;
    let host = TestHost::undispatched(&db, |s| s.policy = schedule_policy(10)).await;
    let body = json!({ "plugin": "echo", "content": "tick", "cron": "0 * * * *" });
    let (code, s) = host.call("POST", "/v1/schedules", Some(body)).await;
    assert_eq!(code, StatusCode::CREATED, "{s}");
    let id = s["id"].as_str().unwrap().to_string();
    let (_, admin) = token(&db.pool, "ada", "acme", true, false).await;
    let (_, stranger) = token(&db.pool, "sam", "other", true, false).await;
    let (code, own) = host.call_as(&admin, "GET", "/v1/schedules", None).await;
    assert_eq!((code, own["schedules"].as_array().unwrap().len()), (StatusCode::OK, 0), "an admin's own view");
    let (_, all) = host.call_as(&admin, "GET", "/v1/schedules?all=true", None).await;
    assert_eq!(all["schedules"][0]["id"], json!(id), "{all}");
    assert_eq!(host.call("GET", "/v1/schedules?all=true", None).await.0, StatusCode::FORBIDDEN);
    let (_, theirs) = host.call_as(&stranger, "GET", "/v1/schedules?all=true", None).await;
    assert_eq!(theirs["schedules"], json!([]));
    let pause = format!("/v1/schedules/{id}/pause");
    assert_eq!(host.call_as(&stranger, "POST", &pause, None).await.0, StatusCode::NOT_FOUND);
    let (code, one) = host.call_as(&admin, "GET", &format!("/v1/schedules/{id}"), None).await;
    assert_eq!((code, one["id"].clone()), (StatusCode::OK, json!(id)), "GET of one schedule");
    assert_eq!(host.call_as(&stranger, "GET", &format!("/v1/schedules/{id}"), None).await.0, StatusCode::NOT_FOUND);
    // A known path with another method answers the JSON error shape.
    let (code, body) = host.call("PUT", &format!("/v1/schedules/{id}"), None).await;
    assert_eq!(code, StatusCode::METHOD_NOT_ALLOWED, "{body}");
    assert_eq!(body["error"]["code"], json!("method_not_allowed"), "{body}");
    let (code, paused) = host.call_as(&admin, "POST", &pause, None).await;
    assert_eq!((code, paused["paused"].clone()), (StatusCode::OK, json!(true)));
    assert_eq!(host.call_as(&admin, "POST", &format!("/v1/schedules/{id}/resume"), None).await.0, StatusCode::OK);
    assert_eq!(host.call_as(&admin, "DELETE", &format!("/v1/schedules/{id}"), None).await.0, StatusCode::NO_CONTENT);
    assert_eq!(host.call("GET", "/v1/schedules", None).await.1["schedules"], json!([]));
    host.stop().await;
}

/// A schedule row due `ago` seconds ago, for `user` of `tenant`.
async fn due_schedule(pool: &PgPool, user: &str, tenant: &str, ago: i64) -> uuid::Uuid {
    let owner = agent_host::db::enqueue::Owner { user_id: user.into(), tenant_id: tenant.into() };
    let config = json!({});
    let new = agent_host::db::schedules::NewSchedule {
        owner: &owner,
        plugin: "echo",
        content: "tick",
        config: &config,
        conversation_id: None,
        cron: "0 * * * *",
        timezone: "UTC",
        webhook: None,
        next_fire_at: chrono::Utc::now() - chrono::Duration::seconds(ago),
    };
    agent_host::db::schedules::create(pool, &new).await.unwrap().id
}

/// Issue 40: due firings are shared fairly across tenants, and a firing a
/// quota holds backs off instead of heading every pass. A tenant with more
/// due schedules than one pass fires, every one held by its full queue,
/// cannot keep another tenant's later schedule from firing; the held ones
/// are not due again at the next pass. A schedule whose owner has no valid
/// token pauses (audited) instead of firing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn due_schedules_fire_fairly_held_ones_back_off_and_orphans_pause() {
    use agent_host::service::schedules::{fire_due, FIRE_BATCH_MAX};
    let db = TestDb::new().await;
    let pool = &db.pool;
    token(pool, "mallory", "evil", false, false).await;
    token(pool, "alice", "good", false, false).await;
    let quotas = Quotas::new(QuotaConfig { tenant_max_queued: Some(1), ..QuotaConfig::default() });
    let policy = Policy { quotas, ..Policy::default() };
    let agents = agent_host::agent::AgentRegistry::with_builtins();
    // evil's queue is full: each of its firings is held by the quota.
    let owner = agent_host::db::enqueue::Owner { user_id: "mallory".into(), tenant_id: "evil".into() };
    enqueue_as(pool, &owner, None, "echo", json!({})).await;
    for i in 0..(FIRE_BATCH_MAX + 20) {
        due_schedule(pool, "mallory", "evil", 1000 + i).await;
    }
    let good = due_schedule(pool, "alice", "good", 10).await;
    let (_, gone) = token(pool, "gone", "good", false, false).await;
    let orphan = due_schedule(pool, "gone", "good", 20).await;
    let gone_id: uuid::Uuid =
        sqlx::query_scalar("SELECT id FROM api_token WHERE user_id = 'gone'").fetch_one(pool).await.unwrap();
    sqlx::query("UPDATE api_token SET revoked_at = now() WHERE id = $1").bind(gone_id).execute(pool).await.unwrap();
    drop(gone);

    fire_due(pool, &agents, &policy, None).await.unwrap();
    let fired: Option<agent_host::db::RunId> =
        sqlx::query_scalar("SELECT last_run_id FROM schedule WHERE id = $1").bind(good).fetch_one(pool).await.unwrap();
    assert!(fired.is_some(), "good's schedule did not fire behind evil's {} held ones", FIRE_BATCH_MAX + 20);
    let paused: bool =
        sqlx::query_scalar("SELECT paused FROM schedule WHERE id = $1").bind(orphan).fetch_one(pool).await.unwrap();
    assert!(paused, "a schedule whose owner has no valid token still fires");
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_event WHERE action = 'schedule.paused' AND target = $1 AND actor_user = 'host'",
    )
    .bind(orphan.to_string())
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(audited, 1);
    // The held firings wait out their backoff: not one is due at the next pass.
    let due_now: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM schedule WHERE tenant_id = 'evil' AND NOT paused AND next_fire_at <= now()",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let held_in_first_pass = FIRE_BATCH_MAX - 2; // the pass also took good's two
    assert_eq!(due_now, FIRE_BATCH_MAX + 20 - held_in_first_pass, "held firings back off");
    fire_due(pool, &agents, &policy, None).await.unwrap();
    let still_due: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM schedule WHERE tenant_id = 'evil' AND NOT paused AND next_fire_at <= now()",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(still_due, 0, "the rest were held and backed off in the second pass");
}
