//! One claimed run: execute the agent, write the ending (fenced), release the
//! slot. A backstop gives a run whose task died without an ending (panic,
//! error) a failed ending; a run whose claim was lost writes nothing more.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures::FutureExt;

use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::agent::registry::HISTORY_MESSAGES_MAX;
use crate::agent::{Agent, AgentError, FailReason, HostError, Message, Resolved, RunHost, RunInput, Usage};
use crate::db::{self, lifecycle::ClaimedRun, lifecycle::Ending, RunStatus};
use crate::run::config::RunConfig;
use crate::run::host::RunHostParts;
use crate::run::journal::{Journal, JournalConfig, FIRST_RUN_SEQ};
use crate::run::record::{Recording, RecordingParts};
use crate::telemetry::WithRunTrace;
use crate::text;

use super::settle::{ended, settle, End, Race, Settled, Verdict};
use super::{Held, Shared};

/// How a run task ended.
enum Outcome {
    /// Its ending is written.
    Finalized,
    /// The claim was lost (reaped, or ended by someone else): write nothing.
    Lost,
    /// A resumable run went back to the queue (a drain ran out of budget):
    /// another process resumes it.
    HandedBack,
    /// The run waits (an approval, a durable wait): a decision or the
    /// scheduler puts it back in the queue.
    Suspended,
    /// No ending was written and the claim may still be ours.
    Unfinalized(String),
}

pub(super) fn spawn(shared: &Arc<Shared>, row: ClaimedRun, permit: OwnedSemaphorePermit) {
    let lost = CancellationToken::new();
    let cancel = CancellationToken::new();
    let slot: super::Slot = Arc::new(std::sync::Mutex::new(Some(permit)));
    let steered = Arc::new(tokio::sync::Notify::new());
    {
        let mut held = shared.held.lock().unwrap();
        // A stop that committed right after our claim may have NOTIFYed
        // before this insert; the canceller kept it for us (same lock order).
        if shared.early_cancels.lock().unwrap().remove(&row.id).is_some() {
            cancel.cancel();
        }
        held.insert(
            row.id,
            Held {
                token: row.claim_token,
                slot: slot.clone(),
                lost: lost.clone(),
                cancel: cancel.clone(),
                tenant: row.tenant_id.clone(),
                steered: steered.clone(),
            },
        );
    }
    let span = tracing::info_span!("run", run_id = %row.id, plugin = %row.plugin);
    // The run's OpenTelemetry trace (inert when traces are off), in scope
    // for the whole task: the hooks of `telemetry` find it there.
    let trace = crate::telemetry::RunTrace::claimed(&row, &shared.config.worker_id);
    let shared2 = shared.clone();
    shared.tasks.spawn(
        async move {
            let shared = shared2;
            let (id, token, conversation) = (row.id, row.claim_token, row.conversation_id);
            let resumable = resumable(&row);
            // A panic in the run is caught here rather than losing its
            // ending (in this task: a task of its own would cost a spawn
            // and a wake per run).
            let outcome: Outcome = AssertUnwindSafe(execute(shared.clone(), row, lost, cancel, steered))
                .catch_unwind()
                .await
                .unwrap_or_else(|_| {
                    const PANICKED: &str = "the run's task panicked";
                    tracing::error!("{PANICKED}");
                    Outcome::Unfinalized(FailReason::Host.message(PANICKED))
                });
            crate::telemetry::segment_ended(outcome.label());
            // A suspended run did not end: its conversation's next turn waits.
            let ended = !matches!(outcome, Outcome::Suspended);
            close_out(&shared, outcome, id, token, resumable).await;
            release(&shared, id, token);
            // The slot, unless the finisher passed it on to a run it claimed.
            drop(slot.lock().unwrap().take());
            // The wake chain's post-commit half (see `waker`).
            if ended {
                let _ = shared.ended.send((id, conversation)).await;
            }
        }
        .instrument(span)
        .with_run_trace(trace),
    );
}

impl Outcome {
    /// How the claimed segment ended, for its trace span.
    fn label(&self) -> &'static str {
        match self {
            Outcome::Finalized => "finalized",
            Outcome::Lost => "lost",
            Outcome::HandedBack => "handed_back",
            Outcome::Suspended => "suspended",
            Outcome::Unfinalized(_) => "unfinalized",
        }
    }
}

