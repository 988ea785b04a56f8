//! Everything the benchmark takes from agent-host, in one place, through the
//! library's public API only: the library keeps no benchmark code and no
//! benchmark SQL. When the library's paths move, this file is the one to
//! adapt; the sections import from here.
//!
//! Runs are claimed the way workers claim them (a [`Worker`], or for the SQL
//! floors the dispatcher's own claim statement) and end through the worker's
//! fenced terminal write; every event goes through a run's journal, as the
//! worker opens it.

use anyhow::Context;
use serde_json::Value;
use sqlx::PgPool;

pub use agent_host::agent::{Agent, AgentError, AgentRegistry, Components, HostError, RunHost, RunInput};
pub use agent_host::api::{router, AppState};
pub use agent_host::cli::args::{DbArgs, ServeArgs};
pub use agent_host::cli::serve::{connect_and_migrate, open_database, serve};
pub use agent_host::db::enqueue::Enqueued;
pub use agent_host::db::events::{CONTENT_DELTA, ENQUEUE_SEQS, RUN_QUEUED, RUN_RESUMED, USER_MESSAGE_CREATED};
pub use agent_host::db::lifecycle::ClaimedRun;
pub use agent_host::db::notify::events_channel;
pub use agent_host::db::{MessageStatus, RunId, RunStatus};
pub use agent_host::error::FailReason;
pub use agent_host::hub::Hub;
pub use agent_host::run::journal::FLUSH_DEFAULT as JOURNAL_FLUSH_DEFAULT;
pub use agent_host::run::manifest::TOOL_CALLS_CEILING;
pub use agent_host::sandbox::{Manifest, Sandbox, INSTANCES_MAX, MAX_RUNS_MAX};
pub use agent_host::service::quota::{QuotaConfig, Quotas, TENANT_MAX_STREAMS_DEFAULT, USER_MAX_STREAMS_DEFAULT};
pub use agent_host::service::submit::{LocalWorker, Policy};
pub use agent_host::stream::decode::SseDecoder;
pub use agent_host::tools::{EventSink, Tool, ToolCall, ToolRegistry};
pub use agent_host::worker::{Worker, WorkerConfig, WorkerObserver};

use agent_host::db::{self, enqueue, journal, lifecycle, runs, suspensions};

/// The benchmark's user and tenant.
pub const OWNER: &str = "bench";

fn owner() -> enqueue::Owner {
    enqueue::Owner { user_id: OWNER.into(), tenant_id: OWNER.into() }
}

/// Enqueues one run of the benchmark's owner, in a conversation of its own,
/// with the enqueue the API uses (conversation, message, run, seq 1-2).
pub async fn enqueue(
    pool: &PgPool,
    content: &str,
    plugin: &str,
    plugin_digest: Option<&str>,
    config: &Value,
) -> anyhow::Result<Enqueued> {
    enqueue_pinned(pool, content, plugin, plugin_digest, None, config).await
}

/// [`enqueue`] with a manifest pinned on the run (a resumable built-in's:
/// `{"durability": "resume"}`), as the API pins a registered plugin's.
pub async fn enqueue_pinned(
    pool: &PgPool,
    content: &str,
    plugin: &str,
    plugin_digest: Option<&str>,
    plugin_manifest: Option<&Value>,
    config: &Value,
) -> anyhow::Result<Enqueued> {
    let owner = owner();
    let new = enqueue::NewRun { plugin_digest, plugin_manifest, ..new_run(&owner, content, plugin, config) };
    Ok(enqueue::enqueue(pool, &new).await?)
}

/// A run of the benchmark's owner in a conversation of its own, its config
/// its request snapshot, its plugin not pinned.
fn new_run<'a>(owner: &'a enqueue::Owner, content: &'a str, plugin: &'a str, config: &'a Value) -> enqueue::NewRun<'a> {
    enqueue::NewRun {
        owner,
        conversation_id: None,
        content,
        plugin,
        plugin_digest: None,
        plugin_manifest: None,
        config,
        request: config,
        idempotency_key: None,
        webhook: None,
        parent: None,
    }
}

