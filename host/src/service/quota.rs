//! Per-tenant quotas and rate limits, configured by the operator, every one
//! off by default:
//!
//! - queued runs a tenant may have at most, across all processes: checked in
//!   the enqueue transaction under a per-tenant lock (`db::lifecycle`), so
//!   two processes cannot both take the last place and a refusal writes
//!   nothing;
//! - enqueues per second per tenant: a token bucket (`governor`'s GCRA) in
//!   each process. A burst past it is shaped: a request waits for its token
//!   up to [`SHAPE_WAIT_MAX`]; only one that would wait longer is refused;
//! - live streams per user, counted in each process (see [`StreamGuard`]).
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
}

impl Limit {
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::QueuedRuns => "queued_runs",
            Limit::EnqueueRate => "enqueue_rate",
            Limit::UserStreams => "user_streams",
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
}

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

    /// A live stream for `user` (of `tenant`), if under the per-user bound;
    /// dropping the guard gives the place back.
    pub fn stream(&self, tenant: &str, user: &str) -> Result<StreamGuard, QuotaExceeded> {
        let mut streams = self.streams.lock().unwrap();
        let n = streams.entry(user.to_string()).or_default();
        if let Some(max) = self.config.user_max_streams {
            if *n >= max {
                drop(streams);
                return Err(self.refuse(
                    tenant,
                    Limit::UserStreams,
                    format!("user {user:?} has {max} live streams on this process, the most allowed"),
                    STREAMS_RETRY_AFTER_S,
                ));
            }
        }
        *n += 1;
        Ok(StreamGuard { streams: self.streams.clone(), user: user.to_string() })
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

/// One live stream of a user; its drop gives the place back.
pub struct StreamGuard {
    streams: Arc<Mutex<HashMap<String, u32>>>,
    user: String,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let mut streams = self.streams.lock().unwrap();
        if let Some(n) = streams.get_mut(&self.user) {
            *n -= 1;
            if *n == 0 {
                streams.remove(&self.user);
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
}
