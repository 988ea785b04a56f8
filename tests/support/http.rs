//! A host in the test process: a worker and the HTTP API on a real port, and
//! a client that speaks JSON to it with a bearer token.

use agent_host::agent::AgentRegistry;
use agent_host::api::{self, AppState};
use agent_host::db::{tokens, RunId};
use agent_host::hub::Hub;
use agent_host::worker::{Worker, WorkerConfig};
use reqwest::StatusCode;
use serde_json::Value;

use super::TestDb;

pub struct TestHost {
    pub base: String,
    pub token: String,
    pub client: reqwest::Client,
    worker: Option<Worker>,
    server: tokio::task::JoinHandle<()>,
}

impl TestHost {
    pub async fn start(db: &TestDb, hub: Option<Hub>, agents: AgentRegistry, config: WorkerConfig) -> TestHost {
        let worker = Worker::start(db.pool.clone(), hub.clone(), agents.clone(), config).await.unwrap();
        let mut state = AppState::new(db.pool.clone(), agents, hub);
        state.stats = Some(worker.observer());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, api::router(state)).await.unwrap();
        });
        let token = tokens::create(&db.pool, "alice", "acme", false).await.unwrap();
        TestHost { base, token, client: reqwest::Client::new(), worker: Some(worker), server }
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

    pub async fn stop(mut self) {
        self.worker.take().unwrap().drain().await;
        self.server.abort();
    }
}
