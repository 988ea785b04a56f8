//! Schedules as a service: checking a cron expression and time zone, the
//! next firing, and firing what is due (every process's scheduler loop calls
//! [`fire_due`]). A firing enqueues through [`super::submit`] with the
//! firing's time as the idempotency key, so however many processes fire a
//! schedule, each firing is one run; a schedule whose firings were missed
//! while every process was down fires once, then goes on from now.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use serde_json::json;
use sqlx::PgPool;

use crate::agent::AgentRegistry;
use crate::db::enqueue::Owner;
use crate::db::schedules::{self, NewSchedule, Schedule};
use crate::db::ConversationId;

use super::submit::{self, Busy, LocalWorker, Policy, Submission, SubmitError, CONFIG_BYTES_MAX, CONTENT_CHARS_MAX};
use crate::text;

/// Schedules one pass fires at most (the next pass takes the rest).
pub const FIRE_BATCH_MAX: i64 = 100;
/// Due schedules one pass looks at to share its batch fairly among their
/// tenants (each tenant's oldest first, then the next of each, ...).
pub const FIRE_SCAN_MAX: i64 = 10 * FIRE_BATCH_MAX;
/// How long a firing a quota held waits before it is tried again: it does
/// not keep its place at the head of every pass.
pub const HELD_BACKOFF: Duration = Duration::from_secs(30);
pub use super::submit::{SchedulePolicy, MIN_INTERVAL_DEFAULT, TENANT_MAX_SCHEDULES_DEFAULT};

/// Firings of a new schedule checked against the minimum interval.
const INTERVAL_CHECKS: usize = 16;

/// The shortest gap between the next [`INTERVAL_CHECKS`] firings of `cron`
/// in `timezone` after `after` (`None`: it fires less often than that).
fn shortest_gap(cron: &str, timezone: &str, after: DateTime<Utc>) -> Result<Option<chrono::Duration>, String> {
    let (schedule, tz) = (parse_cron(cron)?, parse_timezone(timezone)?);
    let times: Vec<_> = schedule.after(&after.with_timezone(&tz)).take(INTERVAL_CHECKS).collect();
    Ok(times.windows(2).map(|w| w[1].clone() - w[0].clone()).min())
}
/// Bytes of a cron expression.
const CRON_BYTES_MAX: usize = 200;

/// A cron expression with seconds (`sec min hour day month weekday [year]`),
/// or the common five fields (`min hour day month weekday`, firing at second 0).
fn parse_cron(cron: &str) -> Result<cron::Schedule, String> {
    if cron.len() > CRON_BYTES_MAX {
        return Err(format!("cron is at most {CRON_BYTES_MAX} bytes"));
    }
    let fields = cron.split_whitespace().count();
    let full = if fields == 5 { format!("0 {cron}") } else { cron.to_string() };
    cron::Schedule::from_str(&full).map_err(|e| format!("cron {cron:?}: {e}"))
}

fn parse_timezone(tz: &str) -> Result<Tz, String> {
    tz.parse::<Tz>().map_err(|_| format!("timezone {tz:?} is not an IANA time zone name"))
}

/// The first firing of `cron` in `timezone` strictly after `after`.
pub fn next_after(cron: &str, timezone: &str, after: DateTime<Utc>) -> Result<Option<DateTime<Utc>>, String> {
    let (schedule, tz) = (parse_cron(cron)?, parse_timezone(timezone)?);
    Ok(schedule.after(&after.with_timezone(&tz)).next().map(|t| t.with_timezone(&Utc)))
}

