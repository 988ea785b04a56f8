//! `GET /metrics`: Prometheus text. Queue figures are read from the database
//! at scrape time (the partial indexes make them cheap); everything else is
//! this process's counters.

use std::sync::atomic::Ordering::Relaxed;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use crate::metrics::{label_value, Exposition};

use super::{ApiError, AppState};

/// `auth`: a scrape with an operator's token sees the quota refusals by
/// tenant; any other sees them summed by limit (`tenant="*"`), so a
/// public scrape names no tenant.
pub async fn metrics(
    State(state): State<AppState>,
    auth: Result<super::Auth, ApiError>,
) -> Result<impl IntoResponse, ApiError> {
    let by_tenant = matches!(&auth, Ok(super::Auth(p)) if p.operator);
    let (queued, running, waiting, oldest): (i64, i64, i64, f64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM agent_run WHERE status = 'queued'),
                (SELECT count(*) FROM agent_run WHERE status = 'running'),
                (SELECT count(*) FROM agent_run WHERE status = 'waiting'),
                coalesce(extract(epoch FROM now() - (SELECT created_at FROM agent_run WHERE status = 'queued'
                                                     ORDER BY queue_pos LIMIT 1)), 0)::float8",
    )
    .fetch_one(&state.pool)
    .await?;
    let mut e = Exposition::default();
    e.gauge("agent_host_queue_depth", "Runs queued, all processes.", queued as f64);
    e.gauge("agent_host_runs_running", "Runs running, all processes.", running as f64);
    e.gauge("agent_host_runs_waiting", "Runs waiting for a decision or a time, all processes.", waiting as f64);
    let pending = crate::db::webhooks::pending_count(&state.pool).await?;
    e.gauge(
        "agent_host_webhooks_pending",
        "Completion webhooks waiting to be delivered, all processes.",
        pending as f64,
    );
    e.gauge("agent_host_oldest_queued_age_seconds", "Age of the oldest queued run.", oldest);
    let mut refusals: Vec<(String, f64)> = Vec::new();
    for (tenant, limit, n) in state.policy.quotas.refusals() {
        let tenant = if by_tenant { label_value(&tenant) } else { "*".to_string() };
        let labels = format!("tenant=\"{tenant}\",limit=\"{limit}\"");
        match refusals.iter_mut().find(|(l, _)| *l == labels) {
            Some((_, total)) => *total += n as f64,
            None => refusals.push((labels, n as f64)),
        }
    }
    e.labelled(
        "agent_host_quota_refusals_total",
        "counter",
        "Requests this process refused (429) past a tenant's quota or rate, or a user's stream bound.",
        &refusals,
    );
    if let Some(stats) = &state.stats {
        let w = &stats.worker;
        e.gauge("agent_host_runs_in_flight", "Runs this process is executing.", stats.in_flight() as f64);
        e.counter("agent_host_claim_rounds_total", "Claim statements executed.", w.claim_rounds.load(Relaxed));
        e.counter("agent_host_runs_claimed_total", "Runs this process claimed.", w.claimed.load(Relaxed));
        e.counter(
            "agent_host_eager_starts_total",
            "Runs started in their enqueue's statement (of those claimed).",
            w.eager_starts.load(Relaxed),
        );
        e.histogram(
            "agent_host_pickup_seconds",
            "Enqueue commit to claim, database clock (0 for a run started in its enqueue).",
            &w.pickup,
        );
        let ended: Vec<(String, f64)> = w
            .ended
            .lock()
            .unwrap()
            .iter()
            .map(|((status, reason), n)| (format!("status=\"{status}\",reason=\"{}\"", label_value(reason)), *n as f64))
            .collect();
        e.labelled("agent_host_runs_ended_total", "counter", "Terminal writes by this process.", &ended);
        e.counter("agent_host_reaped_total", "Runs this process's reaper ended.", w.reaped.load(Relaxed));
        e.counter("agent_host_fence_trips_total", "Runs this process lost to the fence.", w.fenced.load(Relaxed));
        e.counter("agent_host_backstops_total", "Runs ended by the backstop.", w.backstopped.load(Relaxed));
        e.counter("agent_host_claim_conflicts_total", "Claims the index turned away.", w.claim_conflicts.load(Relaxed));
        e.counter(
            "agent_host_ending_commits_total",
            "Group-committed ending statements (runs ended by this process's finisher, divided by this, is the batch).",
            w.finish_commits.load(Relaxed),
        );
        for (name, help, value) in [
            (
                "runs_requeued",
                "Resumable runs the reaper put back in the queue after their worker was lost.",
                &w.requeued,
            ),
            ("runs_handed_back", "Resumable runs handed back to the queue at a drain out of budget.", &w.handed_back),
            ("resumes", "Resumed attempts this process started.", &w.resumed),
            ("replayed_calls", "Host calls answered from a resumed run's call log.", &w.replayed_calls),
            ("replay_divergences", "Resumed runs that failed because the agent diverged from the log.", &w.divergences),
            ("runs_suspended", "Runs this process suspended (waiting for approval or a time).", &w.suspended),
            ("suspensions_woken", "Waiting runs this process's scheduler woke (timeouts, waits).", &w.woken),
            ("webhooks_delivered", "Completion webhooks this process delivered.", &w.webhooks_delivered),
            ("webhooks_retried", "Completion webhook attempts that failed and will be retried.", &w.webhooks_retried),
            ("webhooks_failed", "Completion webhooks failed for good (every attempt spent).", &w.webhooks_failed),
            ("schedule_firings", "Schedule firings this process made.", &w.schedule_firings),
        ] {
            e.counter(&format!("agent_host_{name}_total"), help, value.load(Relaxed));
        }
        e.counter("agent_host_heartbeat_errors_total", "Heartbeats that failed.", w.heartbeat_errors.load(Relaxed));
        e.counter(
            "agent_host_poll_fallbacks_total",
            "Idle waits ended by the poll tick.",
            w.poll_wakeups.load(Relaxed),
        );
        e.counter(
            "agent_host_journal_flushes_total",
            "Journal run batches written (each rides a group commit).",
            stats.journal.flushes.load(Relaxed),
        );
        e.counter("agent_host_journal_rows_total", "Journal rows written.", stats.journal.rows.load(Relaxed));
        e.counter("agent_host_journal_deltas_total", "Content deltas received.", stats.journal.deltas_in.load(Relaxed));
        let j = &stats.journal;
        e.counter(
            "agent_host_journal_flush_failures_total",
            "Journal flushes that failed (retried).",
            j.flush_failures.load(Relaxed),
        );
        e.counter(
            "agent_host_journal_gave_up_total",
            "Runs whose journal gave up (database gone too long).",
            j.gave_up.load(Relaxed),
        );
        e.counter(
            "agent_host_journal_group_commits_total",
            "Journal group commits: one statement and one commit for the batches of every run due together.",
            j.group_commits.load(Relaxed),
        );
        e.counter(
            "agent_host_journal_group_rows_total",
            "Rows the journal group commits wrote (rows per commit: this over the commits).",
            j.group_rows.load(Relaxed),
        );
        e.counter(
            "agent_host_journal_group_batches_total",
            "Run batches the journal group commits carried (one per run per commit).",
            j.group_batches.load(Relaxed),
        );
        e.counter(
            "agent_host_journal_group_fenced_total",
            "Run batches a group commit left out because their run was fenced.",
            j.group_fenced.load(Relaxed),
        );
        e.counter(
            "agent_host_journal_group_notifies_total",
            "NOTIFYs the journal group commits sent (at most one per commit).",
            j.group_notifies.load(Relaxed),
        );
        let commits = j.group_commits.load(Relaxed);
        e.gauge(
            "agent_host_journal_group_rows_per_commit",
            "Rows per journal group commit, on average since the process started.",
            if commits == 0 { 0.0 } else { j.group_rows.load(Relaxed) as f64 / commits as f64 },
        );
        e.gauge(
            "agent_host_journal_group_rows_max",
            "The most rows one journal group commit wrote.",
            j.group_rows_max.load(Relaxed) as f64,
        );
        e.counter(
            "agent_host_text_nul_replaced_total",
            "U+0000 from guests, tools and models replaced with U+FFFD before storing.",
            j.nul_replaced.load(Relaxed),
        );
    }
    if let Some(hub) = &state.hub {
        let h = hub.stats();
        e.gauge(
            "agent_host_hub_connected",
            "Whether the LISTEN connection is up.",
            h.connected.load(Relaxed) as u8 as f64,
        );
        e.counter("agent_host_hub_reconnects_total", "LISTEN reconnects.", h.reconnects.load(Relaxed));
        e.counter("agent_host_hub_notifications_total", "Notifications received.", h.notifications.load(Relaxed));
        e.counter("agent_host_hub_dropped_total", "Wakes dropped on full queues.", h.dropped.load(Relaxed));
        e.gauge("agent_host_hub_subscribers", "In-process subscribers of the hub.", h.subscribers() as f64);
        e.gauge("agent_host_hub_channels", "Channels the hub LISTENs on.", h.channels() as f64);
        e.counter("agent_host_hub_pruned_total", "Closed subscribers the hub removed.", h.pruned.load(Relaxed));
    }
    let tails = &state.live_tails;
    e.gauge("agent_host_sse_tails", "Live SSE tails this process serves.", tails.live() as f64);
    e.gauge("agent_host_sse_tails_max", "The bound on live SSE tails (--sse-tails-max).", tails.max() as f64);
    e.counter("agent_host_sse_tails_refused_total", "SSE tails refused at the bound (503).", tails.refused());
    let feeds = tails.feeds().stats();
    e.gauge(
        "agent_host_sse_feeds",
        "Runs whose live tails this process feeds (one journal reader each).",
        feeds.live() as f64,
    );
    e.counter(
        "agent_host_sse_feed_reads_total",
        "Journal reads of the feeds (each serves every live tail of its run on this process).",
        feeds.reads.load(Relaxed),
    );
    e.counter(
        "agent_host_sse_feed_read_statements_total",
        "Statements the feeds' reads took (the reads asked together share one).",
        feeds.read_statements.load(Relaxed),
    );
    e.counter(
        "agent_host_sse_tails_lagged_total",
        "Live tails that fell behind their feed and read on their own until caught up.",
        feeds.lagged.load(Relaxed),
    );
    e.counter(
        "agent_host_sse_tails_stalled_total",
        "Live tails cut because their client stopped reading (they rejoin from their last id).",
        feeds.stalled.load(Relaxed),
    );
    state.agents.tools().model_metrics(&mut e);
    crate::telemetry::metrics(&mut e);
    if let Some(sandbox) = state.agents.sandbox() {
        e.gauge("agent_host_sandboxes_live", "Guest instances alive.", sandbox.live() as f64);
        crate::metrics::compile_stats(&mut e, &sandbox.compile_stats());
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], e.finish()))
}