/// [`enqueue`] as the API of a process running `worker` makes it: when the
/// worker has a free slot and nothing else is queued, the run starts in the
/// enqueue's statement and runs on that worker at once (eager start).
/// Whether it did.
pub async fn enqueue_local(
    pool: &PgPool,
    worker: &WorkerObserver,
    content: &str,
    plugin: &str,
    config: &Value,
) -> anyhow::Result<(Enqueued, bool)> {
    let owner = owner();
    let new = new_run(&owner, content, plugin, config);
    let Some(slot) = worker.start_slot(&owner.tenant_id) else {
        return Ok((enqueue::enqueue(pool, &new).await?, false));
    };
    let (enqueued, started) = lifecycle::enqueue_eager(pool, &new, &slot.claim()).await?;
    let eager = started.is_some();
    if let Some(run) = started {
        slot.start(run);
    }
    Ok((enqueued, eager))
}

/// Claims up to `limit` runs with the dispatcher's claim statement.
pub async fn claim(pool: &PgPool, worker_id: &str, limit: usize) -> Result<Vec<ClaimedRun>, sqlx::Error> {
    let claim = lifecycle::Claim {
        limit: limit as i64,
        lease: agent_host::worker::LEASE_DEFAULT,
        worker_id,
        prefilter: true,
        tenant_max_running: None,
        rooms: Default::default(),
    };
    lifecycle::claim(pool, &claim).await
}

/// Ends a claimed run completed with an empty answer, with the worker's
/// fenced terminal write.
pub async fn finish_completed(pool: &PgPool, run: &ClaimedRun) -> Result<(), sqlx::Error> {
    let finish = lifecycle::Finish {
        status: RunStatus::Completed,
        error: None,
        assistant: Some(("", MessageStatus::Complete)),
        usage: None,
    };
    lifecycle::finish(pool, run.id, run.claim_token, &finish).await?;
    Ok(())
}

/// A run's status and error, as its owner sees it.
pub async fn status(pool: &PgPool, run: RunId) -> anyhow::Result<(RunStatus, Option<String>)> {
    let view = runs::get_run(pool, run, OWNER).await?.context("a bench run disappeared")?;
    Ok((view.status, view.error))
}

/// Whether the run has ended.
pub async fn is_terminal(pool: &PgPool, run: RunId) -> Result<bool, sqlx::Error> {
    Ok(journal::terminal_state(pool, run).await?.is_some())
}

/// A user's stop of one run.
pub async fn cancel(pool: &PgPool, run: RunId) -> Result<(), sqlx::Error> {
    lifecycle::cancel(pool, run, OWNER).await?;
    Ok(())
}

/// Journal rows of `kind` in the run's first `limit` events.
pub async fn journal_rows(pool: &PgPool, run: RunId, kind: &str, limit: i64) -> Result<usize, sqlx::Error> {
    Ok(journal::events_after(pool, run, 0, limit).await?.iter().filter(|e| e.kind == kind).count())
}

/// Whether the run's journal has a row of `kind` (among its first `limit`).
pub async fn has_event(pool: &PgPool, run: RunId, kind: &str, limit: i64) -> Result<bool, sqlx::Error> {
    Ok(journal::events_after(pool, run, 0, limit).await?.iter().any(|e| e.kind == kind))
}

/// Enqueues one run of `user` of `tenant` (a conversation of its own).
pub async fn enqueue_for(
    pool: &PgPool,
    user: &str,
    tenant: &str,
    plugin: &str,
    config: &Value,
) -> anyhow::Result<Enqueued> {
    let owner = enqueue::Owner { user_id: user.into(), tenant_id: tenant.into() };
    Ok(enqueue::enqueue(pool, &new_run(&owner, "hello", plugin, config)).await?)
}

/// A token of `user` of `tenant`.
pub async fn token_for(pool: &PgPool, user: &str, tenant: &str) -> Result<String, db::tokens::CreateError> {
    db::tokens::create(pool, user, tenant, false).await
}

