//! Per-tenant quotas and rate limits, configured by the operator (off by
//! default, but for streams):
//!
//! - queued runs a tenant may have at most, across all processes: checked in
//!   the enqueue transaction under a per-tenant lock (`db::lifecycle`), so
//!   two processes cannot both take the last place and a refusal writes
//!   nothing;
//! - enqueues per second per tenant: a token bucket (`governor`'s GCRA) in
//!   each process. A burst past it is shaped: a request waits for its token
//!   up to [`SHAPE_WAIT_MAX`]; only one that would wait longer is refused;
//! - live streams and waits per user and per tenant, counted in each process
//!   (see [`StreamGuard`]): an SSE stream, a Responses stream and a blocking
//!   Responses request each hold one place while they last. On by default
//!   (`--user-max-streams`, `--tenant-max-streams`).
//!
//! Past a limit the caller gets a [`QuotaExceeded`] (the API answers 429
//! `quota_exceeded` with `Retry-After`), counted by tenant and limit for
//! `/metrics`.

use std::collections::HashMap;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::Clock;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

/// Longest a request waits for its enqueue token before it is refused.
pub const SHAPE_WAIT_MAX: Duration = Duration::from_secs(2);
/// Seconds a client refused for a full queue is told to wait.
pub const QUEUE_RETRY_AFTER_S: u32 = 1;
/// Seconds a client refused for too many streams is told to wait.
pub const STREAMS_RETRY_AFTER_S: u32 = 5;
/// Tenants whose refusals `/metrics` counts separately at most (the rest
/// count under `tenant="other"`), so a label set stays bounded.
pub const METRIC_TENANTS_MAX: usize = 1000;

/// Which limit refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    QueuedRuns,
    EnqueueRate,
    UserStreams,
    TenantStreams,
}

impl Limit {
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::QueuedRuns => "queued_runs",
            Limit::EnqueueRate => "enqueue_rate",
            Limit::UserStreams => "user_streams",
            Limit::TenantStreams => "tenant_streams",
        }
    }
}

/// A request past a limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct QuotaExceeded {
    pub limit: Limit,
    pub message: String,
    pub retry_after_s: u32,
}

/// The operator's limits (`--tenant-max-queued`, `--tenant-enqueue-per-s`,
/// `--tenant-enqueue-burst`, `--user-max-streams`); `None`: off.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuotaConfig {
    pub tenant_max_queued: Option<u32>,
    pub tenant_enqueue_per_s: Option<NonZeroU32>,
    /// The bucket's size (default: one second's worth).
    pub tenant_enqueue_burst: Option<NonZeroU32>,
    pub user_max_streams: Option<u32>,
    pub tenant_max_streams: Option<u32>,
}

/// Live streams and waits one user may hold on one process, by default.
pub const USER_MAX_STREAMS_DEFAULT: u32 = 64;
/// Live streams and waits one tenant's users may hold on one process, by default.
pub const TENANT_MAX_STREAMS_DEFAULT: u32 = 1000;

/// The process's quota state: the config, the rate buckets, the live
/// streams per user and the refusal counts.
#[derive(Clone, Default)]
pub struct Quotas {
    pub config: QuotaConfig,
    limiter: Option<Arc<DefaultKeyedRateLimiter<String>>>,
    streams: Arc<Mutex<HashMap<String, u32>>>,
    refused: Arc<Mutex<HashMap<(String, Limit), u64>>>,
}

impl fmt::Debug for Quotas {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Quotas").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Quotas {
    pub fn new(config: QuotaConfig) -> Quotas {
        let limiter = config.tenant_enqueue_per_s.map(|rate| {
            let quota = Quota::per_second(rate).allow_burst(config.tenant_enqueue_burst.unwrap_or(rate));
            Arc::new(RateLimiter::keyed(quota))
        });
        Quotas { config, limiter, ..Quotas::default() }
    }

    /// Takes one enqueue token for `tenant`, waiting for it up to
    /// [`SHAPE_WAIT_MAX`] (a burst is shaped, not failed).
    pub async fn enqueue_token(&self, tenant: &str) -> Result<(), QuotaExceeded> {
        self.enqueue_token_within(tenant, SHAPE_WAIT_MAX).await
    }