/// What a run task's outcome leaves to do: counted, and a run with no
/// ending written handed back (resumable) or ended by the backstop.
async fn close_out(shared: &Shared, outcome: Outcome, id: db::RunId, token: db::ClaimToken, resumable: bool) {
    match outcome {
        Outcome::Finalized => {
            shared.stats.finished.fetch_add(1, Ordering::Relaxed);
        }
        Outcome::Lost => {
            shared.stats.fenced.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("run lost to the fence; standing down");
        }
        Outcome::HandedBack => {
            shared.stats.handed_back.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("drain budget spent; resumable run handed back to the queue");
        }
        Outcome::Suspended => {
            shared.stats.suspended.fetch_add(1, Ordering::Relaxed);
        }
        // A resumable run's task died (or its ending could not be
        // written): back to the queue, resumed from its log. With the
        // database unreachable it is left running: its lease lapses
        // and the reaper resumes it (a backstop landing once the
        // database is back would end it failed instead).
        Outcome::Unfinalized(reason) if resumable => {
            match db::lifecycle::hand_back(&shared.pool, id, token, shared.config.resume_attempts).await {
                Ok(true) => {
                    shared.stats.handed_back.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%reason, "resumable run ended without a terminal write; handed back to the queue");
                }
                Ok(false) => backstop(shared, id, token, &reason).await,
                Err(e) => {
                    tracing::warn!(%reason, error = %e, "resumable run ended without a terminal write and could not be handed back; the reaper will resume it")
                }
            }
        }
        Outcome::Unfinalized(reason) => backstop(shared, id, token, &reason).await,
    }
}

/// The backstop: a run never stays running because its task died.
async fn backstop(shared: &Shared, id: db::RunId, token: db::ClaimToken, reason: &str) {
    shared.stats.backstopped.fetch_add(1, Ordering::Relaxed);
    tracing::error!(%reason, "run ended without a terminal write; backstop ends it failed");
    match db::lifecycle::backstop(&shared.pool, id, token, reason).await {
        Ok(true) => shared.stats.record_end(RunStatus::Failed, Some(FailReason::Host)),
        Ok(false) => {}
        Err(e) => tracing::error!(error = %e, "backstop write failed; the reaper will end the run"),
    }
}

async fn execute(
    shared: Arc<Shared>,
    row: ClaimedRun,
    lost: CancellationToken,
    cancel: CancellationToken,
    steered: Arc<tokio::sync::Notify>,
) -> Outcome {
    let (agent, host, input) = match prepare(&shared, &row, &lost, &cancel).await {
        Ok(prepared) => prepared,
        Err(outcome) => return outcome,
    };
    crate::telemetry::agent_started();
    let race = race(&shared, agent.as_ref(), &host, input, &lost, &cancel, &steered).await;
    let verdict = Verdict {
        suspended: host.suspended(),
        failure: host.failure(),
        stop_requested: cancel.is_cancelled(),
        resumable: host.manifest().resumable(),
    };
    let end = match settle(race, &verdict) {
        Settled::HandBack => return hand_back(&shared, &row, &host).await,
        settled => {
            shared.stats.replayed_calls.fetch_add(host.replayed(), Ordering::Relaxed);
            match settled {
                Settled::End(end) => end,
                Settled::Lost => return Outcome::Lost,
                _ => return Outcome::Suspended,
            }
        }
    };
    if end.reason == Some(FailReason::Divergence) {
        shared.stats.divergences.fetch_add(1, Ordering::Relaxed);
    }
    // Everything journaled lands before the ending.
    let (streamed, flushed) = host.close().await;
    if flushed == Err(HostError::Fenced) {
        return Outcome::Lost;
    }
    finalize(&shared, &row, end, streamed, host.usage()).await
}

