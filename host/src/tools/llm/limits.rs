//! The model-call limits every process on the database shares (`[[limit]]`
//! in the tools file), from the caller's side: before each attempt the call
//! takes a lease of every limit that applies to its provider and model,
//! waiting its turn (in arrival order, across processes and tenants) while
//! the run keeps its slot and its claim; the wait is journaled
//! (`model_wait`) and counted. A provider's 429 with Retry-After pauses the
//! limit for every process. The SQL is `db::model_limits`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::db::events::MODEL_WAIT;
use crate::db::model_limits::{self, Bounds, Poll};
use crate::error::HostError;
use crate::metrics::{label_value, Exposition, Histogram};
use crate::tools::models::{BudgetConfig, LimitConfig};
use crate::tools::{EventSink, ToolCall};

/// How long a waiting row lives without a poll (a waiter polls at least
/// every [`POLL_MAX`]).
const HEARTBEAT_MS: i64 = 10_000;
/// The longest pause between two polls of a waiting call, and the pause
/// when nothing says when the limit frees (a concurrent call must end).
const POLL_MAX: Duration = Duration::from_millis(1000);
const POLL_UNKNOWN: Duration = Duration::from_millis(100);
const POLL_MIN: Duration = Duration::from_millis(5);

/// What this process's model calls did, for `/metrics`.
#[derive(Default)]
pub struct ModelStats {
    /// Attempts by (provider, outcome).
    attempts: Mutex<BTreeMap<(String, String), u64>>,
    /// Calls that had to wait for a shared limit.
    pub waits: AtomicU64,
    pub wait_seconds: Histogram,
    /// Pauses a provider's Retry-After put on a shared limit.
    pub pauses: AtomicU64,
    /// Runs suspended because a shared limit would hold their call too long.
    pub suspensions: AtomicU64,
    /// Calls refused at a tenant's daily token budget.
    pub budget_refusals: AtomicU64,
    /// Reported usage by (provider, model).
    used: Mutex<BTreeMap<(String, String), Used>>,
}

/// What the calls of one provider model used, as reported.
#[derive(Default, Clone, Copy)]
struct Used {
    prompt: u64,
    completion: u64,
    cached: u64,
    cost_usd: f64,
}

impl ModelStats {
    pub fn attempt(&self, provider: &str, outcome: &str) {
        *self.attempts.lock().unwrap().entry((provider.to_string(), outcome.to_string())).or_default() += 1;
    }

    /// Counts one call's reported usage and cost.
    pub fn used(&self, provider: &str, model: &str, u: &super::Usage) {
        let mut used = self.used.lock().unwrap();
        let e = used.entry((provider.to_string(), model.to_string())).or_default();
        e.prompt += u.prompt_tokens;
        e.completion += u.completion_tokens;
        e.cached += u.cached_tokens;
        e.cost_usd += u.cost_usd.unwrap_or(0.0);
    }

    pub fn write(&self, e: &mut Exposition) {
        let used: Vec<((String, String), Used)> =
            self.used.lock().unwrap().iter().map(|(k, v)| (k.clone(), *v)).collect();
        let labels = |p: &str, m: &str| format!("provider=\"{}\",model=\"{}\"", label_value(p), label_value(m));
        let mut tokens = Vec::new();
        for ((p, m), u) in &used {
            for (kind, n) in [("prompt", u.prompt), ("completion", u.completion), ("cached_prompt", u.cached)] {
                tokens.push((format!("{},kind=\"{kind}\"", labels(p, m)), n as f64));
            }
        }
        e.labelled(
            "agent_host_model_tokens_total",
            "counter",
            "Model tokens this process's calls used as the providers reported them, by provider, model and kind \
             (prompt, completion, cached_prompt: the prompt tokens read from the provider's cache, counted in prompt too).",
            &tokens,
        );
        let cost: Vec<(String, f64)> = used.iter().map(|((p, m), u)| (labels(p, m), u.cost_usd)).collect();
        e.labelled(
            "agent_host_model_cost_usd_total",
            "counter",
            "The cost in USD of this process's model calls by the tools file's [[price]] table, by provider and model.",
            &cost,
        );
        let samples: Vec<(String, f64)> = self
            .attempts
            .lock()
            .unwrap()
            .iter()
            .map(|((p, o), n)| (format!("provider=\"{}\",outcome=\"{}\"", label_value(p), label_value(o)), *n as f64))
            .collect();
        e.labelled(
            "agent_host_model_attempts_total",
            "counter",
            "Model call attempts this process made, by provider and outcome (ok, retry, fallback, error).",
            &samples,
        );
        e.counter(
            "agent_host_model_limit_waits_total",
            "Model calls of this process that waited for a limit shared by every process.",
            self.waits.load(Ordering::Relaxed),
        );
        e.histogram(
            "agent_host_model_limit_wait_seconds",
            "How long model calls of this process waited for shared limits.",
            &self.wait_seconds,
        );
        e.counter(
            "agent_host_model_limit_pauses_total",
            "Shared limits this process paused on a provider's 429 with Retry-After.",
            self.pauses.load(Ordering::Relaxed),
        );
        e.counter(
            "agent_host_model_limit_suspensions_total",
            "Resumable runs of this process suspended because a shared limit would hold their model call past its suspend_after_ms.",
            self.suspensions.load(Ordering::Relaxed),
        );
        e.counter(
            "agent_host_model_budget_refusals_total",
            "Model calls this process refused because they would pass one of their tenant's budgets (tokens or cost, day or month).",
            self.budget_refusals.load(Ordering::Relaxed),
        );
    }
}

