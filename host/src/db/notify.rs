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

/// One channel for every steer (an instruction queued for a run), the run id
/// as payload: the process holding the run journals `steer_received`.
pub const RUN_STEER: &str = "run_steer";

/// The payload of a run's events channel when its `complete` is written.
pub const COMPLETE_PAYLOAD: &str = "complete";

/// The one channel every journal group commit NOTIFYs, once per commit:
/// the payload lists the runs it wrote ([`run_events_payload`]), or is
/// [`RUN_EVENTS_ALL`] when they do not fit. Each process LISTENs on it once
/// and its hub fans a notification out to the subscribers of each listed
/// run's [`events_channel`]: a commit of a thousand runs' rows is one
/// NOTIFY, not a thousand (PostgreSQL serialises the commits of
/// transactions that NOTIFY on one global lock).
pub const RUN_EVENTS: &str = "run_events";

/// The [`RUN_EVENTS`] payload meaning "every run": the commit wrote more runs
/// than one payload lists.
pub const RUN_EVENTS_ALL: &str = "*";

/// Run ids one [`RUN_EVENTS`] payload lists at most: 32 hex digits and a
/// comma each, well under PostgreSQL's 8000-byte payload limit.
pub const RUN_EVENTS_IDS_MAX: usize = 200;

/// The channel a run's tails subscribe to on the hub. Group commits reach
/// it through [`RUN_EVENTS`] (the hub fans those out by run id); the run's
/// ending, suspension and decisions NOTIFY it directly, once each.
pub fn events_channel(run: RunId) -> String {
    format!("{EVENTS_CHANNEL_PREFIX}{}", run.0.simple())
}

/// What every [`events_channel`] starts with.
pub const EVENTS_CHANNEL_PREFIX: &str = "run_events_";

/// The runs one [`RUN_EVENTS`] payload names: `None` for [`RUN_EVENTS_ALL`]
/// (every run); ids that do not parse are skipped.
pub fn run_events_payload(payload: &str) -> Option<Vec<&str>> {
    if payload == RUN_EVENTS_ALL {
        return None;
    }
    Some(payload.split(',').filter(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())).collect())
}

/// `pg_notify` inside the caller's transaction: fires on commit or never.
pub async fn notify(db: impl PgExecutor<'_>, channel: &str, payload: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, $2)").bind(channel).bind(payload).execute(db).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_events_payload_names_runs_or_all() {
        let a = "0123456789abcdef0123456789abcdef";
        let b = "fedcba9876543210fedcba9876543210";
        assert_eq!(run_events_payload(&format!("{a},{b}")), Some(vec![a, b]));
        assert_eq!(run_events_payload(&format!("{a},nope")), Some(vec![a]));
        assert_eq!(run_events_payload(RUN_EVENTS_ALL), None);
        // The most a payload lists stays under PostgreSQL's 8000-byte limit.
        assert!(RUN_EVENTS_IDS_MAX * 33 < 8000);
    }
}