/// Everything a run needs before its agent starts: the agent (built-in or
/// component), the conversation before this turn, a resumable run's
/// recording, the journal and the run's host. A run that cannot start here
/// ends (or goes back to the queue) with the outcome given.
async fn prepare(
    shared: &Shared,
    row: &ClaimedRun,
    lost: &CancellationToken,
    cancel: &CancellationToken,
) -> Result<(Arc<dyn Agent>, RunHost, RunInput), Outcome> {
    // One registry resolves built-ins and components alike.
    let resolved = shared.agents.resolve(&row.plugin, row.plugin_digest.as_deref(), row.plugin_manifest.as_ref()).await;
    let Resolved { agent, manifest } = match resolved {
        Ok(r) => r,
        Err(e) => return Err(start_failed(shared, row, e).await),
    };
    let host_failed = |what: &str| AgentError::failed(FailReason::Host, format!("{what} could not be read"));
    let history = match history(shared, row).await {
        Ok(h) => h,
        Err(e) => {
            tracing::error!(error = %e, "reading the conversation's history failed");
            return Err(start_failed(shared, row, host_failed("the conversation's history")).await);
        }
    };
    // A resumable run records its calls; a resumed one also reads what its
    // earlier attempts recorded and journaled.
    let recording = match manifest.resumable() {
        false => None,
        true => match recording(shared, row, lost, &manifest).await {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::error!(error = %e, "reading the run's call log failed");
                return Err(start_failed(shared, row, host_failed("the run's call log")).await);
            }
        },
    };
    // A plugin of the run's tenant (not one the operator published) is
    // held to the operator's grants for that tenant at every call.
    let plugin_tenant = match plugin_tenant(shared, row).await {
        Ok(t) => t,
        Err(e) => {
            tracing::error!(error = %e, "reading the plugin's owner failed");
            return Err(start_failed(shared, row, host_failed("the plugin's owner")).await);
        }
    };
    let first_seq = recording.as_ref().map_or(FIRST_RUN_SEQ, |r| r.next_seq().max(FIRST_RUN_SEQ));
    let journal = Journal::start_in(
        &shared.journal_group,
        row.id,
        row.claim_token,
        first_seq,
        JournalConfig { flush_every: shared.config.journal_flush, give_up_after: shared.config.journal_give_up },
        lost.clone(),
        shared.journal_stats.clone(),
    );
    // The config, parsed once: the host's own keys typed, the rest the agent's.
    let config = RunConfig::parse(row.config.clone());
    let host = RunHost::new(RunHostParts {
        run_id: row.id,
        journal,
        cancel: cancel.clone(),
        tools: shared.agents.tools().clone(),
        manifest,
        recording,
        require_approval: config.require_approval.clone(),
        plugin_tenant,
        pool: shared.pool.clone(),
        token: row.claim_token,
        owner: crate::db::enqueue::Owner { user_id: row.owner_id.clone(), tenant_id: row.tenant_id.clone() },
        children: Some(shared.children.clone()),
    });
    if let Err(outcome) = journal_resumed(shared, row, &host).await {
        return Err(outcome);
    }
    let input = RunInput {
        run_id: row.id,
        conversation_id: row.conversation_id,
        content: row.content.clone(),
        config,
        history,
    };
    Ok((agent, host, input))
}

/// The conversation before this turn (a first turn has none: the claim
/// said so, and no read is made).
async fn history(shared: &Shared, row: &ClaimedRun) -> Result<Vec<Message>, sqlx::Error> {
    if !row.has_history {
        return Ok(Vec::new());
    }
    let rows = db::conversations::history(&shared.pool, row.conversation_id, row.user_message_id, HISTORY_MESSAGES_MAX)
        .await?;
    Ok(rows.into_iter().map(|(role, content)| Message { role, content }).collect())
}

/// A resumed attempt says so in its journal (`run_resumed`) before it replays.
async fn journal_resumed(shared: &Shared, row: &ClaimedRun, host: &RunHost) -> Result<(), Outcome> {
    let Some((attempt, calls)) = host.resumed() else { return Ok(()) };
    shared.stats.resumed.fetch_add(1, Ordering::Relaxed);
    tracing::info!(attempt, calls, "resuming the run: replaying its recorded calls");
    match host.journal_resumed(&shared.config.worker_id).await {
        Ok(()) => Ok(()),
        Err(HostError::Fenced) => Err(Outcome::Lost),
        Err(e) => {
            let _ = host.close().await;
            let e = AgentError::failed(FailReason::Host, format!("the resumed run could not be journaled: {e}"));
            Err(start_failed(shared, row, e).await)
        }
    }
}

