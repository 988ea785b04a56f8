//! What the tools file says about models (issue 46): the providers behind
//! the `llm` tool, the aliases a plugin asks for, the limits every process
//! shares and the retry policy of a model call. Checked at start, like the
//! rest of the file; the `llm` tool (`llm::gateway`) uses them.

use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use super::checks::check_http_url;

/// The provider the `--llm-base-url` flag makes.
pub const DEFAULT_PROVIDER: &str = "default";
/// The length of a limit's minute unless a test shortens it.
const MINUTE_MS_DEFAULT: u64 = 60_000;
/// The bounds on a limit's minute: tests shorten it, nobody lengthens it.
const MINUTE_MS_MIN: u64 = 100;
const MINUTE_MS_MAX: u64 = 3_600_000;
/// How long a resumable run's call waits for a limit in its slot, at most,
/// unless the tools file says.
const SUSPEND_AFTER_MS_DEFAULT: u64 = 30_000;
/// The bounds on that: a wait shorter than a poll is not worth a
/// suspension, and one longer than an hour holds a slot too long.
const SUSPEND_AFTER_MS_MIN: u64 = 100;
const SUSPEND_AFTER_MS_MAX: u64 = 3_600_000;
/// Attempts of one model call, over all its targets, at most.
pub const ATTEMPTS_MAX: u32 = 10;
const ATTEMPTS_DEFAULT: u32 = 3;
const BACKOFF_MS_DEFAULT: u64 = 200;
const BACKOFF_MAX_MS_DEFAULT: u64 = 10_000;
/// Targets of one alias, at most.
const TARGETS_MAX: usize = 8;

/// The wire protocol a provider speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// OpenAI's chat completions, streamed (`POST {base_url}/chat/completions`):
    /// OpenAI, vLLM, Ollama, llama.cpp's server, LiteLLM, OpenRouter.
    #[default]
    ChatCompletions,
    /// OpenAI's Responses API, streamed and stateless (`POST
    /// {base_url}/responses`, `store: false`): OpenAI, Azure OpenAI and the
    /// gateways that serve it. A call's messages go as input items, its
    /// tool calls and answers as `function_call` and `function_call_output`.
    Responses,
}

/// One model provider (a `[[provider]]` table of the tools file).
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// The name targets and limits use (`<provider>/<model>`); `default` is
    /// the provider `--llm-base-url` makes.
    pub name: String,
    /// Its OpenAI-compatible base URL, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    /// Sent as `Authorization: Bearer`; write `"${env:NAME}"` to take it
    /// from the environment. A secret: cut out of whatever guests, the
    /// journal and logs see.
    #[serde(default)]
    pub api_key: Option<String>,
    /// The protocol it speaks: `chat_completions` (the default) or `responses`.
    #[serde(default)]
    pub protocol: Protocol,
}

/// Hand-written so that logging a config never prints the key.
impl fmt::Debug for ProviderConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProviderConfig")
            .field("name", &self.name)
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("protocol", &self.protocol)
            .finish()
    }
}

/// A model alias (a `[[model]]` table): the name a plugin asks for and
/// where it is sent.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelAlias {
    /// The name a plugin's `llm` call asks for (`"model": "fast"`), or
    /// `--llm-model` names as the default.
    pub name: String,
    /// `<provider>/<model>` targets in order: a retryable failure before
    /// the first token (connection error, timeout, 408, 429, 5xx) moves the
    /// call to the next.
    pub targets: Vec<String>,
}

/// A limit on model calls (a `[[limit]]` table), shared by every process on
/// the database.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitConfig {
    /// The provider it limits.
    pub provider: String,
    /// The provider's model it limits; unset: every call to the provider.
    #[serde(default)]
    pub model: Option<String>,
    /// Calls started in any minute, at most.
    #[serde(default)]
    pub requests_per_minute: Option<u64>,
    /// Tokens in any minute, at most: a call counts its prompt (estimated
    /// at a token per 4 characters) and `max_tokens` when it starts, then
    /// the usage the provider reports.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// Calls in flight at once, at most.
    #[serde(default)]
    pub concurrent: Option<u64>,
    /// Each tenant gets the whole limit to itself (a bucket per tenant)
    /// instead of sharing one.
    #[serde(default)]
    pub per_tenant: bool,
    /// The length of the limit's "minute" in milliseconds (60000). Tests
    /// shorten it; there is no other reason to.
    #[serde(default = "minute_ms_default")]
    pub minute_ms: u64,
    /// A call of a resumable run whose wait here would pass this many
    /// milliseconds suspends the run instead (status `waiting`, its slot
    /// and lease given up, as an approval does) until about when the limit
    /// frees for it, then asks again; 30000 unless given. A run that is not
    /// resumable keeps waiting in its slot.
    #[serde(default = "suspend_after_ms_default")]
    pub suspend_after_ms: u64,
}