/// The shared limits of the tools file, enforced once the host has a database.
pub struct Limiter {
    limits: Vec<LimitConfig>,
    budgets: Vec<BudgetConfig>,
    pool: OnceLock<PgPool>,
    /// How long a granted call may hold a concurrency slot before it is
    /// taken for dead (the model call's whole timeout).
    call_ms: i64,
    pub stats: ModelStats,
}

/// The leases one attempt holds; ended when the attempt is over, or (when
/// the call is dropped: a stop, a timeout) by a task on drop.
pub struct Lease {
    pool: Option<PgPool>,
    ids: Vec<Uuid>,
    /// How long the attempt waited for them.
    pub waited: Duration,
}

impl Lease {
    fn none() -> Self {
        Lease { pool: None, ids: Vec::new(), waited: Duration::ZERO }
    }

    /// Ends the leases; `tokens`: what the provider says the call used.
    pub async fn end(mut self, tokens: Option<i64>) {
        let (Some(pool), ids) = (self.pool.take(), std::mem::take(&mut self.ids)) else { return };
        for id in ids {
            if let Err(e) = model_limits::end(&pool, id, tokens).await {
                // The lease lapses at its expiry instead.
                tracing::warn!(error = %e, "cannot end a model-limit lease");
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let (Some(pool), false) = (self.pool.take(), self.ids.is_empty()) {
            let ids = std::mem::take(&mut self.ids);
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    for id in ids {
                        let _ = model_limits::end(&pool, id, None).await;
                    }
                });
            }
        }
    }
}

fn unavailable(e: sqlx::Error) -> HostError {
    tracing::warn!(error = %e, "model limits: the database cannot be reached");
    HostError::Unavailable("the shared model limits cannot be read (database unreachable)".into())
}

impl Limiter {
    pub fn new(limits: Vec<LimitConfig>, budgets: Vec<BudgetConfig>, call_timeout: Duration) -> Self {
        Limiter {
            limits,
            budgets,
            pool: OnceLock::new(),
            call_ms: call_timeout.as_millis().min(i64::MAX as u128) as i64,
            stats: ModelStats::default(),
        }
    }

    /// From now on the limits hold (before this, in tests without a
    /// database, they are not enforced).
    pub fn attach(&self, pool: PgPool) {
        let _ = self.pool.set(pool);
    }

    /// The limits on `provider`'s `model`: the provider's first, then the model's.
    fn applying(&self, provider: &str, model: &str) -> Vec<&LimitConfig> {
        let mut out: Vec<&LimitConfig> =
            self.limits.iter().filter(|l| l.provider == provider && l.model.is_none()).collect();
        out.extend(self.limits.iter().filter(|l| l.provider == provider && l.model.as_deref() == Some(model)));
        out
    }

    /// Whether a shared limit applies (and so takes a Retry-After's pause).
    pub fn shared(&self, provider: &str, model: &str) -> bool {
        self.pool.get().is_some() && !self.applying(provider, model).is_empty()
    }