/// A schedule as a client asks for it.
#[derive(Debug, Clone)]
pub struct ScheduleRequest {
    pub owner: Owner,
    pub plugin: String,
    pub content: String,
    pub config: Option<serde_json::Value>,
    pub conversation_id: Option<ConversationId>,
    pub cron: String,
    pub timezone: Option<String>,
    pub webhook: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Checks and stores a schedule; the first firing is the next after now.
pub async fn create(
    pool: &PgPool,
    agents: &AgentRegistry,
    policy: &Policy,
    r: &ScheduleRequest,
) -> Result<Schedule, ScheduleError> {
    let invalid = ScheduleError::Invalid;
    for (field, value) in [("content", &r.content), ("plugin", &r.plugin), ("cron", &r.cron)] {
        text::refuse_text(field, value).map_err(|e| invalid(e.to_string()))?;
    }
    if r.content.trim().is_empty() || r.content.chars().count() > CONTENT_CHARS_MAX {
        return Err(invalid(format!("content must be 1 to {CONTENT_CHARS_MAX} characters")));
    }
    let config = r.config.clone().unwrap_or_else(|| json!({}));
    text::refuse_json("config", &config).map_err(|e| invalid(e.to_string()))?;
    if !config.is_object() || config.to_string().len() > CONFIG_BYTES_MAX {
        return Err(invalid(format!("config must be a JSON object of at most {CONFIG_BYTES_MAX} bytes")));
    }
    if !agents.contains(&r.plugin) && crate::db::plugins::resolve(pool, &r.owner.tenant_id, &r.plugin).await?.is_none()
    {
        return Err(invalid(format!("unknown plugin {:?}", r.plugin)));
    }
    if let Some(url) = &r.webhook {
        if !policy.allows_webhook(url) {
            return Err(invalid(format!("webhook {url:?} is not under a URL prefix the operator allows")));
        }
    }
    if let Some(c) = r.conversation_id {
        if !crate::db::conversations::owned(pool, c, &r.owner.user_id).await? {
            return Err(invalid(format!("conversation {c} not found")));
        }
    }
    let timezone = r.timezone.clone().unwrap_or_else(|| "UTC".into());
    let next = next_after(&r.cron, &timezone, Utc::now())
        .map_err(invalid)?
        .ok_or_else(|| invalid(format!("cron {:?} never fires", r.cron)))?;
    let min = policy.schedules.min_interval;
    if let Some(gap) = shortest_gap(&r.cron, &timezone, Utc::now()).map_err(invalid)? {
        if gap.to_std().unwrap_or_default() < min {
            return Err(invalid(format!(
                "cron {:?} fires every {} s; the shortest interval this host allows is {} s",
                r.cron,
                gap.num_seconds(),
                min.as_secs()
            )));
        }
    }
    let new = NewSchedule {
        owner: &r.owner,
        plugin: &r.plugin,
        content: &r.content,
        config: &config,
        conversation_id: r.conversation_id,
        cron: &r.cron,
        timezone: &timezone,
        webhook: r.webhook.as_deref(),
        next_fire_at: next,
    };
    // The tenant's cap, counted under its lock: two creates cannot both
    // take the last place.
    let mut tx = pool.begin().await?;
    let held = schedules::count_for_tenant_locked(&mut tx, &r.owner.tenant_id).await?;
    let max = policy.schedules.tenant_max;
    if held >= i64::from(max) {
        return Err(invalid(format!(
            "tenant {:?} has {held} schedules, the most this host allows ({max}); delete one first",
            r.owner.tenant_id
        )));
    }
    let created = schedules::create(&mut *tx, &new).await?;
    tx.commit().await?;
    Ok(created)
}

/// Fires every due schedule once (at most [`FIRE_BATCH_MAX`]): one run each,
/// keyed by the firing's time, then the next firing after now. Returns the
/// firings made. With `local`, the firing process's worker: a run may
/// start in its enqueue there ([`submit::submit`]).
pub async fn fire_due(
    pool: &PgPool,
    agents: &AgentRegistry,
    policy: &Policy,
    local: Option<&dyn LocalWorker>,
) -> Result<usize, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let due = schedules::due(&mut tx, FIRE_BATCH_MAX, FIRE_SCAN_MAX).await?;
    // The database's clock, the one `due` compared with: a host clock behind
    // it would fire again at once, one ahead would skip a firing.
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()").fetch_one(&mut *tx).await?;
    // A schedule fires for its owner only while the owner holds a valid
    // token: once every token of theirs is revoked or expired, it pauses.
    let owners: Vec<String> = due.iter().map(|d| d.owner_id.clone()).collect();
    let valid = crate::db::tokens::users_with_valid_tokens(&mut *tx, &owners).await?;
    for due in &due {
        let s = &due.schedule;
        if !valid.contains(&due.owner_id) {
            tracing::warn!(schedule = %s.id, owner = %due.owner_id, "a schedule's owner has no valid token; pausing it");
            schedules::pause_orphaned(&mut tx, s.id).await?;
            let actor = crate::db::audit::Actor { user: "host".into(), tenant: None, token: None };
            let detail = json!({ "reason": "its owner has no valid token" });
            let action = crate::db::audit::action::SCHEDULE_PAUSED;
            crate::db::audit::record(&mut *tx, &actor, action, Some(&due.tenant_id), &s.id.to_string(), detail).await?;
            continue;
        }
        let fire_at = s.next_fire_at;
        let submission = Submission {
            owner: Owner { user_id: due.owner_id.clone(), tenant_id: due.tenant_id.clone() },
            conversation_id: s.conversation_id,
            content: s.content.clone(),
            plugin: s.plugin.clone(),
            config: Some(s.config.clone()),
            // The firing's identity: one run per firing, whoever fires it.
            idempotency_key: Some(format!("schedule-{}-{}", s.id, fire_at.timestamp_micros())),
            webhook: s.webhook.clone(),
            strategy: Busy::Enqueue,
            parent: None,
        };
        // No waiting for a rate token here: the schedules' rows are locked.
        let run = match submit::submit_within(pool, agents, policy, &submission, Duration::ZERO, local).await {
            Ok(submitted) => Some(submitted.enqueued().run_id),
            // Not fired: tried again next tick; the other schedules go on.
            Err(SubmitError::Db(e)) => {
                tracing::warn!(schedule = %s.id, error = %e, "a schedule's firing failed; trying again next tick");
                continue;
            }
            // Past a tenant quota (counted in /metrics): tried again after a
            // backoff, not dropped; meanwhile it does not head every pass.
            Err(SubmitError::Quota(e)) => {
                tracing::info!(schedule = %s.id, error = %e.message, "a schedule's firing is held by a quota; trying again after a backoff");
                let again = now + chrono::Duration::from_std(HELD_BACKOFF).expect("a short backoff");
                schedules::hold(&mut tx, s.id, again).await?;
                continue;
            }
            Err(e) => {
                tracing::warn!(schedule = %s.id, error = %e, "a schedule's firing was refused; it fires again next time");
                None
            }
        };
        // Missed firings collapse into this one: the next is after now.
        let next = next_after(&s.cron, &s.timezone, now.max(fire_at)).ok().flatten();
        schedules::fired(&mut tx, s.id, fire_at, run, next).await?;
    }
    tx.commit().await?;
    Ok(due.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn five_fields_fire_at_second_zero_and_time_zones_count() {
        let t = DateTime::parse_from_rfc3339("2026-03-01T10:15:30Z").unwrap().with_timezone(&Utc);
        let next = next_after("*/5 * * * *", "UTC", t).unwrap().unwrap();
        assert_eq!(next.to_rfc3339(), "2026-03-01T10:20:00+00:00");
        let next = next_after("* * * * * *", "UTC", t).unwrap().unwrap();
        assert_eq!(next.to_rfc3339(), "2026-03-01T10:15:31+00:00");
        // 09:00 in Oslo (UTC+1 in March) is 08:00 UTC.
        let next = next_after("0 9 * * *", "Europe/Oslo", t).unwrap().unwrap();
        assert_eq!(next.to_rfc3339(), "2026-03-02T08:00:00+00:00");
        assert!(next_after("nonsense", "UTC", t).unwrap_err().contains("cron"));
        assert!(next_after("* * * * *", "Mars/Olympus", t).unwrap_err().contains("timezone"));
    }
}