fn minute_ms_default() -> u64 {
    MINUTE_MS_DEFAULT
}

fn suspend_after_ms_default() -> u64 {
    SUSPEND_AFTER_MS_DEFAULT
}

impl LimitConfig {
    /// The limit's key in the shared table: `provider` or `provider/model`.
    pub fn key(&self) -> String {
        match &self.model {
            Some(m) => format!("{}/{m}", self.provider),
            None => self.provider.clone(),
        }
    }

    pub fn minute(&self) -> Duration {
        Duration::from_millis(self.minute_ms)
    }

    /// The longest wait a resumable run's call spends in its slot.
    pub fn suspend_after(&self) -> Duration {
        Duration::from_millis(self.suspend_after_ms)
    }
}

/// A tenant's budgets of model tokens and cost (a `[[budget]]` table): a
/// day and a calendar month, both UTC; at least one is given.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BudgetConfig {
    /// The tenant (the run owner's); `"*"`: every tenant without a budget of its own.
    pub tenant: String,
    /// Model tokens (prompt and completion, as the providers report them)
    /// in a UTC day: a call that would pass it is refused (`limit`).
    #[serde(default)]
    pub tokens_per_day: Option<u64>,
    /// Cost in USD (by the `[[price]]` table) in a UTC day.
    #[serde(default)]
    pub cost_per_day: Option<f64>,
    /// Model tokens in a UTC calendar month.
    #[serde(default)]
    pub tokens_per_month: Option<u64>,
    /// Cost in USD in a UTC calendar month.
    #[serde(default)]
    pub cost_per_month: Option<f64>,
}

/// What one provider model costs (a `[[price]]` table), in USD per million
/// tokens as the provider reports them.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PriceConfig {
    /// The provider (a `[[provider]]`'s name, or `default` for the flags').
    pub provider: String,
    /// The model's name at the provider.
    pub model: String,
    /// USD per million prompt tokens (those not read from the provider's cache).
    pub prompt: f64,
    /// USD per million completion tokens.
    pub completion: f64,
    /// USD per million cached prompt tokens (`usage.prompt_tokens_details.cached_tokens`);
    /// `prompt`'s price when left out.
    #[serde(default)]
    pub cached_prompt: Option<f64>,
}

impl PriceConfig {
    /// The cost in USD of a call's reported usage: `prompt` counts its cached
    /// tokens too (as OpenAI reports them), priced at `cached_prompt`.
    pub fn cost(&self, prompt: u64, completion: u64, cached: u64) -> f64 {
        let cached = cached.min(prompt);
        let fresh = (prompt - cached) as f64 * self.prompt;
        let cached = cached as f64 * self.cached_prompt.unwrap_or(self.prompt);
        (fresh + cached + completion as f64 * self.completion) / 1_000_000.0
    }
}

/// How a call is retried: a model call (the `[model_retry]` table) or a
/// webhook's (its `retry`).
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// Attempts, 1-10; for a model call, rounds over an alias's targets
    /// (each target once a round), never more than 10 attempts in all.
    #[serde(default = "attempts_default")]
    pub attempts: u32,
    /// The pause before the second round; each next one doubles it, up to
    /// `backoff_max_ms`, each drawn between half and all of it (jitter).
    #[serde(default = "backoff_ms_default")]
    pub backoff_ms: u64,
    /// The longest pause between two rounds.
    #[serde(default = "backoff_max_ms_default")]
    pub backoff_max_ms: u64,
}

fn attempts_default() -> u32 {
    ATTEMPTS_DEFAULT
}
fn backoff_ms_default() -> u64 {
    BACKOFF_MS_DEFAULT
}
fn backoff_max_ms_default() -> u64 {
    BACKOFF_MAX_MS_DEFAULT
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            attempts: ATTEMPTS_DEFAULT,
            backoff_ms: BACKOFF_MS_DEFAULT,
            backoff_max_ms: BACKOFF_MAX_MS_DEFAULT,
        }
    }
}

impl RetryConfig {
    pub fn check(&self) -> Result<(), String> {
        if !(1..=ATTEMPTS_MAX).contains(&self.attempts) {
            return Err(format!("attempts must be 1 to {ATTEMPTS_MAX}"));
        }
        if self.backoff_ms > self.backoff_max_ms || self.backoff_max_ms > 600_000 {
            return Err("backoff_ms must not pass backoff_max_ms, nor that 600000".into());
        }
        Ok(())
    }

