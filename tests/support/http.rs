//! The HTTP API from a test: a host in the test process (a worker and the
//! API on a real port, with a client that speaks JSON to it with a bearer
//! token), and one request through the router in-process (`oneshot`).

use agent_host::agent::AgentRegistry;
use agent_host::api::{self, AppState};
use agent_host::db::{tokens, RunId};
use agent_host::hub::Hub;
use agent_host::worker::{Worker, WorkerConfig};
use axum::body::Body;
use http_body_util::BodyExt;
use reqwest::StatusCode;
use serde_json::Value;
use tower::ServiceExt;

use super::{fast_config, TestDb};

pub struct TestHost {
    pub base: String,
    pub token: String,
    /// An operator's token: `/metrics` shows tenant ids to operators alone.
    pub operator_token: String,
    pub client: reqwest::Client,
    worker: Option<Worker>,
    server: tokio::task::JoinHandle<()>,
}

impl TestHost {
    /// `POST /v1/runs` of `content` to `plugin` with `config`: the run's id (202 asserted).
    pub async fn post_run(&self, plugin: &str, content: &str, config: Value) -> RunId {
        let body = serde_json::json!({ "content": content, "plugin": plugin, "config": config });
        let (code, v) = self.call("POST", "/v1/runs", Some(body)).await;
        assert_eq!(code, StatusCode::ACCEPTED, "{v}");
        v["run_id"].as_str().unwrap().parse().unwrap()
    }

    /// Waits for `run` to end, checks its journal, and answers `GET /v1/runs/{id}`.
    pub async fn ended(&self, pool: &sqlx::PgPool, run: RunId) -> Value {
        super::wait_for(&format!("run {run} to end"), super::LONG, || async move {
            ["completed", "failed", "cancelled"].contains(&super::status(pool, run).await.as_str())
        })
        .await;
        super::assert_journal_sound(pool, run).await;
        self.call("GET", &format!("/v1/runs/{run}"), None).await.1
    }

    pub async fn start(db: &TestDb, hub: Option<Hub>, agents: AgentRegistry, config: WorkerConfig) -> TestHost {
        Self::start_with(db, hub, agents, config, |_| {}).await
    }

    /// The built-in agents with a hub of their own and [`fast_config`]`("w")`.
    pub async fn builtins(db: &TestDb) -> TestHost {
        Self::start(db, Some(Hub::start(db.url.clone())), AgentRegistry::with_builtins(), fast_config("w")).await
    }

    /// [`TestHost::builtins`] whose worker claims nothing (runs stay queued),
    /// with the API's state adjusted by `tweak`.
    pub async fn undispatched(db: &TestDb, tweak: impl FnOnce(&mut AppState)) -> TestHost {
        let config = WorkerConfig { dispatch: false, ..fast_config("w") };
        Self::start_with(db, Some(Hub::start(db.url.clone())), AgentRegistry::with_builtins(), config, tweak).await
    }