    /// The tenant of the call's run (its owner's), once there is a database.
    pub async fn owner_of(&self, call: &ToolCall<'_>) -> Result<Option<model_limits::RunOwner>, HostError> {
        match self.pool.get() {
            Some(pool) => model_limits::run_owner(pool, call.run_id).await.map_err(unavailable),
            None => Ok(None),
        }
    }

    /// Refuses a call that would pass one of its tenant's budgets (tokens
    /// or cost, a UTC day or calendar month), a `limit` naming the budget,
    /// what was used and the limit; counted, logged and audited.
    /// `estimate`: the call's tokens (its prompt and `max_tokens`);
    /// `estimate_usd`: those at its first target's prompt price.
    pub async fn check_budget(
        &self,
        run_id: crate::db::RunId,
        tenant: Option<&str>,
        estimate: i64,
        estimate_usd: f64,
    ) -> Result<(), HostError> {
        let (Some(pool), Some(tenant)) = (self.pool.get(), tenant) else { return Ok(()) };
        let find = |t: &str| self.budgets.iter().find(|b| b.tenant == t);
        let Some(b) = find(tenant).or_else(|| find("*")) else { return Ok(()) };
        let spent = model_limits::spent(pool, tenant).await.map_err(unavailable)?;
        let clamp = |n: u64| n.min(i64::MAX as u64) as i64;
        let mut refusal = None;
        for (budget, used, limit, period) in [
            ("tokens_per_day", spent.tokens_day, b.tokens_per_day, "today"),
            ("tokens_per_month", spent.tokens_month, b.tokens_per_month, "this month"),
        ] {
            if let Some(limit) = limit.map(clamp).filter(|l| used.saturating_add(estimate) > *l) {
                refusal = Some((
                    budget,
                    json!(used),
                    json!(limit),
                    format!(
                        "budget: tenant {tenant:?} has used {used} of its {limit} model tokens {period} (UTC, \
                         {budget}); this call (about {estimate} more) would pass it"
                    ),
                ));
                break;
            }
        }
        if refusal.is_none() {
            for (budget, used, limit, period) in [
                ("cost_per_day", spent.cost_day, b.cost_per_day, "today"),
                ("cost_per_month", spent.cost_month, b.cost_per_month, "this month"),
            ] {
                if let Some(limit) = limit.filter(|l| used >= *l || used + estimate_usd > *l) {
                    refusal = Some((
                        budget,
                        json!(used),
                        json!(limit),
                        format!(
                            "budget: tenant {tenant:?} has used {used:.6} of its {limit:.6} USD {period} (UTC, \
                             {budget}); this call (about {estimate_usd:.6} more) would pass it"
                        ),
                    ));
                    break;
                }
            }
        }
        let Some((budget, used, limit, message)) = refusal else { return Ok(()) };
        self.stats.budget_refusals.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(tenant, budget, %used, %limit, estimate, "a model call refused at its tenant's budget");
        // The operator is told: an audit row of the tenant's.
        let actor = crate::db::audit::Actor { user: "host".into(), tenant: None, token: None };
        let detail = json!({
            "budget": budget,
            "used": used,
            "limit": limit,
            "estimate_tokens": estimate,
            "estimate_usd": estimate_usd,
        });
        let action = crate::db::audit::action::MODEL_BUDGET_REFUSED;
        if let Err(e) = crate::db::audit::record(pool, &actor, action, Some(tenant), &run_id.to_string(), detail).await
        {
            tracing::warn!(error = %e, "cannot audit a budget refusal");
        }
        Err(HostError::Limit(message))
    }

    /// Adds a call's reported tokens and cost to its tenant's day, and to
    /// this process's counters.
    pub async fn record(&self, owner: Option<&model_limits::RunOwner>, provider: &str, model: &str, u: &super::Usage) {
        self.stats.used(provider, model, u);
        let (Some(pool), Some(owner)) = (self.pool.get(), owner) else { return };
        let clamp = |n: u64| n.min(i64::MAX as u64) as i64;
        let cost = model_limits::CallCost {
            prompt_tokens: clamp(u.prompt_tokens),
            completion_tokens: clamp(u.completion_tokens),
            cached_tokens: clamp(u.cached_tokens),
            cost_usd: u.cost_usd.unwrap_or(0.0),
        };
        if let Err(e) = model_limits::record_usage(pool, owner, provider, model, cost).await {
            tracing::warn!(error = %e, "cannot record a model call's usage");
        }
    }

