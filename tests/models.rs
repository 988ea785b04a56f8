//! Issue 46: model providers, aliases with fallback, limits shared by every
//! process, and retries, with real host processes on one database and
//! scripted providers on loopback (small axum servers speaking the
//! chat-completions streaming format, started by each test). What a test
//! asserts is counted at the providers and read from the journal.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::durable::serve;
use crate::support::process::{HostProcess, FAST};
use crate::support::*;
use agent_host::db::{plugins, tokens, RunId};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

/// What a scripted provider does with a request, given the requests it has
/// had before it (their arrival times, oldest first).
type Script = Box<dyn Fn(&[Instant]) -> Reply + Send + Sync>;

enum Reply {
    Answer(String),
    Status(u16, Vec<(&'static str, String)>),
}

/// One request as the provider saw it.
#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    model: String,
    auth: Option<String>,
    status: u16,
}

struct Provider {
    seen: Mutex<Vec<Seen>>,
    script: Script,
}

impl Provider {
    async fn start(script: Script) -> (Arc<Provider>, String) {
        let p = Arc::new(Provider { seen: Mutex::default(), script });
        let base = serve(Router::new().route("/v1/chat/completions", post(complete)).with_state(p.clone())).await;
        (p, format!("{base}/v1"))
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn statuses(&self) -> Vec<u16> {
        self.seen().iter().map(|s| s.status).collect()
    }
}

async fn complete(State(p): State<Arc<Provider>>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    let at = Instant::now();
    let (reply, status) = {
        let mut seen = p.seen.lock().unwrap();
        let before: Vec<Instant> = seen.iter().map(|s| s.at).collect();
        let reply = (p.script)(&before);
        let status = match &reply {
            Reply::Answer(_) => 200,
            Reply::Status(s, _) => *s,
        };
        seen.push(Seen {
            at,
            model: body["model"].as_str().unwrap_or_default().to_string(),
            auth: headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string),
            status,
        });
        (reply, status)
    };
    match reply {
        Reply::Answer(text) => {
            let chunk = |delta: Value, finish: Value| {
                format!("data: {}\n\n", json!({ "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] }))
            };
            let mut sse = chunk(json!({ "content": text }), Value::Null);
            sse += &chunk(json!({}), json!("stop"));
            // 5 prompt tokens (2 of them from the provider's cache) and 3 completion tokens.
            sse += "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":3,\
                    \"prompt_tokens_details\":{\"cached_tokens\":2}}}\n\n";
            sse += "data: [DONE]\n\n";
            ([("content-type", "text/event-stream")], sse).into_response()
        }
        Reply::Status(_, headers) => {
            let mut res =
                (StatusCode::from_u16(status).unwrap(), "{\"error\":{\"message\":\"scripted\"}}").into_response();
            for (k, v) in headers {
                res.headers_mut().insert(k, v.parse().unwrap());
            }
            res
        }
    }
}

/// A database with the chat plugin (granted `llm`), a user's token, and a
/// tools file for the hosts.
struct Setup {
    db: TestDb,
    token: String,
    tools_file: PathBuf,
    dir: PathBuf,
}

impl Setup {
    async fn new(tools: &str) -> Setup {
        Setup::with_manifest(tools, json!({ "tools": ["llm"] })).await
    }

    /// With the chat plugin under `manifest` (and the echo plugin beside it).
    async fn with_manifest(tools: &str, manifest: Value) -> Setup {
        let db = TestDb::new().await;
        plugins::put(&db.pool, "chat", &plugin_wasm("chat"), &manifest).await.unwrap();
        plugins::put(&db.pool, "echo", &plugin_wasm("echo"), &json!({})).await.unwrap();
        let token = tokens::create(&db.pool, "alice", "acme", false).await.unwrap();
        let dir = std::env::temp_dir().join(format!("agent-host-models-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let tools_file = dir.join("tools.toml");
        std::fs::write(&tools_file, tools).unwrap();
        Setup { db, token, tools_file, dir }
    }

    fn spawn(&self, worker: &str, extra: &[&str], env: &[(&str, &str)]) -> HostProcess {
        let tools = self.tools_file.display().to_string();
        let cache = self.dir.join("cache").display().to_string();
        let mut args: Vec<&str> = FAST.to_vec();
        args.extend(["--tools-file", &tools, "--cache-dir", &cache]);
        args.extend(extra);
        HostProcess::spawn_with_env(&self.db.url, worker, &args, env)
    }

    async fn post(&self, host: &HostProcess, content: &str) -> RunId {
        self.post_to(host, "chat", content).await
    }

    async fn post_to(&self, host: &HostProcess, plugin: &str, content: &str) -> RunId {
        let res = reqwest::Client::new()
            .post(format!("http://{}/v1/runs", host.addr))
            .bearer_auth(&self.token)
            .json(&json!({ "plugin": plugin, "content": content }))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 202);
        let answer: Value = res.json().await.unwrap();
        answer["run_id"].as_str().unwrap().parse().unwrap()
    }

    /// `GET /v1/runs/{run}`, as its owner.
    async fn view(&self, host: &HostProcess, run: RunId) -> Value {
        let url = format!("http://{}/v1/runs/{run}", host.addr);
        reqwest::Client::new().get(url).bearer_auth(&self.token).send().await.unwrap().json().await.unwrap()
    }

    async fn assistant(&self, run: RunId) -> String {
        sqlx::query_scalar("SELECT content FROM message WHERE run_id = $1 AND role = 'assistant'")
            .bind(run)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// The payloads of the run's events of `kind`, in order.
    async fn events(&self, run: RunId, kind: &str) -> Vec<Value> {
        journal_payloads(&self.db.pool, run).await.into_iter().filter(|(_, k, _)| k == kind).map(|e| e.2).collect()
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One figure of a host's `/metrics`.
async fn metric(host: &HostProcess, name: &str) -> f64 {
    let text = reqwest::get(format!("http://{}/metrics", host.addr)).await.unwrap().text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alias_falls_back_to_its_next_provider_and_the_journal_names_both_attempts() {
    let (down, down_url) = Provider::start(Box::new(|_: &[Instant]| Reply::Status(503, vec![]))).await;
    let (up, up_url) = Provider::start(Box::new(|_: &[Instant]| Reply::Answer("From the backup.".into()))).await;
    let tools = format!(
        r#"
[[provider]]
name = "primary"
base_url = "{down_url}"
api_key = "${{env:PRIMARY_MODEL_KEY}}"

[[provider]]
name = "backup"
base_url = "{up_url}"

[[model]]
name = "smart"
targets = ["primary/big-model", "backup/small-model"]
"#
    );
    let setup = Setup::new(&tools).await;
    let host = setup.spawn("A", &["--llm-model", "smart"], &[("PRIMARY_MODEL_KEY", "sk-primary-123456")]);
    let run = setup.post(&host, "hello").await;
    assert_eq!(wait_terminal(&setup.db.pool, run, LONG).await, "completed");
    assert_eq!(setup.assistant(run).await, "From the backup.");

    let attempts = setup.events(run, "model_attempt").await;
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(attempts[0]["attempt"], 1);
    assert_eq!(attempts[0]["provider"], "primary");
    assert_eq!(attempts[0]["model"], "big-model");
    assert_eq!(attempts[0]["outcome"], "fallback");
    assert_eq!(attempts[0]["status"], 503);
    assert!(attempts[0]["error"].as_str().unwrap().starts_with("model endpoint answered 503"), "{attempts:?}");
    assert_eq!(attempts[1]["attempt"], 2);
    assert_eq!(attempts[1]["provider"], "backup");
    assert_eq!(attempts[1]["model"], "small-model");
    assert_eq!(attempts[1]["outcome"], "ok");
    assert_eq!(attempts[1]["status"], 200);
    // Counted at the providers: one request each, each with its model and key.
    let (down, up) = (down.seen(), up.seen());
    assert_eq!(down.len(), 1, "{down:?}");
    assert_eq!(down[0].model, "big-model");
    assert_eq!(down[0].auth.as_deref(), Some("Bearer sk-primary-123456"));
    assert_eq!(up.len(), 1, "{up:?}");
    assert_eq!(up[0].model, "small-model");
    assert_eq!(up[0].auth, None);
    // The call's finish names its usage; the key is nowhere in the journal.
    let journal = journal_payloads(&setup.db.pool, run).await;
    assert!(!format!("{journal:?}").contains("sk-primary-123456"));
    assert_eq!(metric(&host, "agent_host_model_attempts_total{provider=\"primary\",outcome=\"fallback\"}").await, 1.0);
    assert_eq!(metric(&host, "agent_host_model_attempts_total{provider=\"backup\",outcome=\"ok\"}").await, 1.0);
}

/// The most requests any window of `window` holds.
fn busiest(arrivals: &[Instant], window: Duration) -> usize {
    (0..arrivals.len())
        .map(|i| arrivals[i..].iter().take_while(|a| **a - arrivals[i] < window).count())
        .max()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_share_one_requests_per_minute_limit_and_never_meet_the_providers_429() {
    // The provider refuses past N requests in any window W - SLACK; the
    // hosts' shared limit is N per W (a "minute" of W, as `minute_ms`
    // allows for tests). The slack is for the time between the database's
    // grant and the request's arrival (the provider's clock): the hosts
    // admit N per W by the database's clock.
    const N: usize = 10;
    const W: Duration = Duration::from_millis(3000);
    const SLACK: Duration = Duration::from_millis(1000);
    const RUNS: usize = 30;
    let script: Script = Box::new(|before: &[Instant]| {
        let now = Instant::now();
        let recent = before.iter().filter(|a| now.duration_since(**a) < W - SLACK).count();
        match recent >= N {
            true => Reply::Status(429, vec![]),
            false => Reply::Answer("Within the limit.".into()),
        }
    });
    let (provider, url) = Provider::start(script).await;
    let tools = format!(
        r#"
[[provider]]
name = "limited"
base_url = "{url}"

[[limit]]
provider = "limited"
requests_per_minute = {N}
minute_ms = {}
"#,
        W.as_millis()
    );
    let setup = Setup::new(&tools).await;
    let hosts: Vec<HostProcess> = ["A", "B", "C"]
        .iter()
        .map(|w| setup.spawn(w, &["--llm-model", "some-model", "--max-runs", "10"], &[]))
        .collect();
    let started = Instant::now();
    let posts = (0..RUNS).map(|i| setup.post(&hosts[i % 3], "hello"));
    let runs: Vec<RunId> = futures::future::join_all(posts).await;
    for run in &runs {
        assert_eq!(wait_terminal(&setup.db.pool, *run, 2 * LONG).await, "completed", "{run}");
        assert_eq!(setup.assistant(*run).await, "Within the limit.");
    }
    eprintln!("{RUNS} runs through a limit of {N} per {W:?} on 3 processes: {:?}", started.elapsed());

    let seen = provider.seen();
    assert_eq!(seen.len(), RUNS, "one request per run, none refused and retried: {:?}", provider.statuses());
    assert!(provider.statuses().iter().all(|s| *s == 200), "{:?}", provider.statuses());
    let arrivals: Vec<Instant> = seen.iter().map(|s| s.at).collect();
    assert!(busiest(&arrivals, W - SLACK) <= N);
    // The rate, counted at the provider: 30 requests at 10 per 3 s span
    // at least two whole windows (less the slack).
    let span = *arrivals.last().unwrap() - arrivals[0];
    assert!(span >= 2 * W - SLACK, "30 requests in {span:?}");
    // Every run past the first N waited, journaled on its stream and counted.
    let mut waited = 0;
    for run in &runs {
        let waits = setup.events(*run, "model_wait").await;
        assert!(waits.len() <= 1, "{waits:?}");
        if let Some(w) = waits.first() {
            assert_eq!(w["provider"], "limited");
            assert_eq!(w["limit"], "limited");
            assert!(["requests_per_minute", "queue"].contains(&w["reason"].as_str().unwrap()), "{w}");
            waited += 1;
        }
        let attempts = setup.events(*run, "model_attempt").await;
        assert_eq!(attempts.len(), 1, "{attempts:?}");
        assert_eq!(attempts[0]["outcome"], "ok");
    }
    assert!(waited >= RUNS - N, "{waited} runs waited");
    let mut counted = 0.0;
    for host in &hosts {
        counted += metric(host, "agent_host_model_limit_waits_total").await;
    }
    assert_eq!(counted, waited as f64);
    // Every lease ended; nothing is left waiting.
    let (waiting, open): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE granted_at IS NULL), count(*) FILTER (WHERE ended_at IS NULL) FROM model_lease",
    )
    .fetch_one(&setup.db.pool)
    .await
    .unwrap();
    assert_eq!((waiting, open), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_pauses_the_shared_limit_for_every_process() {
    const PAUSE: Duration = Duration::from_secs(2);
    // The first request is refused with Retry-After: 2; the rest answer.
    let script: Script = Box::new(|before: &[Instant]| match before.len() {
        0 => Reply::Status(429, vec![("retry-after", "2".into())]),
        _ => Reply::Answer("After the pause.".into()),
    });
    let (provider, url) = Provider::start(script).await;
    let tools = format!(
        r#"
[[provider]]
name = "busy"
base_url = "{url}"

[[limit]]
provider = "busy"
concurrent = 50
"#
    );
    let setup = Setup::new(&tools).await;
    let a = setup.spawn("A", &["--llm-model", "m"], &[]);
    let b = setup.spawn("B", &["--llm-model", "m"], &[]);
    let first = setup.post(&a, "first").await;
    let pool = setup.db.pool.clone();
    wait_for("the pause to be shared", LONG, || {
        let pool = pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM model_limit_pause WHERE paused_until > now()")
                .fetch_one(&pool)
                .await
                .unwrap();
            n == 1
        }
    })
    .await;
    let others = vec![setup.post(&a, "second").await, setup.post(&b, "third").await, setup.post(&b, "fourth").await];
    for run in others.iter().chain([&first]) {
        assert_eq!(wait_terminal(&setup.db.pool, *run, LONG).await, "completed");
        assert_eq!(setup.assistant(*run).await, "After the pause.");
    }
    let seen = provider.seen();
    assert_eq!(provider.statuses(), [429, 200, 200, 200, 200]);
    // Nobody asked during the pause: every later request came after it.
    for s in &seen[1..] {
        assert!(s.at.duration_since(seen[0].at) >= PAUSE, "{:?} after the 429", s.at.duration_since(seen[0].at));
    }
    // The first run's attempts: the 429 (to retry), then the answer.
    let attempts = setup.events(first, "model_attempt").await;
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(attempts[0]["outcome"], "retry");
    assert_eq!(attempts[0]["status"], 429);
    assert_eq!(attempts[0]["retry_after_ms"], 2000);
    assert_eq!(attempts[1]["outcome"], "ok");
    // The others waited for the pause, on their streams.
    for run in &others {
        let waits = setup.events(*run, "model_wait").await;
        assert_eq!(waits.len(), 1, "{run}: {waits:?}");
        assert_eq!(waits[0]["reason"], "paused");
        assert_eq!(waits[0]["limit"], "busy");
    }
    // Counted: one pause (by whichever process ran the first run), and four
    // waits (the three others, and the first run's own retry).
    let (pauses, waits) = ("agent_host_model_limit_pauses_total", "agent_host_model_limit_waits_total");
    assert_eq!(metric(&a, pauses).await + metric(&b, pauses).await, 1.0);
    assert_eq!(metric(&a, waits).await + metric(&b, waits).await, 4.0);
    let first_waits = setup.events(first, "model_wait").await;
    assert_eq!(first_waits.len(), 1, "{first_waits:?}");
    assert_eq!(first_waits[0]["reason"], "paused");
}

/// The guide's tools-file example (docs/src/guides/models.md) is one the
/// host takes: it parses, and a registry is built from it.
#[test]
fn the_guides_tools_file_example_loads() {
    let guide = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src/guides/models.md");
    let text = std::fs::read_to_string(guide).unwrap();
    let start = text.find("```toml\n").expect("a toml example") + "```toml\n".len();
    let example = &text[start..start + text[start..].find("```").unwrap()];
    let env = |name: &str| Some(format!("{}-value-0123456789", name.to_ascii_lowercase()));
    let file = agent_host::tools::parse_tools_file_with(example, &env).unwrap();
    assert_eq!(file.models.providers.len(), 3);
    let protocols: Vec<_> = file.models.providers.iter().map(|p| p.protocol).collect();
    assert!(protocols.contains(&agent_host::tools::models::Protocol::Responses), "{protocols:?}");
    assert!(file.models.limits.iter().any(|l| l.suspend_after_ms == 10_000));
    assert!(!file.models.aliases.is_empty() && !file.models.limits.is_empty());
    let llm = agent_host::tools::LlmConfig { model: "fast".into(), ..Default::default() };
    let registry = agent_host::tools::ToolRegistry::from_tools(&llm, &file).unwrap();
    assert!(registry.names().contains(&"llm".to_string()));
    // The keys from the environment are secrets.
    assert_eq!(file.secrets.redact("key openai_api_key-value-0123456789"), "key <redacted>");
}

/// Fairness across tenants: waiting calls are granted in arrival order,
/// whoever sent them, so a tenant with many calls queued cannot pass one
/// that came before them; and every process's poll grants for everyone.
#[tokio::test]
async fn waiting_calls_are_granted_in_arrival_order_whatever_their_tenant() {
    use agent_host::db::model_limits::{self, Bounds, Poll};
    let db = TestDb::new().await;
    let b = Bounds { minute_ms: 60_000, requests: None, tokens: None, concurrent: Some(2) };
    let run = RunId::new();
    let tenants = ["greedy", "greedy", "greedy", "small", "greedy", "greedy"];
    let mut ids = Vec::new();
    for t in tenants {
        let id = uuid::Uuid::now_v7();
        model_limits::arrive(&db.pool, id, "p", run, Some(t), 0, 10_000).await.unwrap();
        ids.push(id);
    }
    let poll = |id| model_limits::poll(&db.pool, id, "p", "p", b, 60_000, 10_000);
    // The last to arrive polls first: its poll grants the first two.
    assert!(matches!(poll(ids[5]).await.unwrap(), Poll::Waiting { position: 4, reason: "concurrent", .. }));
    assert_eq!(poll(ids[0]).await.unwrap(), Poll::Granted);
    assert_eq!(poll(ids[1]).await.unwrap(), Poll::Granted);
    assert!(matches!(poll(ids[3]).await.unwrap(), Poll::Waiting { position: 2, .. }));
    // One call ends: the next in line (greedy's third), not the small one.
    model_limits::end(&db.pool, ids[0], Some(7)).await.unwrap();
    assert!(matches!(poll(ids[3]).await.unwrap(), Poll::Waiting { position: 1, .. }));
    assert_eq!(poll(ids[2]).await.unwrap(), Poll::Granted);
    model_limits::end(&db.pool, ids[1], None).await.unwrap();
    assert_eq!(poll(ids[3]).await.unwrap(), Poll::Granted, "the small tenant's call before greedy's later ones");
    assert!(matches!(poll(ids[4]).await.unwrap(), Poll::Waiting { position: 1, .. }));
    // A pause holds every grant until it ends.
    model_limits::end(&db.pool, ids[2], None).await.unwrap();
    model_limits::pause(&db.pool, "p", 60_000).await.unwrap();
    assert!(
        matches!(poll(ids[4]).await.unwrap(), Poll::Waiting { reason: "paused", wait_ms: Some(ms), .. } if ms > 50_000.0)
    );
    // A waiter that gives up leaves the queue.
    model_limits::end(&db.pool, ids[4], None).await.unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM model_lease WHERE granted_at IS NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 1, "only the last call still waits");
}

/// Tokens per minute count a call's estimate when it is granted and the
/// provider's reported usage once it ends; requests per minute say when
/// the minute frees the request a waiter needs.
#[tokio::test]
async fn tokens_count_their_estimate_then_the_usage_and_a_full_minute_says_when_it_frees() {
    use agent_host::db::model_limits::{self, Bounds, Poll};
    let db = TestDb::new().await;
    let run = RunId::new();
    let tokens = Bounds { minute_ms: 60_000, requests: None, tokens: Some(1000), concurrent: None };
    let [a, b, c] = [600, 600, 5000].map(|_| uuid::Uuid::now_v7());
    for (id, estimate) in [(a, 600), (b, 600), (c, 5000)] {
        model_limits::arrive(&db.pool, id, "t", run, None, estimate, 10_000).await.unwrap();
    }
    let poll = |id| model_limits::poll(&db.pool, id, "t", "t", tokens, 60_000, 10_000);
    assert_eq!(poll(a).await.unwrap(), Poll::Granted);
    assert!(matches!(poll(b).await.unwrap(), Poll::Waiting { reason: "tokens_per_minute", position: 1, .. }));
    // The provider said the call used 100 tokens, not 600: room for the next.
    model_limits::end(&db.pool, a, Some(100)).await.unwrap();
    assert_eq!(poll(b).await.unwrap(), Poll::Granted);
    // A call larger than the whole budget waits for an empty minute.
    assert!(matches!(poll(c).await.unwrap(), Poll::Waiting { reason: "tokens_per_minute", .. }));

    let requests = Bounds { minute_ms: 2000, requests: Some(2), tokens: None, concurrent: None };
    let [x, y, z] = [0, 1, 2].map(|_| uuid::Uuid::now_v7());
    for id in [x, y, z] {
        model_limits::arrive(&db.pool, id, "r", run, None, 0, 10_000).await.unwrap();
    }
    let poll = |id| model_limits::poll(&db.pool, id, "r", "r", requests, 60_000, 10_000);
    assert_eq!(poll(x).await.unwrap(), Poll::Granted);
    assert_eq!(poll(y).await.unwrap(), Poll::Granted, "granted by x's poll");
    match poll(z).await.unwrap() {
        Poll::Waiting { reason: "requests_per_minute", position: 1, wait_ms: Some(ms) } => {
            assert!(ms > 1000.0 && ms <= 2000.0, "the oldest request leaves the minute in {ms} ms")
        }
        other => panic!("{other:?}"),
    }
}

/// A tenant's daily token budget (a first slice of item 4): usage is
/// recorded per tenant and day from the provider's reports; the call that
/// would pass the budget is refused with a named reason and counted; another
/// tenant's runs are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_would_pass_its_tenants_token_budget_is_refused_and_others_are_not() {
    // Every answer reports 5 + 3 tokens.
    let (provider, url) = Provider::start(Box::new(|_: &[Instant]| Reply::Answer("Counted.".into()))).await;
    let tools = format!(
        "[[provider]]\nname = \"p\"\nbase_url = \"{url}\"\n\n[[budget]]\ntenant = \"acme\"\ntokens_per_day = 8\n\n\
         [[price]]\nprovider = \"p\"\nmodel = \"m\"\nprompt = 2.0\ncompletion = 8.0\ncached_prompt = 0.5\n"
    );
    // The price table's arithmetic for one call: 3 fresh and 2 cached prompt
    // tokens, 3 completion tokens, in USD per million.
    let cost = (3.0 * 2.0 + 2.0 * 0.5 + 3.0 * 8.0) / 1e6;
    let close = |v: &Value, want: f64| (v.as_f64().unwrap_or(f64::NAN) - want).abs() < 1e-12;
    let setup = Setup::new(&tools).await;
    let host = setup.spawn("A", &["--llm-model", "m"], &[]);
    let first = setup.post(&host, "hello").await;
    assert_eq!(wait_terminal(&setup.db.pool, first, LONG).await, "completed");
    // The run's API answer sums its calls' usage and cost.
    let run = setup.view(&host, first).await;
    let usage = &run["usage"];
    assert_eq!(
        (&usage["model_calls"], &usage["prompt_tokens"], &usage["completion_tokens"], &usage["cached_tokens"]),
        (&json!(1), &json!(5), &json!(3), &json!(2)),
        "{run}"
    );
    assert!(close(&usage["cost_usd"], cost), "{run}");
    let second = setup.post(&host, "hello").await;
    assert_eq!(wait_terminal(&setup.db.pool, second, LONG).await, "failed");
    let error: String = sqlx::query_scalar("SELECT error FROM agent_run WHERE id = $1")
        .bind(second)
        .fetch_one(&setup.db.pool)
        .await
        .unwrap();
    assert!(error.contains("budget: tenant \"acme\" has used 8 of its 8 model tokens today"), "{error}");
    // Another tenant's run is unaffected.
    let other = tokens::create(&setup.db.pool, "bob", "other", false).await.unwrap();
    let res = reqwest::Client::new()
        .post(format!("http://{}/v1/runs", host.addr))
        .bearer_auth(&other)
        .json(&json!({ "plugin": "chat", "content": "hello" }))
        .send()
        .await
        .unwrap();
    let third: RunId = res.json::<Value>().await.unwrap()["run_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(wait_terminal(&setup.db.pool, third, LONG).await, "completed");
    assert_eq!(provider.seen().len(), 2, "the refused call never reached the provider");
    let usage: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT tenant_id, calls, prompt_tokens, completion_tokens FROM model_usage_day ORDER BY tenant_id",
    )
    .fetch_all(&setup.db.pool)
    .await
    .unwrap();
    assert_eq!(usage, [("acme".to_string(), 1, 5, 3), ("other".to_string(), 1, 5, 3)]);
    assert_eq!(metric(&host, "agent_host_model_budget_refusals_total").await, 1.0);
    // The usage API: an admin sees its tenant's day, a user is refused.
    let admin = tokens::create(&setup.db.pool, "acme-admin", "acme", true).await.unwrap();
    let get = |token: String| {
        let url = format!("http://{}/v1/usage?days=2", host.addr);
        async move { reqwest::Client::new().get(url).bearer_auth(token).send().await.unwrap() }
    };
    let res = get(admin).await;
    assert_eq!(res.status(), 200);
    let answer: Value = res.json().await.unwrap();
    let rows = answer["usage"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{answer}");
    assert_eq!(rows[0]["tenant_id"], "acme");
    assert_eq!(rows[0]["provider"], "p");
    assert_eq!(rows[0]["model"], "m");
    assert_eq!(
        (&rows[0]["calls"], &rows[0]["prompt_tokens"], &rows[0]["completion_tokens"]),
        (&json!(1), &json!(5), &json!(3))
    );
    assert_eq!(rows[0]["cached_tokens"], 2);
    assert!(close(&rows[0]["cost_usd"], cost), "{answer}");
    // On /metrics: both tenants' calls, by provider and model.
    let labels = "{provider=\"p\",model=\"m\"";
    assert_eq!(metric(&host, &format!("agent_host_model_tokens_total{labels},kind=\"cached_prompt\"}}")).await, 4.0);
    assert_eq!(metric(&host, &format!("agent_host_model_tokens_total{labels},kind=\"prompt\"}}")).await, 10.0);
    let total = metric(&host, &format!("agent_host_model_cost_usd_total{labels}}}")).await;
    assert!((total - 2.0 * cost).abs() < 1e-12, "{total}");
    assert_eq!(get(setup.token.clone()).await.status(), 403);
}

/// A tenant's cost budget: the call that would pass it is refused with the
/// budget named, counted and audited for the operator; another tenant's run
/// completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_would_pass_its_tenants_cost_budget_is_refused_audited_and_others_are_not() {
    // Every answer reports 5 prompt tokens (2 cached) and 3 completion tokens:
    // (3 × 1 + 2 × 0.5 + 3 × 20) / 1e6 = 0.000064 USD a call, the whole day's budget.
    let (provider, url) = Provider::start(Box::new(|_: &[Instant]| Reply::Answer("Priced.".into()))).await;
    let tools = format!(
        "[[provider]]\nname = \"p\"\nbase_url = \"{url}\"\n\n\
         [[price]]\nprovider = \"p\"\nmodel = \"m\"\nprompt = 1.0\ncompletion = 20.0\ncached_prompt = 0.5\n\n\
         [[budget]]\ntenant = \"acme\"\ncost_per_day = 0.000064\ntokens_per_month = 1000000\n"
    );
    let setup = Setup::new(&tools).await;
    let host = setup.spawn("A", &["--llm-model", "m"], &[]);
    let first = setup.post(&host, "hello").await;
    assert_eq!(wait_terminal(&setup.db.pool, first, LONG).await, "completed");
    let second = setup.post(&host, "hello").await;
    assert_eq!(wait_terminal(&setup.db.pool, second, LONG).await, "failed");
    let error: String = sqlx::query_scalar("SELECT error FROM agent_run WHERE id = $1")
        .bind(second)
        .fetch_one(&setup.db.pool)
        .await
        .unwrap();
    assert!(
        error.contains("budget: tenant \"acme\" has used 0.000064 of its 0.000064 USD today (UTC, cost_per_day)"),
        "{error}"
    );
    // The operator is told: the metric and an audit row naming the run and the budget.
    assert_eq!(metric(&host, "agent_host_model_budget_refusals_total").await, 1.0);
    let (tenant, target, detail): (Option<String>, String, Value) =
        sqlx::query_as("SELECT tenant_id, target, detail FROM audit_event WHERE action = 'model.budget_refused'")
            .fetch_one(&setup.db.pool)
            .await
            .unwrap();
    assert_eq!((tenant.as_deref(), target), (Some("acme"), second.to_string()));
    assert_eq!(detail["budget"], "cost_per_day");
    assert_eq!(detail["limit"], 0.000064);
    // Another tenant's run is unaffected.
    let other = tokens::create(&setup.db.pool, "bob", "other", false).await.unwrap();
    let res = reqwest::Client::new()
        .post(format!("http://{}/v1/runs", host.addr))
        .bearer_auth(&other)
        .json(&json!({ "plugin": "chat", "content": "hello" }))
        .send()
        .await
        .unwrap();
    let third: RunId = res.json::<Value>().await.unwrap()["run_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(wait_terminal(&setup.db.pool, third, LONG).await, "completed");
    assert_eq!(provider.seen().len(), 2, "the refused call never reached the provider");
}

/// tests/py/responses_provider.py on loopback: a provider speaking OpenAI's
/// Responses API whose events are the `openai` SDK's own pydantic types and
/// which checks every request against the SDK's
/// `ResponseCreateParamsStreaming` (400 when it does not conform). Killed
/// when dropped.
struct ResponsesProvider {
    child: std::process::Child,
    url: String,
    log: PathBuf,
}

impl ResponsesProvider {
    async fn start() -> ResponsesProvider {
        use std::io::BufRead;
        let venv = std::env::var("AGENT_HOST_TEST_VENV")
            .expect("AGENT_HOST_TEST_VENV is not set: run scripts/test, which installs tests/py/requirements.txt");
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("tests/py/responses_provider.py");
        let log = std::env::temp_dir().join(format!("agent-host-responses-{}.jsonl", uuid::Uuid::new_v4().simple()));
        let mut child = std::process::Command::new(PathBuf::from(venv).join("bin/python"))
            .arg(&script)
            .arg(&log)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("starting tests/py/responses_provider.py");
        let stdout = child.stdout.take().unwrap();
        // Its first line names its port (it binds before it prints).
        let line = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            std::io::BufReader::new(stdout).read_line(&mut line).map(|_| line)
        })
        .await
        .unwrap()
        .unwrap();
        let port = line.trim().strip_prefix("PORT ").unwrap_or_else(|| panic!("no port from the provider: {line:?}"));
        ResponsesProvider { child, url: format!("http://127.0.0.1:{port}/v1"), log }
    }

    /// The requests' bodies, in order.
    fn requests(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    }
}

impl Drop for ResponsesProvider {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Issue 46, item 1: a provider with `protocol = "responses"`. The chat
/// plugin offers the model a tool; the provider calls it; the tool's answer
/// (a refusal here: it is not granted) goes back as a `function_call_output`
/// with the call's id, and the second reply streams text that quotes it.
/// Both requests conform to the SDK's types (the provider refuses others),
/// the text reached the journal as deltas, and the usage (with cached
/// tokens) and its cost are the run's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_api_provider_streams_text_and_a_tool_call_goes_round() {
    let provider = ResponsesProvider::start().await;
    let tools = format!(
        r#"
[[provider]]
name = "oai"
base_url = "{}"
protocol = "responses"

[[price]]
provider = "oai"
model = "gpt-r"
prompt = 1.0
completion = 2.0
cached_prompt = 0.5
"#,
        provider.url
    );
    let setup = Setup::new(&tools).await;
    let host = setup.spawn("A", &["--llm-model", "oai/gpt-r"], &[]);
    let weather = json!({ "name": "weather", "description": "The weather in a city.",
        "parameters": { "type": "object", "properties": { "city": { "type": "string" } } } });
    let res = reqwest::Client::new()
        .post(format!("http://{}/v1/runs", host.addr))
        .bearer_auth(&setup.token)
        .json(&json!({ "plugin": "chat", "content": "Weather in Oslo?",
                       "config": { "system": "Be brief.", "tools": [weather] } }))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 202);
    let run: RunId = res.json::<Value>().await.unwrap()["run_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(wait_terminal(&setup.db.pool, run, LONG).await, "completed");

    let answer = setup.assistant(run).await;
    assert!(answer.starts_with("The tool said: error: "), "{answer}");
    assert!(answer.contains("weather"), "{answer}");
    let requests = provider.requests();
    assert_eq!(requests.len(), 2, "{requests:?}");
    let first = &requests[0];
    assert_eq!(first["model"], "gpt-r");
    assert_eq!(first["stream"], true);
    assert_eq!(
        first["input"],
        json!([{ "role": "system", "content": "Be brief." },
                                      { "role": "user", "content": "Weather in Oslo?" }])
    );
    assert_eq!(first["tools"][0]["name"], "weather");
    let second = second_input(&requests[1]);
    assert_eq!(second.len(), 4, "{second:?}");
    assert_eq!(second[2]["type"], "function_call");
    assert_eq!(second[2]["call_id"], "call_1");
    assert_eq!(second[2]["arguments"], "{\"city\": \"Oslo\"}");
    assert_eq!(second[3]["type"], "function_call_output");
    assert_eq!(second[3]["call_id"], "call_1");
    assert_eq!(format!("The tool said: {}", second[3]["output"].as_str().unwrap()), answer);

    // Streamed: the reply reached the journal as deltas, and they add up.
    assert_eq!(deltas_text(&journal_payloads(&setup.db.pool, run).await), answer);
    let attempts = setup.events(run, "model_attempt").await;
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert!(attempts.iter().all(|a| a["provider"] == "oai" && a["outcome"] == "ok"), "{attempts:?}");
    // Two calls of 11 prompt tokens (3 cached) and 7 completion tokens:
    // (8 × 1.0 + 3 × 0.5 + 7 × 2.0) / 1e6 USD each.
    let view = setup.view(&host, run).await;
    let usage = &view["usage"];
    assert_eq!(usage["model_calls"], 2, "{view}");
    assert_eq!(usage["prompt_tokens"], 22, "{view}");
    assert_eq!(usage["completion_tokens"], 14, "{view}");
    assert_eq!(usage["cached_tokens"], 6, "{view}");
    assert!((usage["cost_usd"].as_f64().unwrap() - 47e-6).abs() < 1e-12, "{view}");
}

fn second_input(request: &Value) -> Vec<Value> {
    request["input"].as_array().cloned().unwrap_or_default()
}

/// Issue 46, item 2: a wait for a shared limit longer than the limit's
/// `suspend_after_ms` suspends a resumable run as an approval does: it
/// gives up its slot (a one-slot host runs another run meanwhile), its
/// stream says what it waits for, the time wakes it, and its resumed
/// attempt makes the call again, once the limit frees; the provider sees
/// the two calls a "minute" apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_wait_for_a_shared_limit_suspends_the_run_and_frees_its_slot() {
    // Long enough that the echo run ends well inside it on a loaded machine.
    const W: Duration = Duration::from_millis(8000);
    let (provider, url) = Provider::start(Box::new(|_: &[Instant]| Reply::Answer("Within the limit.".into()))).await;
    let tools = format!(
        r#"
[[provider]]
name = "limited"
base_url = "{url}"

[[limit]]
provider = "limited"
requests_per_minute = 1
minute_ms = {}
suspend_after_ms = 500
"#,
        W.as_millis()
    );
    let setup = Setup::with_manifest(&tools, json!({ "tools": ["llm"], "durability": "resume" })).await;
    let host = setup.spawn("A", &["--llm-model", "some-model", "--max-runs", "1"], &[]);
    let first = setup.post(&host, "one").await;
    assert_eq!(wait_terminal(&setup.db.pool, first, LONG).await, "completed");
    // The minute's one request is spent: the next call would wait about W.
    let second = setup.post(&host, "two").await;
    wait_status(&setup.db.pool, second, "waiting", LONG).await;
    let (kind, args): (String, Value) = sqlx::query_as("SELECT kind, args FROM run_suspension WHERE run_id = $1")
        .bind(second)
        .fetch_one(&setup.db.pool)
        .await
        .unwrap();
    assert_eq!(kind, "limit");
    assert_eq!(args["limit"], "limited");
    // Its slot is free: the host's one slot runs another run meanwhile.
    let other = setup.post_to(&host, "echo", "meanwhile").await;
    assert_eq!(wait_terminal(&setup.db.pool, other, LONG).await, "completed");
    let still: String = sqlx::query_scalar("SELECT status FROM agent_run WHERE id = $1")
        .bind(second)
        .fetch_one(&setup.db.pool)
        .await
        .unwrap();
    assert_eq!(still, "waiting", "the limit has not freed yet");

    assert_eq!(wait_terminal(&setup.db.pool, second, LONG).await, "completed");
    assert_eq!(setup.assistant(second).await, "Within the limit.");
    let seen = provider.seen();
    assert_eq!(seen.len(), 2, "one request each: {seen:?}");
    assert!(seen[1].at.duration_since(seen[0].at) >= W - Duration::from_millis(300), "{seen:?}");
    // The stream said what the run waited for, and that it resumed.
    let kinds: Vec<String> = journal_payloads(&setup.db.pool, second).await.into_iter().map(|e| e.1).collect();
    for k in ["model_wait", "wait_started", "wait_elapsed", "run_resumed", "complete"] {
        assert!(kinds.iter().any(|x| x == k), "{k} missing: {kinds:?}");
    }
    let started = setup.events(second, "wait_started").await;
    assert_eq!(started[0]["for"], "model_limit", "{started:?}");
    assert_eq!(metric(&host, "agent_host_model_limit_suspensions_total").await, 1.0);
}

/// Issue 46, item 4: usage summed per user (`GET /v1/usage?by=user`, an
/// admin's) and per conversation (`usage` on `GET /v1/conversations/{id}`),
/// beside the tenant's day that budgets read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_summed_per_user_and_per_conversation() {
    // Every answer reports 5 prompt tokens (2 cached) and 3 completion tokens.
    let (_provider, url) = Provider::start(Box::new(|_: &[Instant]| Reply::Answer("Counted.".into()))).await;
    let tools = format!("[[provider]]\nname = \"p\"\nbase_url = \"{url}\"\n");
    let setup = Setup::new(&tools).await;
    let host = setup.spawn("A", &["--llm-model", "m"], &[]);
    let client = reqwest::Client::new();
    let post = |token: String, body: Value| {
        let url = format!("http://{}/v1/runs", host.addr);
        let client = client.clone();
        async move {
            let res = client.post(url).bearer_auth(token).json(&body).send().await.unwrap();
            assert_eq!(res.status(), 202);
            res.json::<Value>().await.unwrap()
        }
    };
    // Alice: two turns of one conversation; Carol (same tenant): one.
    let first = post(setup.token.clone(), json!({ "plugin": "chat", "content": "one" })).await;
    let run: RunId = first["run_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(wait_terminal(&setup.db.pool, run, LONG).await, "completed");
    let conversation = first["conversation_id"].as_str().unwrap().to_string();
    let second =
        post(setup.token.clone(), json!({ "plugin": "chat", "content": "two", "conversation_id": conversation })).await;
    let run: RunId = second["run_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(wait_terminal(&setup.db.pool, run, LONG).await, "completed");
    let carol = tokens::create(&setup.db.pool, "carol", "acme", false).await.unwrap();
    let third = post(carol, json!({ "plugin": "chat", "content": "three" })).await;
    let run: RunId = third["run_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(wait_terminal(&setup.db.pool, run, LONG).await, "completed");

    let get = |token: &str, path: &str| {
        let req = client.get(format!("http://{}{path}", host.addr)).bearer_auth(token);
        async move {
            let res = req.send().await.unwrap();
            (res.status().as_u16(), res.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (status, view) = get(&setup.token, &format!("/v1/conversations/{conversation}")).await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(
        view["usage"],
        json!({ "model_calls": 2, "prompt_tokens": 10, "completion_tokens": 6, "cached_tokens": 4, "cost_usd": 0.0 })
    );
    let admin = tokens::create(&setup.db.pool, "acme-admin", "acme", true).await.unwrap();
    let (status, by_user) = get(&admin, "/v1/usage?by=user").await;
    assert_eq!(status, 200, "{by_user}");
    let rows: Vec<(String, i64, i64)> = by_user["usage"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["user_id"].as_str().unwrap().to_string(),
                r["calls"].as_i64().unwrap(),
                r["prompt_tokens"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(rows, [("alice".to_string(), 2, 10), ("carol".to_string(), 1, 5)], "{by_user}");
    let (_, summed) = get(&admin, "/v1/usage").await;
    let rows = summed["usage"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{summed}");
    assert_eq!((&rows[0]["calls"], &rows[0]["completion_tokens"]), (&json!(3), &json!(9)));
    assert!(rows[0].get("user_id").is_none(), "{summed}");
    let (status, refused) = get(&admin, "/v1/usage?by=team").await;
    assert_eq!(status, 400, "{refused}");
}