    /// The pause after round `round` (1-based), jittered: between half and
    /// all of `backoff_ms * 2^(round-1)`, capped at `backoff_max_ms`.
    pub fn backoff(&self, round: u32) -> Duration {
        let full = self.backoff_ms.saturating_mul(1u64 << (round.saturating_sub(1)).min(20)).min(self.backoff_max_ms);
        let half = full / 2;
        let jitter = if full > half { rand::Rng::gen_range(&mut rand::thread_rng(), 0..=full - half) } else { 0 };
        Duration::from_millis(half + jitter)
    }
}

/// One failed attempt of an operator tool's call (a webhook, an MCP
/// server's tool, an `http` destination), as its retry policy weighs it.
pub(crate) struct Failed {
    pub error: crate::error::HostError,
    /// The HTTP status, when there was an answer.
    pub status: Option<u16>,
    /// The answer's `Retry-After`, honoured as the least pause.
    pub after: Option<Duration>,
    /// Whether another attempt may be made: the call never reached its
    /// receiver (no connection), or the tool is idempotent and the failure
    /// is one that may pass (a timeout, 408, 429, 5xx, a lost connection).
    pub retryable: bool,
}

/// Bytes of a failed attempt's error kept in its `tool_attempt` event.
const ATTEMPT_ERROR_BYTES_MAX: usize = 300;

impl RetryConfig {
    /// After failed attempt `attempt` of `call`: `Ok` once its pause has
    /// passed when `policy` allows another (the attempt journaled as
    /// `tool_attempt`, replay-safe like every host event), else the error.
    pub(crate) async fn again(
        policy: Option<&RetryConfig>,
        attempt: u32,
        call: &super::ToolCall<'_>,
        sink: &dyn super::EventSink,
        failed: Failed,
    ) -> Result<(), crate::error::HostError> {
        let Some(policy) = policy.filter(|p| failed.retryable && attempt < p.attempts) else {
            return Err(failed.error);
        };
        let pause = policy.backoff(attempt).max(failed.after.unwrap_or_default());
        let mut event = serde_json::json!({
            "call_index": call.call_index,
            "name": call.name,
            "attempt": attempt,
            "error": super::clip(&failed.error.to_string(), ATTEMPT_ERROR_BYTES_MAX),
            "retry_in_ms": pause.as_millis() as u64,
        });
        if let Some(status) = failed.status {
            event["status"] = serde_json::json!(status);
        }
        sink.event(crate::db::events::TOOL_ATTEMPT, event).await?;
        tokio::time::sleep(pause).await;
        Ok(())
    }
}

/// The models part of the tools file, checked.
#[derive(Debug, Clone, Default)]
pub struct ModelsConfig {
    pub providers: Vec<ProviderConfig>,
    pub aliases: Vec<ModelAlias>,
    pub limits: Vec<LimitConfig>,
    pub retry: RetryConfig,
    pub budgets: Vec<BudgetConfig>,
    pub prices: Vec<PriceConfig>,
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// `provider/model` split at the first `/` (a model's own name may hold more).
pub fn split_target(target: &str) -> Option<(&str, &str)> {
    let (p, m) = target.split_once('/')?;
    (!p.is_empty() && !m.trim().is_empty()).then_some((p, m))
}

impl ModelsConfig {
    /// The budget of `tenant`: its own, else `"*"`'s.
    pub fn budget_of(&self, tenant: &str) -> Option<&BudgetConfig> {
        let find = |t: &str| self.budgets.iter().find(|b| b.tenant == t);
        find(tenant).or_else(|| find("*"))
    }