    /// [`TestHost::start`] with the API's state adjusted by `tweak` (a
    /// keepalive, a bound) before it serves.
    pub async fn start_with(
        db: &TestDb,
        hub: Option<Hub>,
        agents: AgentRegistry,
        config: WorkerConfig,
        tweak: impl FnOnce(&mut AppState),
    ) -> TestHost {
        let worker = Worker::start(db.pool.clone(), hub.clone(), agents.clone(), config).await.unwrap();
        let mut state = AppState::new(db.pool.clone(), agents, hub);
        state.stats = Some(worker.observer());
        tweak(&mut state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, api::router(state)).await.unwrap();
        });
        let token = tokens::create(&db.pool, "alice", "acme", false).await.unwrap();
        let operator = tokens::NewToken {
            user_id: "test-host-operator",
            tenant_id: "test-host-ops",
            admin: true,
            operator: true,
            ..Default::default()
        };
        let operator_token = tokens::create_with(&db.pool, &operator).await.unwrap().1;
        TestHost { base, token, operator_token, client: reqwest::Client::new(), worker: Some(worker), server }
    }

    /// A request with `token`; the answer's status and JSON body (Null if none).
    pub async fn call_as(&self, token: &str, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut req = self.client.request(method, format!("{}{path}", self.base)).bearer_auth(token);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let res = req.send().await.unwrap();
        let status = res.status();
        let bytes = res.bytes().await.unwrap();
        (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    pub async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        self.call_as(&self.token, method, path, body).await
    }

    pub fn events_url(&self, run: RunId) -> String {
        format!("{}/v1/runs/{run}/events", self.base)
    }

    /// `GET` of a run's events with `accept`, after `from` (as `?from=`) or
    /// `last_event_id` (as `Last-Event-ID`).
    pub async fn events(
        &self,
        run: RunId,
        accept: &str,
        from: Option<i64>,
        last_event_id: Option<i64>,
    ) -> reqwest::Response {
        let url = match from {
            Some(from) => format!("{}?from={from}", self.events_url(run)),
            None => self.events_url(run),
        };
        let mut req = self.client.get(url).bearer_auth(&self.token).header("Accept", accept);
        if let Some(id) = last_event_id {
            req = req.header("Last-Event-ID", id.to_string());
        }
        req.send().await.unwrap()
    }

    /// One JSON page of a run's events after `from`.
    pub async fn events_page(&self, run: RunId, from: i64) -> Value {
        let res = self.events(run, "application/json", Some(from), None).await;
        assert_eq!(res.status(), StatusCode::OK);
        res.json().await.unwrap()
    }

    /// A `/metrics` scrape: each sample line (name with labels) to its value.
    pub async fn scrape(&self) -> std::collections::HashMap<String, f64> {
        self.scrape_with_headers().await.1
    }

    /// [`TestHost::scrape`] with the answer's headers.
    pub async fn scrape_with_headers(&self) -> (axum::http::HeaderMap, std::collections::HashMap<String, f64>) {
        let res =
            self.client.get(format!("{}/metrics", self.base)).bearer_auth(&self.operator_token).send().await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let headers = res.headers().clone();
        let text = res.text().await.unwrap();
        let samples = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| {
                let (k, v) = l.rsplit_once(' ').unwrap();
                (k.to_string(), v.parse().unwrap_or_else(|_| panic!("bad sample {l:?}")))
            })
            .collect();
        (headers, samples)
    }

    pub async fn stop(mut self) {
        self.worker.take().unwrap().drain().await;
        self.server.abort();
    }
}

/// An answer read whole: status, headers and the body's bytes.
pub struct Answer {
    pub status: StatusCode,
    pub headers: axum::http::HeaderMap,
    pub body: bytes::Bytes,
}

impl Answer {
    /// The body as JSON (Null when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// The body as text, for asserting what it does not say.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// One request through `router` in-process: `token` as the bearer, `body`
/// as (content type, bytes), extra `headers`.
pub async fn oneshot(
    router: &axum::Router,
    method: &str,
    uri: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<(&str, Vec<u8>)>,
) -> Answer {
    let mut req = axum::http::Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = match body {
        Some((content_type, bytes)) => req.header("content-type", content_type).body(Body::from(bytes)),
        None => req.body(Body::empty()),
    }
    .unwrap();
    let res = router.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Answer { status: parts.status, headers: parts.headers, body }
}

/// A `multipart/form-data` body of `fields` (a `component` field goes as a
/// .wasm file): (content type, body).
pub fn multipart(fields: &[(&str, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "agent-host-test-boundary";
    let mut body = Vec::new();
    for (name, value) in fields {
        body.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"").as_bytes());
        if *name == "component" {
            body.extend_from_slice(b"; filename=\"plugin.wasm\"\r\nContent-Type: application/wasm");
        }
        body.extend_from_slice(b"\r\n\r\n");
        body.extend_from_slice(value);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}
