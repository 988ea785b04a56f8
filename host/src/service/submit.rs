//! Enqueue as a service: what every API that starts a run calls (the native
//! `POST /v1/runs` and `POST /v1/conversations/{id}/runs` today, the
//! Responses API next), so none of them holds run logic.
//!
//! It owns: validating what the client sent (content, plugin, config,
//! idempotency key, and the storable-text rule), pinning the plugin to the
//! (name, digest, manifest) its name points at now, the request snapshot, and
//! the idempotency replay (the same key and request: the first answer again;
//! the same key, another request: refused), and the tenant's quotas
//! (`service::quota`: the enqueue rate here, the queue quota inside the
//! enqueue transaction). The enqueue transaction itself is
//! `db::lifecycle::enqueue_with`.

use serde_json::{json, Value};
use sqlx::PgPool;

use crate::agent::AgentRegistry;
use crate::db::claimed::ClaimedRun;
use crate::db::enqueue::{self as runs, EnqueueError, Enqueued, NewRun, Owner};
pub use crate::db::lifecycle::Busy;
use crate::db::lifecycle::Eager;
use crate::db::lifecycle::{self, StrategyError};
use crate::db::{ConversationId, RunId};

use super::quota::{Limit, QuotaExceeded, Quotas, QUEUE_RETRY_AFTER_S};
use crate::text::{self, Unstorable};

/// Characters of a user message.
pub const CONTENT_CHARS_MAX: usize = 64 * 1024;
/// Bytes of a run's config JSON.
pub const CONFIG_BYTES_MAX: usize = 16 * 1024;
/// Bytes of an idempotency key.
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 200;
/// Plugin names an unknown-plugin refusal lists at most.
pub const AVAILABLE_NAMES_MAX: i64 = 100;

/// Bytes of a completion webhook's URL.
pub const WEBHOOK_URL_BYTES_MAX: usize = 2048;

/// One request to start a run, as a client sent it.
#[derive(Debug, Clone)]
pub struct Submission {
    pub owner: Owner,
    /// `None`: a new conversation for this run.
    pub conversation_id: Option<ConversationId>,
    pub content: String,
    pub plugin: String,
    /// `None`: `{}`.
    pub config: Option<Value>,
    pub idempotency_key: Option<String>,
    /// A URL told when the run ends; it must start with one of the
    /// operator's allowed prefixes ([`Policy::webhook_allow`]).
    pub webhook: Option<String>,
    /// What to do when the conversation already has an active turn.
    pub strategy: Busy,
    /// The run (and its tool call) whose agent starts this one: a child
    /// run, never started in its enqueue (see [`crate::db::enqueue::NewRun::parent`]).
    pub parent: Option<(RunId, i32)>,
}

/// The operator's rules for submissions.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    /// URL prefixes a run's completion webhook may start with
    /// (`--completion-webhook-allow`); empty: no webhooks.
    pub webhook_allow: Vec<String>,
    /// Per-tenant queue quota and enqueue rate (off by default).
    pub quotas: Quotas,
    /// What schedules a tenant may have.
    pub schedules: SchedulePolicy,
    /// Who decides the calls the operator gates.
    pub approvals: ApprovalPolicy,
    /// The completion webhooks' signing secret, from which each tenant's
    /// key is derived (`None`: this host sends no webhooks).
    pub webhook_secret: Option<WebhookSecret>,
}

/// The operator's webhook signing secret: never printed.
#[derive(Clone)]
pub struct WebhookSecret(pub Vec<u8>);

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSecret(<redacted>)")
    }
}

/// Schedules one tenant may have, by default.
pub const TENANT_MAX_SCHEDULES_DEFAULT: u32 = 100;
/// The shortest time between two firings of one schedule, by default.
pub const MIN_INTERVAL_DEFAULT: std::time::Duration = std::time::Duration::from_secs(60);

/// What schedules a tenant may have (the operator's `--tenant-max-schedules`
/// and `--schedule-min-interval-s`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulePolicy {
    pub tenant_max: u32,
    pub min_interval: std::time::Duration,
}

impl Default for SchedulePolicy {
    fn default() -> Self {
        SchedulePolicy { tenant_max: TENANT_MAX_SCHEDULES_DEFAULT, min_interval: MIN_INTERVAL_DEFAULT }
    }
}

/// Who decides a call the operator gates (a tools-file entry's `approval`):
/// by default its requester, as any other approval; with `admin_decides`,
/// an admin of the run's tenant other than the requester
/// (`--operator-approvals admin`). `edit`: whether a decision may change
/// the call's arguments (`--operator-approvals-no-edit` forbids it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalPolicy {
    pub admin_decides: bool,
    pub edit: bool,
}

