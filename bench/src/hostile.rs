//! A hostile tenant beside a trickle (issue 40): tenant `good`'s pickup and
//! completion, one run at a time, on a worker at the host's defaults (a
//! tenant holds at most 75% of the slots), without and then with tenant
//! `evil` flooding it: endless runs posted four times over the slots, 100
//! schedules due at once (each firing another endless run), and 200 live
//! streams of one of its runs (the user's bound, 64 a process, refuses the
//! rest).

use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;
use sqlx::PgPool;

use crate::figures::percentiles;
use crate::library::{self, AgentRegistry, Hub, Worker, WorkerConfig};
use crate::{sql, BenchArgs};

/// Slots of the measured worker.
const SLOTS: usize = 8;
/// How long one of `good`'s turns may take before it counts as not completed.
const TURN_MAX: Duration = Duration::from_secs(10);
/// Streams `evil` opens (the host admits 64 of one user on a process).
const STREAMS: usize = 200;
/// Schedules `evil` has due at once.
const SCHEDULES: usize = 100;

pub async fn hostile(pool: &PgPool, url: &str, args: &BenchArgs) -> anyhow::Result<()> {
    sql::reset(pool).await?;
    let turns = args.samples.clamp(3, 200);
    let hub = Hub::start(url.to_string());
    let config = WorkerConfig { max_runs: SLOTS, worker_id: "bench-hostile".into(), ..WorkerConfig::default() };
    let worker = Worker::start(pool.clone(), Some(hub), AgentRegistry::with_builtins(), config).await?;
    let (calm, calm_done) = trickle(pool, turns).await?;

    // The attack.
    let evil = library::token_for(pool, "mallory", "evil").await?;
    let endless = json!({ "steps": 100_000, "step_ms": 3_600_000 });
    let mut flood = Vec::new();
    for _ in 0..SLOTS * 4 {
        flood.push(library::enqueue_for(pool, "mallory", "evil", "sleep", &endless).await?.run_id);
    }
    for _ in 0..SCHEDULES {
        library::due_schedule(pool, "mallory", "evil", "sleep", &endless).await?;
    }
    let quotas = library::Quotas::new(library::QuotaConfig {
        user_max_streams: Some(library::USER_MAX_STREAMS_DEFAULT),
        tenant_max_streams: Some(library::TENANT_MAX_STREAMS_DEFAULT),
        ..Default::default()
    });
    let (addr, server) = crate::queue::serve_api_with(pool, quotas).await?;
    let client = reqwest::Client::new();
    let stream_url = format!("http://{addr}/v1/runs/{}/events", flood[0]);
    let (mut streams, mut refused) = (Vec::new(), 0);
    for _ in 0..STREAMS {
        let res = client.get(&stream_url).bearer_auth(&evil).header("Accept", "text/event-stream").send().await?;
        match res.status().as_u16() {
            200 => streams.push(res),
            429 => refused += 1,
            other => anyhow::bail!("a stream answered {other}"),
        }
    }
    // At the host's default share, evil holds three quarters of the slots.
    let held = wait_running(pool, "evil", (SLOTS * 3 / 4) as i64).await?;
    let (attacked, attacked_done) = trickle(pool, turns).await?;

    let line = |mut v: Vec<Duration>, done: usize| format!("{}; completed {done} of {turns}", percentiles(&mut v));
    println!(
        "hostile tenant: evil floods {} endless runs on {SLOTS} slots (holds {held}), {SCHEDULES} due schedules, \
         {STREAMS} streams ({} open, {refused} refused); good's trickle of {turns} runs, pickup:",
        SLOTS * 4,
        streams.len()
    );
    println!("  unattacked:   {}", line(calm, calm_done));
    println!("  under attack: {}", line(attacked, attacked_done));
    drop(streams);
    server.abort();
    library::stop_tenant(pool, "evil").await?;
    worker.drain().await;
    Ok(())
}

/// `turns` runs of `good`, one at a time: each one's pickup, and how many
/// completed within [`TURN_MAX`].
async fn trickle(pool: &PgPool, turns: usize) -> anyhow::Result<(Vec<Duration>, usize)> {
    let (mut pickups, mut done) = (Vec::new(), 0);
    for _ in 0..turns {
        let run = library::enqueue_for(pool, "alice", "good", "noop", &json!({})).await?.run_id;
        let started = Instant::now();
        while !library::is_terminal(pool, run).await? && started.elapsed() < TURN_MAX {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if let Some(s) = library::pickup_s(pool, run).await? {
            pickups.push(Duration::from_secs_f64(s.max(0.0)));
        }
        done += usize::from(library::is_terminal(pool, run).await?);
    }
    Ok((pickups, done))
}

/// Waits (at most 30 s) until `tenant` holds `want` running runs (its share
/// of the slots); how many it holds then.
async fn wait_running(pool: &PgPool, tenant: &str, want: i64) -> anyhow::Result<i64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    loop {
        tick.tick().await;
        let now =
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM agent_run WHERE tenant_id = $1 AND status = 'running'")
                .bind(tenant)
                .fetch_one(pool)
                .await
                .context("counting running runs")?;
        if now >= want || Instant::now() > deadline {
            return Ok(now);
        }
    }
}