/// The agent against the host's reasons to stop it; what won, for [`settle`].
async fn race(
    shared: &Shared,
    agent: &dyn Agent,
    host: &RunHost,
    input: RunInput,
    lost: &CancellationToken,
    cancel: &CancellationToken,
    steered: &tokio::sync::Notify,
) -> Race {
    // A stop is cooperative first: the agent sees `check-cancel` and refusals.
    // One that has not returned within the grace is interrupted (its future,
    // and a guest's store with it, is dropped at its next yield).
    let grace = shared.config.cancel_grace;
    let forced = async {
        cancel.cancelled().await;
        tokio::time::sleep(grace).await;
    };
    // The fence tripped (heartbeat or journal found the claim gone): stop at
    // once, unless the run's own suspension cleared the claim.
    let lost_or_suspended = async {
        lost.cancelled().await;
        host.suspension_settled().await;
    };
    // The manifest's wall time, for an agent that does not keep it itself
    // (a built-in): no agent runs without one.
    let wall_ms = host.manifest().limits.wall_ms;
    let wall = async {
        match agent.keeps_wall_time() {
            true => std::future::pending().await,
            false => tokio::time::sleep(std::time::Duration::from_millis(wall_ms)).await,
        }
    };
    // An instruction queued for the turn is journaled as it arrives
    // (`steer_received`); the guest takes it at its next boundary. Never
    // ends: the agent's own branch does.
    let announcing = async {
        loop {
            steered.notified().await;
            if let Err(e) = host.announce_instructions().await {
                tracing::debug!(error = %e, "announcing instructions failed; the next take announces them");
            }
        }
    };
    tokio::select! {
        biased;
        _ = lost_or_suspended => Race::Lost,
        _ = host.aborted() => Race::Aborted,
        _ = forced => {
            tracing::warn!(grace_ms = grace.as_millis() as u64, "run ignored its stop past the grace; interrupted");
            Race::Forced(grace.as_millis() as u64)
        }
        _ = shared.abort_runs.cancelled() => Race::ShutDown,
        _ = wall => Race::Wall(wall_ms),
        _ = host.journal_gave_up() => Race::JournalGaveUp,
        _ = announcing => unreachable!("announcing never ends"),
        r = agent.run(host, input) => {
            // An agent of a resumed run that ends before making every
            // recorded call again behaves otherwise than it did (the host
            // records the divergence as its failure).
            if matches!(r, Ok(_) | Err(AgentError::Failed { .. })) && !cancel.is_cancelled() {
                host.check_replayed();
            }
            Race::Returned(r)
        }
    }
}

/// Writes an ending (fenced): the message, the run, its `complete`.
async fn finalize(shared: &Shared, row: &ClaimedRun, end: End, streamed: String, usage: Option<Usage>) -> Outcome {
    let assistant = end.assistant(streamed);
    let End { status, error, reason, .. } = end;
    // What the agent said must be storable (U+0000 from a guest or a model).
    let mut replaced = 0;
    let mut storable = |s: String| {
        replaced += text::nul_count(&s);
        text::storable(&s).into_owned()
    };
    // Bounded wherever it is stored (the message, the run, its `complete`
    // event, a webhook) and fed back (every later turn's history): cut with
    // a marker, never a failure of the store.
    let error = error.map(|e| text::cut(&e, text::ERROR_BYTES_MAX).into_owned()).map(&mut storable);
    let assistant = assistant.map(|(t, s)| (storable(text::cut(&t, text::ANSWER_BYTES_MAX).into_owned()), s));
    if replaced > 0 {
        shared.journal_stats.nul_replaced.fetch_add(replaced as u64, Ordering::Relaxed);
    }
    let traced = (error.clone(), usage.map(|u| (u.model_calls, u.prompt_tokens, u.completion_tokens)));
    let usage = usage.map(|u| serde_json::to_value(u).expect("usage serializes"));
    let ending = Ending { run: row.id, token: row.claim_token, status, error, assistant, usage };
    // No more heartbeats for a run that is ending: one landing after our
    // terminal write would find the claim gone and cry wolf.
    let slot = release(shared, row.id, row.claim_token).map(|h| h.slot);
    match group_commit(shared, ending, slot).await {
        Ok(true) => {
            shared.stats.record_end(status, reason);
            crate::telemetry::run_ended(status.as_str(), traced.0.as_deref(), traced.1);
            Outcome::Finalized
        }
        // Zero rows: someone else ended this run. Stand down.
        Ok(false) => Outcome::Lost,
        Err(e) => {
            // The driver's text goes to the log, not to the run's error: clients read that.
            tracing::error!(error = %e, "terminal write failed");
            Outcome::Unfinalized(FailReason::Host.message("the run's ending could not be written"))
        }
    }
}

/// The terminal write, group-committed with the endings of runs that end
/// in the same window (see `finisher`). Should the finisher be gone (a
/// worker dropped without its drain), the ending is written on its own.
async fn group_commit(shared: &Shared, ending: Ending, slot: Option<super::Slot>) -> Result<bool, sqlx::Error> {
    let (reply, answer) = tokio::sync::oneshot::channel();
    let request = super::Request { ending: ending.clone(), reply, slot };
    if shared.finisher.send(request).await.is_ok() {
        if let Ok(written) = answer.await {
            return written;
        }
    }
    Ok(!db::lifecycle::finish_many(&shared.pool, std::slice::from_ref(&ending)).await?.is_empty())
}