    /// Takes a lease of every limit on `provider`'s `model`, waiting as long
    /// as they say; the first wait is journaled as `model_wait`. `tenant`:
    /// the run's, for limits per tenant.
    pub async fn acquire(
        &self,
        call: &ToolCall<'_>,
        sink: &dyn EventSink,
        tenant: Option<&str>,
        provider: &str,
        model: &str,
        tokens: i64,
    ) -> Result<Lease, HostError> {
        let Some(pool) = self.pool.get() else { return Ok(Lease::none()) };
        let rules = self.applying(provider, model);
        if rules.is_empty() {
            return Ok(Lease::none());
        }
        let started = Instant::now();
        let mut lease = Lease { pool: Some(pool.clone()), ids: Vec::new(), waited: Duration::ZERO };
        let mut announced = false;
        for rule in rules {
            let base = rule.key();
            let key = match (rule.per_tenant, tenant) {
                (true, Some(t)) => format!("{base}@{t}"),
                _ => base.clone(),
            };
            let bounds = Bounds {
                minute_ms: rule.minute_ms as i64,
                requests: rule.requests_per_minute.map(|n| n as i64),
                tokens: rule.tokens_per_minute.map(|n| n as i64),
                concurrent: rule.concurrent.map(|n| n as i64),
            };
            let id = Uuid::now_v7();
            lease.ids.push(id);
            let arrive = || model_limits::arrive(pool, id, &key, call.run_id, tenant, tokens, HEARTBEAT_MS);
            arrive().await.map_err(unavailable)?;
            loop {
                match model_limits::poll(pool, id, &key, &base, bounds, self.call_ms, HEARTBEAT_MS)
                    .await
                    .map_err(unavailable)?
                {
                    Poll::Granted => break,
                    Poll::Gone => arrive().await.map_err(unavailable)?,
                    Poll::Waiting { position, reason, wait_ms } => {
                        if !announced {
                            announced = true;
                            self.stats.waits.fetch_add(1, Ordering::Relaxed);
                            let payload = json!({
                                "call_index": call.call_index,
                                "provider": provider,
                                "model": model,
                                "limit": key,
                                "reason": reason,
                                "position": position,
                            });
                            sink.event(MODEL_WAIT, payload).await?;
                        }
                        // Too long for a slot: a resumable run suspends
                        // until about when the limit frees, its place given up.
                        let ahead = wait_ms.map(|ms| Duration::from_secs_f64(ms.max(0.0) / 1000.0));
                        let bound = rule.suspend_after();
                        let waited = started.elapsed();
                        let too_long = match ahead {
                            Some(ahead) => waited + ahead > bound,
                            None => waited > bound,
                        };
                        if call.may_suspend && too_long {
                            lease.end(None).await;
                            self.stats.suspensions.fetch_add(1, Ordering::Relaxed);
                            let wait = ahead.unwrap_or(bound).max(POLL_MAX);
                            return Err(HostError::Throttled { limit: key, wait_ms: wait.as_millis() as u64 });
                        }
                        let pause = ahead.unwrap_or(POLL_UNKNOWN);
                        // A little jitter, so the waiters of all processes
                        // do not poll in step.
                        let jitter = Duration::from_millis(rand::Rng::gen_range(&mut rand::thread_rng(), 0..=5));
                        tokio::time::sleep(pause.clamp(POLL_MIN, POLL_MAX) + jitter).await;
                    }
                }
            }
        }
        lease.waited = started.elapsed();
        if announced {
            self.stats.wait_seconds.observe(lease.waited.as_secs_f64());
        }
        Ok(lease)
    }

    /// A provider's 429 with Retry-After: the most specific limit on the
    /// target (its model's, else its provider's) pauses for every process.
    pub async fn pause(&self, provider: &str, model: &str, after: Duration) {
        let Some(pool) = self.pool.get() else { return };
        let rules = self.applying(provider, model);
        let Some(rule) = rules.last() else { return };
        let ms = after.as_millis().min(i64::MAX as u128) as i64;
        match model_limits::pause(pool, &rule.key(), ms).await {
            Ok(()) => {
                self.stats.pauses.fetch_add(1, Ordering::Relaxed);
                tracing::info!(limit = %rule.key(), pause_ms = ms, "a provider's Retry-After paused a shared model limit");
            }
            Err(e) => tracing::warn!(error = %e, "cannot pause a shared model limit"),
        }
    }
}
