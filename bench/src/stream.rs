//! Emit to client: a run's events through the journal, the NOTIFY and the
//! HTTP API to an SSE client in this process; and the journal rows that
//! 1,000 content deltas become.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_trait::async_trait;
use futures::StreamExt;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::mpsc;

use crate::figures::percentiles;
use crate::library::{self, Agent, AgentError, AgentRegistry, AppState, Hub, RunHost, RunInput, SseDecoder, Worker};
use crate::library::{WorkerConfig, CONTENT_DELTA, JOURNAL_FLUSH_DEFAULT};
use crate::sql;

/// Structural events timed on their way to the client.
const TICKS: usize = 200;
/// Content deltas emitted back to back, then counted as journal rows.
const DELTAS: usize = 1000;
/// Bound on the client's wait for the next piece of the stream.
const READ_MAX: Duration = Duration::from_secs(30);

/// Emits `ticks` structural events 5 ms apart, reporting the instant before
/// each, then `deltas` content deltas as fast as it can.
struct Ticker {
    sent: mpsc::UnboundedSender<Instant>,
    ticks: usize,
    deltas: usize,
}

#[async_trait]
impl Agent for Ticker {
    async fn run(&self, host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        for i in 0..self.ticks {
            let _ = self.sent.send(Instant::now());
            host.emit_event("tick", json!({ "i": i })).await?;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for _ in 0..self.deltas {
            host.emit_delta("x").await?;
        }
        Ok(String::new())
    }
}

pub async fn stream_latency(pool: &PgPool, url: &str) -> anyhow::Result<()> {
    sql::reset(pool).await?;
    let (tx, mut sent) = mpsc::unbounded_channel();
    let mut agents = AgentRegistry::default();
    agents.insert("ticker", Arc::new(Ticker { sent: tx, ticks: TICKS, deltas: DELTAS }));
    let hub = Hub::start(url.to_string());
    let config = WorkerConfig { worker_id: "bench".into(), tenant_slot_share_pct: 100, ..WorkerConfig::default() };
    let worker = Worker::start(pool.clone(), Some(hub.clone()), agents.clone(), config).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = library::router(AppState::new(pool.clone(), agents, Some(hub)));
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let token = library::token(pool).await?;
    let run = library::enqueue(pool, "bench", "ticker", None, &json!({})).await?;
    let res = reqwest::Client::new()
        .get(format!("http://{addr}/v1/runs/{}/events", run.run_id))
        .bearer_auth(&token)
        .header("Accept", "text/event-stream")
        .send()
        .await?
        .error_for_status()?;
    let (mut body, mut decoder, mut out) = (res.bytes_stream(), SseDecoder::default(), Vec::new());
    let mut samples = Vec::with_capacity(TICKS);
    'read: while let Some(chunk) = tokio::time::timeout(READ_MAX, body.next()).await? {
        decoder.feed(&chunk?, &mut out).map_err(anyhow::Error::msg)?;
        let arrived = Instant::now();
        for data in out.drain(..) {
            let event: serde_json::Value = serde_json::from_str(&data)?;
            match event["type"].as_str() {
                Some("tick") => samples.push(arrived - sent.recv().await.context("ticker gone")?),
                Some("complete") => break 'read,
                _ => {}
            }
        }
    }
    // Every event of the run fits well within this bound.
    let rows = library::journal_rows(pool, run.run_id, CONTENT_DELTA, (TICKS + DELTAS + 10) as i64).await?;
    server.abort();
    worker.drain().await;
    println!(
        "emit to SSE client (a structural event, through journal, NOTIFY and HTTP), {TICKS} events: {}",
        percentiles(&mut samples)
    );
    println!(
        "journal rows for {DELTAS} content deltas emitted back to back: {rows} (flush every {JOURNAL_FLUSH_DEFAULT:?})"
    );
    Ok(())
}