/// A schedule of `user` of `tenant` running `plugin` hourly, its first firing due now.
pub async fn due_schedule(pool: &PgPool, user: &str, tenant: &str, plugin: &str, config: &Value) -> anyhow::Result<()> {
    let owner = enqueue::Owner { user_id: user.into(), tenant_id: tenant.into() };
    let new = db::schedules::NewSchedule {
        owner: &owner,
        plugin,
        content: "tick",
        config,
        conversation_id: None,
        cron: "0 * * * *",
        timezone: "UTC",
        webhook: None,
        next_fire_at: sqlx::types::chrono::Utc::now(),
    };
    db::schedules::create(pool, &new).await?;
    Ok(())
}

/// Enqueue to start of a run, by the database's clock, once it started.
pub async fn pickup_s(pool: &PgPool, run: RunId) -> Result<Option<f64>, sqlx::Error> {
    sqlx::query_scalar("SELECT extract(epoch FROM started_at - created_at)::float8 FROM agent_run WHERE id = $1")
        .bind(run)
        .fetch_one(pool)
        .await
}

/// Every run of `tenant` not yet ended, stopped (its owner's stop).
pub async fn stop_tenant(pool: &PgPool, tenant: &str) -> Result<(), sqlx::Error> {
    let runs: Vec<(RunId, String)> = sqlx::query_as(
        "SELECT id, owner_id FROM agent_run WHERE tenant_id = $1 AND status IN ('queued', 'running', 'waiting')",
    )
    .bind(tenant)
    .fetch_all(pool)
    .await?;
    for (run, owner) in runs {
        lifecycle::cancel(pool, run, &owner).await?;
    }
    Ok(())
}

/// An API token of the benchmark's owner.
pub async fn token(pool: &PgPool) -> Result<String, db::tokens::CreateError> {
    db::tokens::create(pool, OWNER, OWNER, false).await
}

/// Stores a plugin component (validated by `sandbox`) and returns its digest.
pub async fn put_plugin(pool: &PgPool, sandbox: &Sandbox, name: &str, bytes: &[u8]) -> anyhow::Result<String> {
    sandbox.validate(bytes)?;
    Ok(db::plugins::put(pool, name, bytes, &serde_json::json!({})).await?.digest)
}

/// Stores a plugin component with its manifest (the host validates it when
/// a run loads it) and returns its digest.
pub async fn put_plugin_with(pool: &PgPool, name: &str, bytes: &[u8], manifest: &Value) -> anyhow::Result<String> {
    Ok(db::plugins::put(pool, name, bytes, manifest).await?.digest)
}

/// One guest turn on a run's host, as the worker's registry resolves and
/// runs it (this benchmark passes no history).
pub async fn run_guest(
    sandbox: &Sandbox,
    host: &RunHost,
    digest: &str,
    manifest: &Manifest,
    input: RunInput,
) -> Result<String, AgentError> {
    Components::agent(sandbox, digest, manifest).await?.run(host, input).await
}

/// The probe's input for one guest turn: the claimed run's, with other
/// content and config.
pub fn guest_input(run: &RunInput, content: &str, config: Value) -> RunInput {
    RunInput { content: content.to_string(), config: agent_host::run::config::RunConfig::parse(config), ..run.clone() }
}

/// An agent's failure, for the benchmark's own probes.
pub fn probe_failed(e: impl std::fmt::Display) -> AgentError {
    AgentError::failed(FailReason::Agent, e.to_string())
}

/// The benchmark owner's approval of a waiting run's call `call` (its tool
/// call's ordinal), as the decision route records it: once, re-queuing the
/// run in the same transaction.
pub async fn approve(pool: &PgPool, run: RunId, call: i32) -> anyhow::Result<()> {
    let d = suspensions::Decision { decision: "approve", args: None, reason: None, decided_by: OWNER };
    suspensions::decide(pool, run, db::Reach::Owner(OWNER), call, &d).await?;
    Ok(())
}