impl Default for ApprovalPolicy {
    fn default() -> Self {
        ApprovalPolicy { admin_decides: false, edit: true }
    }
}

impl Policy {
    /// Whether `url` is an http(s) URL under an allowed prefix: the same
    /// scheme, host and port, no user info, and a path under the prefix's
    /// (on a segment boundary). Compared parsed, never as text, so
    /// `https://allowed.example@elsewhere/` or `https://allowed.example.evil/`
    /// are not under `https://allowed.example`.
    pub fn allows_webhook(&self, url: &str) -> bool {
        let Ok(u) = url::Url::parse(url) else { return false };
        let web = matches!(u.scheme(), "http" | "https");
        if !web || url.len() > WEBHOOK_URL_BYTES_MAX || !u.username().is_empty() || u.password().is_some() {
            return false;
        }
        self.webhook_allow.iter().filter_map(|p| url::Url::parse(p).ok()).any(|p| {
            let base = p.path().trim_end_matches('/');
            let under = u.path() == base || u.path().starts_with(&format!("{base}/"));
            p.scheme() == u.scheme()
                && p.host_str() == u.host_str()
                && p.port_or_known_default() == u.port_or_known_default()
                && under
        })
    }
}

/// This process's worker as the enqueue sees it, for eager start
/// ([`crate::db::lifecycle::Eager`]); `worker::WorkerObserver` is one. A trait
/// here, so this service does not import the worker, which imports it.
pub trait LocalWorker: Send + Sync {
    /// A free slot for a run of `tenant` that may start in its enqueue,
    /// taken now; `None` when the worker takes no eager start at this
    /// moment (or the tenant holds its share of the slots).
    fn start_slot(&self, tenant: &str) -> Option<Box<dyn StartSlot>>;
}

/// A slot taken for a run that may start in its enqueue: dropped unused,
/// it goes back.
pub trait StartSlot: Send {
    /// The claim the enqueue makes for the worker.
    fn claim(&self) -> Eager<'_>;
    /// Runs the run its enqueue started, in this slot, at once.
    fn start(self: Box<Self>, run: ClaimedRun);
}

/// The run a submission started, or the one its idempotency key started before.
#[derive(Debug, Clone, PartialEq)]
pub enum Submitted {
    Created(Enqueued),
    /// The same key and the same request as before: the first answer again.
    Replayed(Enqueued),
}

impl Submitted {
    pub fn enqueued(&self) -> &Enqueued {
        match self {
            Submitted::Created(e) | Submitted::Replayed(e) => e,
        }
    }