    /// Takes one enqueue token for `tenant`, waiting for it up to `wait_max`
    /// (zero: refused at once when there is none).
    pub async fn enqueue_token_within(&self, tenant: &str, wait_max: Duration) -> Result<(), QuotaExceeded> {
        let Some(limiter) = &self.limiter else { return Ok(()) };
        let key = tenant.to_string();
        // Bounded in time: each round takes the token or sleeps until it
        // frees (others may take it first); past the deadline, refused.
        let deadline = tokio::time::Instant::now() + wait_max;
        loop {
            let wait = match limiter.check_key(&key) {
                Ok(()) => return Ok(()),
                Err(not_until) => not_until.wait_time_from(limiter.clock().now()).max(Duration::from_millis(1)),
            };
            if tokio::time::Instant::now() + wait > deadline {
                return Err(self.refuse(
                    tenant,
                    Limit::EnqueueRate,
                    format!("tenant {tenant:?} is enqueueing faster than its rate limit allows"),
                    wait.as_secs_f64().ceil().max(1.0) as u32,
                ));
            }
            // Shaping: the request is delayed until its token exists.
            tokio::time::sleep(wait).await;
        }
    }

    /// A live stream (or a wait) for `user` of `tenant`, if under the
    /// per-user and per-tenant bounds; dropping the guard gives the place back.
    pub fn stream(&self, tenant: &str, user: &str) -> Result<StreamGuard, QuotaExceeded> {
        let (user_key, tenant_key) = (format!("u:{user}"), format!("t:{tenant}"));
        let mut streams = self.streams.lock().unwrap();
        let held = |k: &str| streams.get(k).copied().unwrap_or(0);
        let refusal = match (self.config.user_max_streams, self.config.tenant_max_streams) {
            (Some(max), _) if held(&user_key) >= max => Some((
                Limit::UserStreams,
                format!("user {user:?} has {max} live streams on this process, the most allowed"),
            )),
            (_, Some(max)) if held(&tenant_key) >= max => Some((
                Limit::TenantStreams,
                format!("tenant {tenant:?} has {max} live streams on this process, the most allowed"),
            )),
            _ => None,
        };
        if let Some((limit, message)) = refusal {
            drop(streams);
            return Err(self.refuse(tenant, limit, message, STREAMS_RETRY_AFTER_S));
        }
        *streams.entry(user_key.clone()).or_default() += 1;
        *streams.entry(tenant_key.clone()).or_default() += 1;
        Ok(StreamGuard { streams: self.streams.clone(), keys: [user_key, tenant_key] })
    }

    /// The refusal of `limit` for `tenant`, counted.
    pub fn refuse(&self, tenant: &str, limit: Limit, message: String, retry_after_s: u32) -> QuotaExceeded {
        let mut refused = self.refused.lock().unwrap();
        let known = refused.len() < METRIC_TENANTS_MAX || refused.contains_key(&(tenant.to_string(), limit));
        let label = if known { tenant.to_string() } else { "other".to_string() };
        *refused.entry((label, limit)).or_default() += 1;
        QuotaExceeded { limit, message, retry_after_s }
    }

    /// Refusals so far: (tenant, limit, count), for `/metrics`.
    pub fn refusals(&self) -> Vec<(String, &'static str, u64)> {
        let refused = self.refused.lock().unwrap();
        let mut v: Vec<_> = refused.iter().map(|((t, l), n)| (t.clone(), l.as_str(), *n)).collect();
        v.sort();
        v
    }
}

/// One live stream (or wait) of a user and its tenant; its drop gives both
/// places back.
pub struct StreamGuard {
    streams: Arc<Mutex<HashMap<String, u32>>>,
    keys: [String; 2],
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let mut streams = self.streams.lock().unwrap();
        for key in &self.keys {
            if let Some(n) = streams.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    streams.remove(key);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_per_user_are_bounded_and_given_back() {
        let q = Quotas::new(QuotaConfig { user_max_streams: Some(1), ..QuotaConfig::default() });
        let first = q.stream("t", "alice").unwrap();
        assert_eq!(q.stream("t", "alice").err().unwrap().limit, Limit::UserStreams);
        let _bob = q.stream("t", "bob").unwrap();
        drop(first);
        let _again = q.stream("t", "alice").unwrap();
        assert_eq!(q.refusals(), vec![("t".to_string(), "user_streams", 1)]);
    }

    #[test]
    fn streams_per_tenant_are_bounded_across_its_users() {
        let q = Quotas::new(QuotaConfig { tenant_max_streams: Some(2), ..QuotaConfig::default() });
        let a = q.stream("evil", "a").unwrap();
        let _b = q.stream("evil", "b").unwrap();
        assert_eq!(q.stream("evil", "c").err().unwrap().limit, Limit::TenantStreams);
        let _good = q.stream("good", "g").unwrap();
        drop(a);
        let _c = q.stream("evil", "c").unwrap();
    }
}