/// The recording of a resumable run: its call log and what its earlier
/// attempts journaled (nothing to read on a first attempt, unless the run is
/// a fork: its log was copied from the original).
async fn recording(
    shared: &Shared,
    row: &ClaimedRun,
    lost: &CancellationToken,
    manifest: &crate::run::manifest::Manifest,
) -> Result<Recording, sqlx::Error> {
    let (log, journaled, decisions) = if row.attempt > 1 || row.forked {
        let mut db = shared.pool.acquire().await?;
        let log = db::calls::log(&mut *db, row.id).await?;
        (log, db::calls::journaled(&mut db, row.id).await?, db::suspensions::decided(&mut db, row.id).await?)
    } else {
        Default::default()
    };
    Ok(Recording::new(RecordingParts {
        pool: shared.pool.clone(),
        run_id: row.id,
        token: row.claim_token,
        attempt: row.attempt,
        lost: lost.clone(),
        log,
        journaled,
        max: manifest.limits.recorded_calls_max,
        seed: row.seed,
        decisions: decisions.into_iter().collect(),
    }))
}

/// A drain out of budget with a resumable run still going: what is
/// journaled is flushed, then the run goes back to the queue (fenced) for
/// another process to resume at once. Out of attempts, it ends failed.
async fn hand_back(shared: &Shared, row: &ClaimedRun, host: &RunHost) -> Outcome {
    let (streamed, flushed) = host.close().await;
    if flushed == Err(HostError::Fenced) {
        return Outcome::Lost;
    }
    release(shared, row.id, row.claim_token);
    let attempts = shared.config.resume_attempts;
    shared.stats.replayed_calls.fetch_add(host.replayed(), Ordering::Relaxed);
    match db::lifecycle::hand_back(&shared.pool, row.id, row.claim_token, attempts).await {
        Ok(true) => Outcome::HandedBack,
        // Out of attempts, a stop requested meanwhile, or no longer ours
        // (the fenced finish then writes nothing).
        Ok(false) => {
            let e = match (row.attempt - row.waits) as u32 >= attempts {
                true => AgentError::failed(
                    FailReason::Attempts,
                    format!(
                        "the host shut down before the run finished, on attempt {} of {attempts}",
                        row.attempt - row.waits
                    ),
                ),
                false => AgentError::failed(FailReason::DrainTimeout, "the host shut down before the run finished"),
            };
            finalize(shared, row, ended(Err(e)), streamed, host.usage()).await
        }
        Err(e) => {
            tracing::error!(error = %e, "handing the run back failed; the reaper will requeue it");
            Outcome::Lost
        }
    }
}

/// A run that could not start here. A resumable one whose start failed on
/// the host's side (the database away, the engine) goes back to the queue
/// (an attempt counted) instead of failing; anything else ends as it says.
async fn start_failed(shared: &Shared, row: &ClaimedRun, e: AgentError) -> Outcome {
    if resumable(row) && e.reason() == FailReason::Host {
        tracing::warn!(error = %e, "a resumable run could not start here; handing it back");
        release(shared, row.id, row.claim_token);
        match db::lifecycle::hand_back(&shared.pool, row.id, row.claim_token, shared.config.resume_attempts).await {
            Ok(true) => return Outcome::HandedBack,
            Ok(false) => {}
            // The database is still away: the lease lapses and the reaper requeues it.
            Err(_) => return Outcome::Lost,
        }
    }
    finalize(shared, row, ended(Err(e)), String::new(), None).await
}

/// Drops this claim's `held` entry (no more heartbeats, and its slot, for the
/// finisher), if the entry is still this claim's: a run put back in the
/// queue (a resumable run whose lease lapsed) can be claimed again by this
/// process while its old task stands down, and the new claim's entry,
/// under its new token, must stay.
fn release(shared: &Shared, run: db::RunId, token: db::ClaimToken) -> Option<Held> {
    let mut held = shared.held.lock().unwrap();
    match held.get(&run) {
        Some(h) if h.token == token => held.remove(&run),
        _ => None,
    }
}

/// The tenant whose own plugin the run executes: its tenant, unless the
/// name it asked for resolves, as the enqueue resolved it (the tenant's own
/// first), to a plugin the operator published with the pinned digest (or
/// it runs a built-in agent, which the operator offers). The same bytes
/// uploaded under a tenant's own name are that tenant's.
async fn plugin_tenant(shared: &Shared, row: &ClaimedRun) -> Result<Option<String>, sqlx::Error> {
    let Some(digest) = row.plugin_digest.as_deref() else { return Ok(None) };
    let published = db::plugins::is_published_as(&shared.pool, &row.plugin, digest, &row.tenant_id).await?;
    Ok((!published).then(|| row.tenant_id.clone()))
}

/// Whether the run's pinned manifest says it is resumable.
fn resumable(row: &ClaimedRun) -> bool {
    row.plugin_manifest.as_ref().and_then(|m| m.get("durability")).and_then(|d| d.as_str()) == Some("resume")
}