    pub fn replayed(&self) -> bool {
        matches!(self, Submitted::Replayed(_))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error(transparent)]
    Unstorable(#[from] Unstorable),
    #[error("content must not be empty")]
    EmptyContent,
    #[error("content has {0} characters; the limit is {CONTENT_CHARS_MAX}")]
    ContentTooLong(usize),
    #[error("unknown plugin {plugin:?}; available: {}", available.join(", "))]
    UnknownPlugin { plugin: String, available: Vec<String> },
    #[error("config must be a JSON object")]
    ConfigNotObject,
    #[error("config is {0} bytes; the limit is {CONFIG_BYTES_MAX}")]
    ConfigTooLarge(usize),
    #[error("Idempotency-Key must be 1-{IDEMPOTENCY_KEY_BYTES_MAX} visible ASCII bytes")]
    BadIdempotencyKey,
    #[error("webhook {0:?} is not under a URL prefix the operator allows")]
    WebhookNotAllowed(String),
    /// `reject`: the conversation has an active turn.
    #[error("conversation {conversation} has an active turn, run {run}")]
    Busy { conversation: ConversationId, run: RunId },
    /// Missing, or another user's: the same answer.
    #[error("conversation {0} not found")]
    ConversationNotFound(ConversationId),
    #[error("Idempotency-Key {key:?} was used for a different request (run {run})")]
    IdempotencyKeyReused { key: String, run: RunId },
    /// A concurrent request with the key won, and its run is not readable yet.
    #[error("idempotency key in use; retry")]
    IdempotencyKeyInUse,
    /// Past the tenant's queue quota or enqueue rate: nothing was written.
    #[error(transparent)]
    Quota(#[from] QuotaExceeded),
    /// For logs only; APIs answer a fixed message.
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
}

/// Validates `s`, pins its plugin and enqueues it (or replays the run its
/// idempotency key started).
///
/// With `local`, this process's worker: when it has a free slot, the run
/// may start in its enqueue's statement and run here at once (eager start,
/// [`crate::db::lifecycle::Eager`]).
pub async fn submit(
    pool: &PgPool,
    agents: &AgentRegistry,
    policy: &Policy,
    s: &Submission,
    local: Option<&dyn LocalWorker>,
) -> Result<Submitted, SubmitError> {
    submit_within(pool, agents, policy, s, super::quota::SHAPE_WAIT_MAX, local).await
}

/// [`submit`], waiting for a rate token up to `rate_wait_max` (zero: a
/// tenant out of tokens is refused at once, as a schedule's firing is, which
/// must not wait inside its transaction).
pub async fn submit_within(
    pool: &PgPool,
    agents: &AgentRegistry,
    policy: &Policy,
    s: &Submission,
    rate_wait_max: std::time::Duration,
    local: Option<&dyn LocalWorker>,
) -> Result<Submitted, SubmitError> {
    let config = validate(policy, s)?;
    let registered = pin(pool, agents, s).await?;
    // What a replay is compared with.
    let request = json!({ "content": s.content, "plugin": s.plugin, "conversation_id": s.conversation_id, "config": config,
                "webhook": s.webhook, "multitask_strategy": s.strategy });
    let pinned = Pinned { registered: registered.map(|p| (p.digest, p.manifest)), config, request };
    enqueue(pool, policy, s, pinned, rate_wait_max, local).await
}

/// A message's content as every door checks it: storable text, not blank,
/// at most [`CONTENT_CHARS_MAX`] characters (a steer's instruction too).
pub fn check_content(content: &str) -> Result<(), SubmitError> {
    text::refuse_text("content", content)?;
    if content.trim().is_empty() {
        return Err(SubmitError::EmptyContent);
    }
    let chars = content.chars().count();
    if chars > CONTENT_CHARS_MAX {
        return Err(SubmitError::ContentTooLong(chars));
    }
    Ok(())
}

/// A submission's checks, before anything reaches the database: text it
/// cannot store, the webhook allow-list, the content, the config and the
/// idempotency key. Returns the config (`{}` when none was given).
fn validate(policy: &Policy, s: &Submission) -> Result<Value, SubmitError> {
    check_content(&s.content)?;
    text::refuse_text("plugin", &s.plugin)?;
    if let Some(config) = &s.config {
        text::refuse_json("config", config)?;
    }
    if let Some(key) = &s.idempotency_key {
        text::refuse_text("idempotency key", key)?;
        if !valid_idempotency_key(key) {
            return Err(SubmitError::BadIdempotencyKey);
        }
    }
    if let Some(url) = &s.webhook {
        text::refuse_text("webhook", url)?;
        if !policy.allows_webhook(url) {
            return Err(SubmitError::WebhookNotAllowed(url.clone()));
        }
    }
    let config = s.config.clone().unwrap_or_else(|| json!({}));
    if !config.is_object() {
        return Err(SubmitError::ConfigNotObject);
    }
    let config_bytes = config.to_string().len();
    if config_bytes > CONFIG_BYTES_MAX {
        return Err(SubmitError::ConfigTooLarge(config_bytes));
    }
    Ok(config)
}

/// A registered plugin, pinned now to the digest (and manifest) its name
/// points at, so re-pointing the name later changes nothing for this run;
/// the tenant's own first, then a published one (another tenant's is not
/// there); `None` for a built-in agent of that name; refused when neither.
async fn pin(
    pool: &PgPool,
    agents: &AgentRegistry,
    s: &Submission,
) -> Result<Option<crate::db::plugins::PluginRow>, SubmitError> {
    let tenant = &s.owner.tenant_id;
    let registered = match agents.sandbox() {
        Some(_) => crate::db::plugins::resolve(pool, tenant, &s.plugin).await?,
        None => None,
    };
    if registered.is_none() && !agents.contains(&s.plugin) {
        let mut available = agents.names();
        let visible = crate::db::plugins::list(pool, Some(tenant), None, AVAILABLE_NAMES_MAX).await?;
        available.extend(visible.into_iter().map(|p| p.name));
        available.sort();
        available.dedup();
        return Err(SubmitError::UnknownPlugin { plugin: s.plugin.clone(), available });
    }
    Ok(registered)
}

/// A validated submission with its plugin pinned: what the enqueue writes.
#[derive(Clone)]
struct Pinned {
    /// The digest and manifest of a registered plugin (none: a built-in).
    registered: Option<(String, Value)>,
    config: Value,
    /// The request snapshot a replay is compared with.
    request: Value,
}

impl Pinned {
    fn new_run<'a>(&'a self, s: &'a Submission) -> NewRun<'a> {
        NewRun {
            plugin_digest: self.registered.as_ref().map(|(digest, _)| digest.as_str()),
            plugin_manifest: self.registered.as_ref().map(|(_, manifest)| manifest),
            ..new_run(s, &self.config, &self.request)
        }
    }
}

/// The one door of a submission into the queue: created (queued, or started
/// in its enqueue by this process's worker when it has a free slot),
/// replayed (the key's first run, for the same request) or refused (the key
/// used for another request, the tenant's rate or queue quota, a busy
/// conversation).
async fn enqueue(
    pool: &PgPool,
    policy: &Policy,
    s: &Submission,
    pinned: Pinned,
    rate_wait_max: std::time::Duration,
    local: Option<&dyn LocalWorker>,
) -> Result<Submitted, SubmitError> {
    // A replay is answered as its first request was, before the tenant's
    // rate (it starts nothing, so takes no token); a concurrent first use
    // of the key is caught by the enqueue's unique index below.
    if let Some(replayed) = replay(pool, s, &pinned.request).await? {
        return Ok(replayed);
    }
    let tenant = &s.owner.tenant_id;
    // The tenant's rate: a burst waits for its tokens, up to a bound.
    policy.quotas.enqueue_token_within(tenant, rate_wait_max).await?;
    let max_queued = policy.quotas.config.tenant_max_queued;
    let enqueued = match local.and_then(|w| w.start_slot(tenant)) {
        None => lifecycle::enqueue_with(pool, &pinned.new_run(s), s.strategy, max_queued, None).await.map(|(e, _)| e),
        Some(slot) => {
            // In a task of its own, which owns what it needs: a run that
            // started in the enqueue reaches this worker's run task even if
            // the caller stops waiting (a client that hung up mid-request),
            // instead of being left to the reaper.
            let (pool, s, pinned) = (pool.clone(), s.clone(), pinned.clone());
            let task = tokio::spawn(async move {
                let new = pinned.new_run(&s);
                let (enqueued, started) =
                    lifecycle::enqueue_with(&pool, &new, s.strategy, max_queued, Some(&slot.claim())).await?;
                if let Some(run) = started {
                    slot.start(run);
                }
                Ok(enqueued)
            });
            match task.await {
                Ok(done) => done,
                Err(e) => match e.try_into_panic() {
                    Ok(panic) => std::panic::resume_unwind(panic),
                    // Only when the runtime shuts down.
                    Err(_) => return Err(SubmitError::Db(sqlx::Error::PoolClosed)),
                },
            }
        }
    };
    match enqueued {
        Ok(e) => Ok(Submitted::Created(e)),
        Err(StrategyError::QueueFull { max }) => Err(queue_full(&policy.quotas, tenant, max).into()),
        Err(StrategyError::Busy(run)) => {
            Err(SubmitError::Busy { conversation: s.conversation_id.expect("busy needs a conversation"), run })
        }
        // The key was used by a concurrent first request that won: answer
        // like it if this is the same request, else refuse.
        Err(StrategyError::Enqueue(e)) if runs::is_idempotency_conflict(&e) => {
            replay(pool, s, &pinned.request).await?.ok_or(SubmitError::IdempotencyKeyInUse)
        }
        Err(StrategyError::Enqueue(EnqueueError::ConversationNotFound(id))) => {
            Err(SubmitError::ConversationNotFound(id))
        }
        Err(StrategyError::Enqueue(EnqueueError::Db(e))) => Err(e.into()),
    }
}

/// The run the submission's idempotency key started before, if any: the
/// same request is answered with it, another is refused.
async fn replay(pool: &PgPool, s: &Submission, request: &Value) -> Result<Option<Submitted>, SubmitError> {
    let Some(key) = s.idempotency_key.as_deref() else { return Ok(None) };
    let Some((first, first_request)) = runs::find_by_idempotency_key(pool, &s.owner.user_id, key).await? else {
        return Ok(None);
    };
    if first_request.is_some_and(|r| &r != request) {
        return Err(SubmitError::IdempotencyKeyReused { key: key.to_string(), run: first.run_id });
    }
    Ok(Some(Submitted::Replayed(first)))
}

/// The run `s` asks for, with its config and request snapshot, its plugin
/// not pinned (the caller sets the digest and manifest it resolved).
fn new_run<'a>(s: &'a Submission, config: &'a Value, request: &'a Value) -> NewRun<'a> {
    NewRun {
        owner: &s.owner,
        conversation_id: s.conversation_id,
        content: &s.content,
        plugin: &s.plugin,
        plugin_digest: None,
        plugin_manifest: None,
        config,
        request,
        idempotency_key: s.idempotency_key.as_deref(),
        webhook: s.webhook.as_deref(),
        parent: s.parent,
    }
}

