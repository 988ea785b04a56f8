//! Hosts for durable-resume and approval tests: a webhook receiver outside
//! the hosts, scripted model endpoints, host processes with a tools file,
//! and a client that follows a run's stream across hosts.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_host::db::{plugins, tokens, RunId};
use agent_host::stream::decode::SseDecoder;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use futures::StreamExt;
use serde_json::{json, Value};

use super::process::{HostProcess, FAST};
use super::*;

pub type Stamp = chrono::DateTime<chrono::Utc>;

/// What the webhook receiver (outside the hosts) saw: (route, Idempotency-Key), in order.
#[derive(Default)]
pub struct Receiver {
    pub seen: Mutex<Vec<(String, String)>>,
    /// (route, the call's `args`), in order.
    pub args: Mutex<Vec<(String, Value)>>,
}

impl Receiver {
    pub fn keys(&self, route: &str) -> Vec<String> {
        self.seen.lock().unwrap().iter().filter(|(r, _)| r == route).map(|(_, k)| k.clone()).collect()
    }
}

/// `/record` answers at once; `/slow` and `/once` hold their first request
/// forever (the host dies inside it) and answer later ones.
pub async fn receive(
    State(r): State<Arc<Receiver>>,
    Path(route): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> impl IntoResponse {
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or("?").to_string();
    r.args.lock().unwrap().push((route.clone(), body["args"].clone()));
    let first = {
        let mut seen = r.seen.lock().unwrap();
        let first = !seen.iter().any(|(x, _)| *x == route);
        seen.push((route.clone(), key));
        first
    };
    if (route == "slow" || route == "once") && first {
        std::future::pending::<()>().await;
    }
    Json(json!({ "ok": true, "route": route }))
}

pub async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    base
}

/// Model requests, in order.
pub type ModelLog = Arc<Mutex<Vec<Value>>>;

