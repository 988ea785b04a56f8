//! Every NOTIFY channel the host uses, defined once. Signals are hints; rows
//! are truth: each channel has a row behind it that its listeners re-read.

use sqlx::PgExecutor;

use super::RunId;

/// Every enqueue and every terminal write that leaves a turn waiting NOTIFYs
/// here (the wake chain); the payload is the conversation id.
pub const RUN_ENQUEUED: &str = "run_enqueued";

/// One channel for every cancel, the run id as payload: each process LISTENs
/// once, instead of a LISTEN/UNLISTEN round trip per run it claims.
pub const RUN_CANCEL: &str = "run_cancel";

/// The payload of a run's events channel when its `complete` is written.
pub const COMPLETE_PAYLOAD: &str = "complete";

/// The channel a run's tails listen on: one NOTIFY per journal flush (the
/// payload is the last seq written) and one at the run's ending.
pub fn events_channel(run: RunId) -> String {
    format!("run_events_{}", run.0.simple())
}

/// `pg_notify` inside the caller's transaction: fires on commit or never.
pub async fn notify(db: impl PgExecutor<'_>, channel: &str, payload: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, $2)").bind(channel).bind(payload).execute(db).await?;
    Ok(())
}