    /// What can be checked without the flags: names, targets' form, bounds.
    /// Providers named by targets and limits are checked with the flags'
    /// `default` provider known ([`ModelsConfig::check_with`]).
    pub fn check(&self) -> Result<(), String> {
        let mut names = HashSet::new();
        for (i, p) in self.providers.iter().enumerate() {
            let entry = format!("provider #{} ({:?})", i + 1, p.name);
            if !valid_name(&p.name) {
                return Err(format!("{entry}: a name is 1-64 characters of a-z, A-Z, 0-9, _, - and ."));
            }
            if !names.insert(p.name.clone()) {
                return Err(format!("{entry}: the name is used by an earlier provider"));
            }
            check_http_url(&p.base_url).map_err(|e| format!("{entry}: base_url: {e}"))?;
        }
        let mut aliases = HashSet::new();
        for (i, a) in self.aliases.iter().enumerate() {
            let entry = format!("model #{} ({:?})", i + 1, a.name);
            if a.name.trim().is_empty() || a.name.len() > 200 {
                return Err(format!("{entry}: a name is 1-200 characters"));
            }
            if !aliases.insert(a.name.clone()) {
                return Err(format!("{entry}: the name is used by an earlier model"));
            }
            if a.targets.is_empty() || a.targets.len() > TARGETS_MAX {
                return Err(format!("{entry}: targets must list 1 to {TARGETS_MAX} provider/model names"));
            }
            for t in &a.targets {
                if split_target(t).is_none() {
                    return Err(format!("{entry}: target {t:?} is not <provider>/<model>"));
                }
            }
        }
        for (i, l) in self.limits.iter().enumerate() {
            let entry = format!("limit #{} ({:?})", i + 1, l.key());
            if !(MINUTE_MS_MIN..=MINUTE_MS_MAX).contains(&l.minute_ms) {
                return Err(format!("{entry}: minute_ms must be {MINUTE_MS_MIN} to {MINUTE_MS_MAX}"));
            }
            if !(SUSPEND_AFTER_MS_MIN..=SUSPEND_AFTER_MS_MAX).contains(&l.suspend_after_ms) {
                return Err(format!(
                    "{entry}: suspend_after_ms must be {SUSPEND_AFTER_MS_MIN} to {SUSPEND_AFTER_MS_MAX}"
                ));
            }
            for (what, n) in [
                ("requests_per_minute", l.requests_per_minute),
                ("tokens_per_minute", l.tokens_per_minute),
                ("concurrent", l.concurrent),
            ] {
                if n == Some(0) {
                    return Err(format!("{entry}: {what} must be at least 1 (leave it out for no limit)"));
                }
            }
            if self.limits[..i].iter().any(|o| o.key() == l.key()) {
                return Err(format!("{entry}: an earlier limit has the same provider and model"));
            }
        }
        for (i, b) in self.budgets.iter().enumerate() {
            let tokens = [b.tokens_per_day, b.tokens_per_month];
            let costs = [b.cost_per_day, b.cost_per_month];
            if b.tenant.is_empty() || (tokens.iter().all(Option::is_none) && costs.iter().all(Option::is_none)) {
                return Err(format!(
                    "budget #{}: a tenant and at least one of tokens_per_day, cost_per_day, tokens_per_month, cost_per_month",
                    i + 1
                ));
            }
            if tokens.contains(&Some(0)) || costs.into_iter().flatten().any(|c| !c.is_finite() || c <= 0.0) {
                return Err(format!("budget #{} ({:?}): a budget is more than 0", i + 1, b.tenant));
            }
            if self.budgets[..i].iter().any(|o| o.tenant == b.tenant) {
                return Err(format!("budget #{} ({:?}): an earlier budget has the same tenant", i + 1, b.tenant));
            }
        }
        for (i, p) in self.prices.iter().enumerate() {
            let entry = format!("price #{} ({}/{})", i + 1, p.provider, p.model);
            let prices = [Some(p.prompt), Some(p.completion), p.cached_prompt];
            if p.provider.is_empty() || p.model.trim().is_empty() {
                return Err(format!("{entry}: a provider and a model"));
            }
            if prices.into_iter().flatten().any(|x| !x.is_finite() || x < 0.0) {
                return Err(format!("{entry}: prices are USD per million tokens, 0 or more"));
            }
            if self.prices[..i].iter().any(|o| o.provider == p.provider && o.model == p.model) {
                return Err(format!("{entry}: an earlier price has the same provider and model"));
            }
        }
        self.retry.check().map_err(|e| format!("model_retry: {e}"))
    }

    /// The price of `provider`'s `model`, if the tools file gives one.
    pub fn price_of(&self, provider: &str, model: &str) -> Option<&PriceConfig> {
        self.prices.iter().find(|p| p.provider == provider && p.model == model)
    }

    /// The cross-checks once every provider is known (`default` included
    /// when the flags give one): every target and limit names one.
    pub fn check_with(&self, has_default: bool) -> Result<(), String> {
        let known = |p: &str| (has_default && p == DEFAULT_PROVIDER) || self.providers.iter().any(|x| x.name == p);
        if has_default && self.providers.iter().any(|p| p.name == DEFAULT_PROVIDER) {
            return Err(format!(
                "provider {DEFAULT_PROVIDER:?} is the one --llm-base-url makes; name the tools file's another way"
            ));
        }
        for a in &self.aliases {
            for t in &a.targets {
                let (p, _) = split_target(t).expect("checked at parse");
                if !known(p) {
                    return Err(format!("model {:?}: target {t:?} names no provider", a.name));
                }
            }
        }
        for l in &self.limits {
            if !known(&l.provider) {
                return Err(format!("limit {:?}: names no provider", l.key()));
            }
        }
        for p in &self.prices {
            if !known(&p.provider) {
                return Err(format!("price {}/{}: names no provider", p.provider, p.model));
            }
        }
        if !self.aliases.is_empty() && self.providers.is_empty() && !has_default {
            return Err("[[model]] aliases need a [[provider]] (or --llm-base-url)".into());
        }
        Ok(())
    }
}