/// A streaming chat-completions endpoint: without a tool result in the
/// conversation it asks for the `slow` tool; with one it answers in pieces.
pub async fn model(log: ModelLog) -> String {
    pub async fn complete(State(log): State<ModelLog>, Json(body): Json<Value>) -> impl IntoResponse {
        log.lock().unwrap().push(body.clone());
        let has_result = body["messages"].as_array().unwrap().iter().any(|m| m["role"] == "tool");
        let chunk = |delta: Value, finish: Value| {
            format!("data: {}\n\n", json!({ "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] }))
        };
        let mut sse = String::new();
        if has_result {
            for piece in ["The slow ", "tool ", "answered."] {
                sse += &chunk(json!({ "content": piece }), Value::Null);
            }
            sse += &chunk(json!({}), json!("stop"));
        } else {
            sse += &chunk(json!({ "content": "Let me check. " }), Value::Null);
            sse += &chunk(
                json!({ "tool_calls": [{ "index": 0, "id": "call_1", "type": "function",
                        "function": { "name": "slow", "arguments": "{\"q\": 1}" } }] }),
                Value::Null,
            );
            sse += &chunk(json!({}), json!("tool_calls"));
        }
        sse += "data: [DONE]\n\n";
        ([("content-type", "text/event-stream")], sse)
    }
    serve(Router::new().route("/v1/chat/completions", post(complete)).with_state(log)).await
}

/// A streaming chat-completions endpoint whose first answer stops halfway
/// (the connection stays open, nothing more comes); later ones complete.
pub async fn stalling_model(log: ModelLog) -> String {
    pub async fn complete(State(log): State<ModelLog>, Json(body): Json<Value>) -> axum::response::Response {
        let first = {
            let mut log = log.lock().unwrap();
            log.push(body);
            log.len() == 1
        };
        let chunk = |text: &str| {
            let c = json!({ "choices": [{ "index": 0, "delta": { "content": text }, "finish_reason": null }] });
            Ok::<_, std::convert::Infallible>(bytes::Bytes::from(format!("data: {c}\n\n")))
        };
        let body = if first {
            let pieces = futures::stream::iter(vec![chunk("Partial answer "), chunk("that will be cut")]);
            axum::body::Body::from_stream(pieces.chain(futures::stream::pending()))
        } else {
            let end = json!({ "choices": [{ "index": 0, "delta": {}, "finish_reason": "stop" }] });
            let done = Ok(bytes::Bytes::from(format!("data: {end}\n\ndata: [DONE]\n\n")));
            axum::body::Body::from_stream(futures::stream::iter(vec![chunk("A complete "), chunk("answer."), done]))
        };
        ([("content-type", "text/event-stream")], body).into_response()
    }
    serve(Router::new().route("/v1/chat/completions", post(complete)).with_state(log)).await
}

/// A scripted streaming chat-completions endpoint: request n (1-based) gets
/// `script(n, has_tool_result)`: text pieces, an optional tool call, and
/// whether the stream then stalls (stays open with nothing more).
pub async fn scripted_model(
    log: ModelLog,
    script: fn(usize, bool) -> (Vec<&'static str>, Option<&'static str>, bool),
) -> String {
    let complete = move |State(log): State<ModelLog>, Json(body): Json<Value>| async move {
        let has_result = body["messages"].as_array().unwrap().iter().any(|m| m["role"] == "tool");
        let n = {
            let mut log = log.lock().unwrap();
            log.push(body);
            log.len()
        };
        let (pieces, tool, stall) = script(n, has_result);
        let frame = |c: Value| Ok::<_, std::convert::Infallible>(bytes::Bytes::from(format!("data: {c}\n\n")));
        let mut frames: Vec<_> = pieces
            .into_iter()
            .map(|t| frame(json!({ "choices": [{ "index": 0, "delta": { "content": t }, "finish_reason": null }] })))
            .collect();
        if let Some(name) = tool {
            let call = json!({ "index": 0, "id": "call_1", "type": "function",
                               "function": { "name": name, "arguments": "{}" } });
            frames.push(frame(
                json!({ "choices": [{ "index": 0, "delta": { "tool_calls": [call] }, "finish_reason": null }] }),
            ));
        }
        let body = if stall {
            axum::body::Body::from_stream(futures::stream::iter(frames).chain(futures::stream::pending()))
        } else {
            let finish = if tool.is_some() { "tool_calls" } else { "stop" };
            frames.push(frame(json!({ "choices": [{ "index": 0, "delta": {}, "finish_reason": finish }] })));
            frames.push(Ok(bytes::Bytes::from("data: [DONE]\n\n")));
            axum::body::Body::from_stream(futures::stream::iter(frames))
        };
        ([("content-type", "text/event-stream")], body).into_response()
    };
    serve(Router::new().route("/v1/chat/completions", post(complete)).with_state(log)).await
}

pub struct Env {
    pub db: TestDb,
    pub receiver: Arc<Receiver>,
    pub token: String,
    pub args: Vec<String>,
    _dir: PathBuf,
}

impl Env {
    /// A database with `plugin` registered as a resumable `component` granted
    /// `tools`, a receiver, and host flags: `FAST` (or a long lease), the
    /// tools file, a shared compile cache, and `extra`.
    pub async fn new(plugin: &str, component: &str, tools: &[&str], fast: bool, extra: &[&str]) -> Env {
        let manifest = json!({ "tools": tools, "durability": "resume" });
        Env::with_manifest(plugin, component, &manifest, fast, extra).await
    }

    /// [`Env::new`] with the whole manifest given.
    pub async fn with_manifest(plugin: &str, component: &str, manifest: &Value, fast: bool, extra: &[&str]) -> Env {
        Env::with_wasm(plugin, &plugin_wasm(component), manifest, fast, extra).await
    }

    /// [`Env::with_manifest`] with the component's bytes given (an example
    /// agent in another language, built by `scripts/build-plugin`).
    pub async fn with_wasm(plugin: &str, wasm: &[u8], manifest: &Value, fast: bool, extra: &[&str]) -> Env {
        let db = TestDb::new().await;
        let receiver = Arc::new(Receiver::default());
        let base = serve(Router::new().route("/{route}", post(receive)).with_state(receiver.clone())).await;
        let dir = std::env::temp_dir().join(format!("agent-host-resume-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let tools_file = dir.join("tools.toml");
        std::fs::write(
            &tools_file,
            format!(
                "[[webhook]]\nname = \"record\"\nurl = \"{base}/record\"\nidempotent = true\n\n\
                 [[webhook]]\nname = \"slow\"\nurl = \"{base}/slow\"\ntimeout_ms = 60000\nidempotent = true\n\n\
                 [[webhook]]\nname = \"once\"\nurl = \"{base}/once\"\ntimeout_ms = 60000\n\n\
                 [[webhook]]\nname = \"send\"\nurl = \"{base}/send\"\n\n\
                 [[webhook]]\nname = \"gated\"\nurl = \"{base}/send\"\napproval = \"always\"\n"
            ),
        )
        .unwrap();
        plugins::put(&db.pool, plugin, wasm, manifest).await.unwrap();
        let token = tokens::create(&db.pool, "alice", "acme", false).await.unwrap();
        let mut args: Vec<String> = if fast {
            FAST.iter().map(|s| s.to_string()).collect()
        } else {
            // A lease far longer than the test: nothing may wait for it.
            ["--lease-ms", "60000", "--heartbeat-ms", "1000", "--reap-interval-ms", "100", "--poll-tick-ms", "500"]
                .iter()
                .map(|s| s.to_string())
                .collect()
        };
        let cache = dir.join("cache");
        args.extend(["--tools-file".into(), tools_file.display().to_string()]);
        args.extend(["--cache-dir".into(), cache.display().to_string()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        Env { db, receiver, token, args, _dir: dir }
    }

    pub fn spawn(&self, worker: &str) -> HostProcess {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        HostProcess::spawn(&self.db.url, worker, &args)
    }

    /// One API request to `host` as the env's user: the status and the JSON answer.
    pub async fn request(
        &self,
        host: &HostProcess,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut req =
            reqwest::Client::new().request(method, format!("http://{}{path}", host.addr)).bearer_auth(&self.token);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let res = req.send().await.unwrap();
        (res.status().as_u16(), res.json().await.unwrap_or(Value::Null))
    }

    /// `GET path`'s JSON answer.
    pub async fn get(&self, host: &HostProcess, path: &str) -> Value {
        self.request(host, reqwest::Method::GET, path, None).await.1
    }

    pub async fn post(&self, host: &HostProcess, plugin: &str, content: &str, config: Value) -> RunId {
        let body = json!({ "plugin": plugin, "content": content, "config": config });
        self.post_turn(host, "/v1/runs", body).await
    }

    /// A run posted to `path` (`/v1/runs`, or a conversation's runs): its id.
    pub async fn post_turn(&self, host: &HostProcess, path: &str, body: Value) -> RunId {
        let (status, answer) = self.request(host, reqwest::Method::POST, path, Some(body)).await;
        assert_eq!(status, 202, "{answer}");
        answer["run_id"].as_str().unwrap().parse().unwrap()
    }

    pub async fn view(&self, host: &HostProcess, run: RunId) -> Value {
        self.get(host, &format!("/v1/runs/{run}")).await
    }

    pub async fn completed_tool_calls(&self, run: RunId) -> i64 {
        let sql = "SELECT count(*) FROM run_call WHERE run_id = $1 AND import = 'call-tool' AND outcome IS NOT NULL";
        scalar(&self.db, sql, run).await
    }

    pub async fn wait_tool_calls(&self, run: RunId, n: i64) {
        wait_for("recorded tool calls", LONG, || async move { self.completed_tool_calls(run).await >= n }).await;
    }

    /// Waits until a call reaches the receiver's `route`.
    pub async fn wait_arrived(&self, route: &str) {
        wait_for("a call to arrive", LONG, || async move { !self.receiver.keys(route).is_empty() }).await;
    }

    pub async fn attempt(&self, run: RunId) -> i32 {
        scalar(&self.db, "SELECT attempt FROM agent_run WHERE id = $1", run).await
    }

    pub async fn assistant(&self, run: RunId) -> String {
        scalar(&self.db, "SELECT content FROM message WHERE run_id = $1 AND role = 'assistant'", run).await
    }
}

/// One value `sql` reads about `run` (its only parameter).
pub async fn scalar<T>(db: &TestDb, sql: &str, run: RunId) -> T
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
{
    sqlx::query_scalar(sql).bind(run).fetch_one(&db.pool).await.unwrap()
}

/// What a client following one run saw, across hosts.
#[derive(Default, Debug)]
pub struct Followed {
    pub events: Vec<(i32, String, Value)>,
    /// The answer as a client builds it: deltas appended, `content_rollback` honoured.
    pub text: String,
    pub rejoins: usize,
}

/// Follows a run's stream to its `complete` on whichever host is listed
/// last, rejoining with Last-Event-ID when a host dies under it. Panics on
/// a repeated or out-of-order seq.
pub async fn follow(hosts: Arc<Mutex<Vec<String>>>, token: String, run: RunId) -> Followed {
    let http = reqwest::Client::new();
    let mut f = Followed::default();
    let deadline = Instant::now() + 2 * LONG;
    loop {
        assert!(Instant::now() < deadline, "the client never saw the end of {run}: {f:?}");
        let host = hosts.lock().unwrap().last().cloned().expect("a live host");
        let last = f.events.last().map(|e| e.0);
        let mut req = http.get(format!("http://{host}/v1/runs/{run}/events")).bearer_auth(&token);
        if let Some(seq) = last {
            req = req.header("Last-Event-ID", seq.to_string());
        }
        let Ok(res) = req.header("Accept", "text/event-stream").send().await else {
            // A backoff, not synchronisation: that host is down; the loop's
            // deadline bounds the retries and the next may find another.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut body = res.bytes_stream();
        let mut decoder = SseDecoder::default();
        while let Ok(Some(Ok(chunk))) = tokio::time::timeout(LONG, body.next()).await {
            let mut frames = Vec::new();
            decoder.feed_frames(&chunk, &mut frames).expect("an SSE body");
            for frame in frames {
                let (Some(id), Some(kind)) = (frame.id, frame.event) else { continue };
                let seq: i32 = id.parse().unwrap();
                let data: Value = serde_json::from_str(&frame.data).unwrap();
                let prev = f.events.last().map_or(0, |e| e.0);
                assert_eq!(seq, prev + 1, "a gap or a repeat at seq {seq} after {prev}: {f:?}");
                match kind.as_str() {
                    "content_delta" => f.text.push_str(data["delta"].as_str().unwrap()),
                    "content_rollback" => {
                        let keep = data["keep_chars"].as_u64().unwrap() as usize;
                        f.text = f.text.chars().take(keep).collect();
                    }
                    _ => {}
                }
                let done = kind == "complete";
                f.events.push((seq, kind, data));
                if done {
                    return f;
                }
            }
        }
        f.rejoins += 1;
        // The same backoff before rejoining from the last seq (deadline above).
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn start_following(env: &Env, hosts: &Arc<Mutex<Vec<String>>>, run: RunId) -> tokio::task::JoinHandle<Followed> {
    tokio::spawn(follow(hosts.clone(), env.token.clone(), run))
}

/// Every key seen once, except at most one (the call in flight at a crash)
/// seen twice.
pub fn assert_keys_at_most_once_but_the_one_in_flight(keys: &[String], calls: usize, run: RunId) {
    let prefix = format!("{run}:");
    let keys: Vec<String> = keys.iter().filter(|k| k.starts_with(&prefix)).cloned().collect();
    let keys = keys.as_slice();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for k in keys {
        *counts.entry(k).or_default() += 1;
    }
    let expected: Vec<String> = (1..=calls).map(|i| format!("{run}:{i}")).collect();
    for k in &expected {
        assert!(counts.contains_key(k.as_str()), "key {k} never arrived: {keys:?}");
    }
    assert_eq!(counts.len(), calls, "keys: {keys:?}");
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.len() <= 1 && twice.iter().all(|(_, n)| **n == 2), "keys repeated: {keys:?}");
}

pub fn count(events: &[(i32, String, Value)], kind: &str) -> usize {
    events.iter().filter(|e| e.1 == kind).count()
}