/// The refusal of an enqueue (or a retry) past the tenant's queue quota.
pub fn queue_full(quotas: &Quotas, tenant: &str, max: u32) -> QuotaExceeded {
    quotas.refuse(
        tenant,
        Limit::QueuedRuns,
        format!("tenant {tenant:?} has {max} queued runs, the most its quota allows; retry when some start"),
        QUEUE_RETRY_AFTER_S,
    )
}

/// A retry of `run` (`lifecycle::retry`) held to the tenant's quotas like
/// any enqueue: its rate first, then its queue quota (in the retry's
/// transaction).
pub async fn retry(pool: &PgPool, quotas: &Quotas, owner: &Owner, run: RunId) -> Result<Enqueued, RetryRefused> {
    quotas.enqueue_token(&owner.tenant_id).await?;
    lifecycle::retry(pool, run, &owner.user_id, quotas.config.tenant_max_queued).await.map_err(|e| match e {
        lifecycle::RetryError::QueueFull { max } => RetryRefused::Quota(queue_full(quotas, &owner.tenant_id, max)),
        e => RetryRefused::Retry(e),
    })
}

/// Why [`retry`] started no run.
#[derive(Debug, thiserror::Error)]
pub enum RetryRefused {
    #[error(transparent)]
    Quota(#[from] QuotaExceeded),
    #[error(transparent)]
    Retry(lifecycle::RetryError),
}

/// 1 to [`IDEMPOTENCY_KEY_BYTES_MAX`] bytes of visible ASCII (what an HTTP
/// header value may hold: tab, space to `~`).
fn valid_idempotency_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= IDEMPOTENCY_KEY_BYTES_MAX
        && key.bytes().all(|b| b == b'\t' || (b' '..=b'~').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idempotency_keys_are_bounded_visible_ascii() {
        assert!(valid_idempotency_key("k-1"));
        assert!(valid_idempotency_key(&"k".repeat(IDEMPOTENCY_KEY_BYTES_MAX)));
        for bad in ["", "caf\u{e9}", "a\u{fffd}", "a\nb"] {
            assert!(!valid_idempotency_key(bad), "{bad:?}");
        }
        assert!(!valid_idempotency_key(&"k".repeat(IDEMPOTENCY_KEY_BYTES_MAX + 1)));
    }

    /// Unstorable text is refused before anything reaches the database (this
    /// pool has none behind it).
    #[test]
    fn webhook_urls_are_compared_parsed_not_as_text() {
        let policy = Policy { webhook_allow: vec!["https://hooks.example.com/acme".into()], ..Policy::default() };
        assert!(policy.allows_webhook("https://hooks.example.com/acme"));
        assert!(policy.allows_webhook("https://hooks.example.com/acme/run-done?x=1"));
        assert!(policy.allows_webhook("https://hooks.example.com:443/acme/x"));
        for bad in [
            "https://hooks.example.com@169.254.169.254/acme",
            "https://user:pw@hooks.example.com/acme",
            "https://hooks.example.com.evil.net/acme",
            "https://hooks.example.com/acmex",
            "http://hooks.example.com/acme",
            "https://hooks.example.com:8443/acme",
            "ftp://hooks.example.com/acme",
            "not a url",
        ] {
            assert!(!policy.allows_webhook(bad), "{bad}");
        }
    }

    #[tokio::test]
    async fn unstorable_text_is_refused_before_the_database() {
        let pool = PgPool::connect_lazy("postgres://nobody@127.0.0.1:1/none").unwrap();
        let agents = AgentRegistry::with_builtins();
        let ok = Submission {
            owner: Owner { user_id: "u".into(), tenant_id: "t".into() },
            conversation_id: None,
            content: "hi".into(),
            plugin: "echo".into(),
            config: None,
            idempotency_key: None,
            webhook: None,
            parent: None,
            strategy: Busy::Enqueue,
        };
        let cases = [
            ("content", Submission { content: "a\0b".into(), ..ok.clone() }),
            ("plugin", Submission { plugin: "e\0".into(), ..ok.clone() }),
            ("config", Submission { config: Some(json!({ "a": { "\u{0}": 1 } })), ..ok.clone() }),
            ("idempotency key", Submission { idempotency_key: Some("k\0".into()), ..ok.clone() }),
        ];
        for (field, s) in cases {
            match submit(&pool, &agents, &Policy::default(), &s, None).await {
                Err(SubmitError::Unstorable(u)) => assert_eq!(u.field, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }
}
