//! The `llm` tool over every configured provider (issue 46): the model a
//! call asks for resolves to an ordered list of `provider/model` targets (a
//! `[[model]]` alias, one `provider/model`, or a model of the default
//! provider); each attempt takes the shared limits' leases, then asks its
//! target. A retryable failure before the first token (no connection, no
//! answer in time, 408, 429, 5xx) moves the call to the next target, and
//! after the last one, to a new round after a backoff with jitter, up to
//! the retry policy's rounds. Every attempt is journaled (`model_attempt`)
//! within the call, so a resumed run's replay skips it with the call. Once
//! a stream has started nothing is retried: tokens may have reached the run.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::{json, Value};

use super::limits::Limiter;
use super::{failed, parse_args, Answer, LlmArgs, OpenAi, Role};
use crate::db::events::MODEL_ATTEMPT;
use crate::error::HostError;
use crate::tools::models::{
    split_target, ModelsConfig, PriceConfig, Protocol, RetryConfig, ATTEMPTS_MAX, DEFAULT_PROVIDER,
};
use crate::tools::{clip, EventSink, LlmConfig, Tool, ToolCall};

/// Bytes of an attempt's error kept in its `model_attempt` event.
const ATTEMPT_ERROR_BYTES_MAX: usize = 300;

/// One place a call may go: a provider and the model name it is sent.
#[derive(Clone)]
struct Target {
    provider: String,
    model: String,
}

pub(crate) struct Gateway {
    providers: HashMap<String, OpenAi>,
    aliases: HashMap<String, Vec<Target>>,
    /// What a call naming no model asks for (`--llm-model`).
    default_model: String,
    /// The provider of a bare model name: the flags' `default`, or the only one.
    default_provider: Option<String>,
    retry: RetryConfig,
    timeout: Duration,
    pub limits: Limiter,
    /// The `[[price]]` table: each call's cost.
    prices: Vec<PriceConfig>,
}

impl Gateway {
    /// The providers of the flags (`default`) and the tools file; `None`
    /// when there is none (the offline model answers).
    pub fn build(llm: &LlmConfig, models: &ModelsConfig, client: reqwest::Client) -> Result<Option<Gateway>, String> {
        models.check_with(llm.base_url.is_some())?;
        let mut providers = HashMap::new();
        if let Some(url) = &llm.base_url {
            providers.insert(
                DEFAULT_PROVIDER.to_string(),
                OpenAi::new(url, llm.api_key.clone(), llm.idle_timeout, client.clone(), Protocol::ChatCompletions),
            );
        }
        for p in &models.providers {
            let endpoint = OpenAi::new(&p.base_url, p.api_key.clone(), llm.idle_timeout, client.clone(), p.protocol);
            providers.insert(p.name.clone(), endpoint);
        }
        if providers.is_empty() {
            return Ok(None);
        }
        let default_provider = match (&llm.base_url, models.providers.as_slice()) {
            (Some(_), _) => Some(DEFAULT_PROVIDER.to_string()),
            (None, [only]) => Some(only.name.clone()),
            _ => None,
        };
        let aliases = models
            .aliases
            .iter()
            .map(|a| {
                let targets = a
                    .targets
                    .iter()
                    .map(|t| {
                        let (p, m) = split_target(t).expect("checked at parse");
                        Target { provider: p.to_string(), model: m.to_string() }
                    })
                    .collect();
                (a.name.clone(), targets)
            })
            .collect();
        let gateway = Gateway {
            providers,
            aliases,
            default_model: llm.model.clone(),
            default_provider,
            retry: models.retry.clone(),
            timeout: llm.timeout,
            limits: Limiter::new(models.limits.clone(), models.budgets.clone(), llm.timeout),
            prices: models.prices.clone(),
        };
        gateway.resolve(None).map_err(|e| format!("--llm-model: {e}"))?;
        Ok(Some(gateway))
    }

    /// Where a call asking for `asked` (or the default model) goes.
    fn resolve(&self, asked: Option<&str>) -> Result<Vec<Target>, String> {
        let name = asked.unwrap_or(&self.default_model);
        if let Some(targets) = self.aliases.get(name) {
            return Ok(targets.clone());
        }
        if let Some((p, m)) = split_target(name) {
            if self.providers.contains_key(p) {
                return Ok(vec![Target { provider: p.to_string(), model: m.to_string() }]);
            }
        }
        match &self.default_provider {
            Some(p) => Ok(vec![Target { provider: p.clone(), model: name.to_string() }]),
            None => Err(format!(
                "{name:?} is no [[model]] alias and no <provider>/<model> of a configured provider \
                 (with several providers and no --llm-base-url, a bare model name has no provider)"
            )),
        }
    }
}

/// The tokens a call counts against a tokens-per-minute limit before the
/// provider says: its text at a token per 4 bytes, and `max_tokens`.
fn estimate_tokens(args: &LlmArgs) -> i64 {
    let text: usize = args
        .messages
        .iter()
        .map(|m| {
            let calls: usize = m.tool_calls.iter().map(|c| c.name.len() + c.arguments.to_string().len()).sum();
            m.text().len() + calls + if m.role == Role::Tool { 8 } else { 4 }
        })
        .sum();
    (text.div_ceil(4) as u64 + args.max_tokens.unwrap_or(0)).min(i64::MAX as u64) as i64
}

#[async_trait]
impl Tool for Gateway {
    async fn call(&self, call: &ToolCall<'_>, sink: &dyn EventSink) -> Result<Value, HostError> {
        let args = parse_args(&call.args)?;
        let targets = self.resolve(args.model.as_deref()).map_err(|e| HostError::Invalid(format!("llm model: {e}")))?;
        let tokens = estimate_tokens(&args);
        // The run's tenant: its budget, its usage, its limits per tenant.
        let owner = self.limits.owner_of(call).await?;
        let tenant = owner.as_ref().map(|o| o.tenant.clone());
        // The call's cost before it is made: its estimate at its first
        // priced target's prompt price.
        let estimate_usd = targets
            .iter()
            .find_map(|t| self.prices.iter().find(|p| p.provider == t.provider && p.model == t.model))
            .map_or(0.0, |p| p.cost(tokens.max(0) as u64, 0, 0));
        self.limits.check_budget(call.run_id, tenant.as_deref(), tokens, estimate_usd).await?;
        let total = (self.retry.attempts as usize * targets.len()).min(ATTEMPTS_MAX as usize) as u32;
        // A target's own Retry-After when no shared limit carries it.
        let mut paused_until: Vec<Option<Instant>> = vec![None; targets.len()];
        let mut attempt = 0u32;
        let mut last = None;
        for round in 1..=self.retry.attempts {
            for (i, t) in targets.iter().enumerate() {
                if attempt == total {
                    break;
                }
                attempt += 1;
                let endpoint = &self.providers[&t.provider];
                if let Some(until) = paused_until[i].take() {
                    tokio::time::sleep_until(tokio::time::Instant::from_std(until)).await;
                }
                let lease = self.limits.acquire(call, sink, tenant.as_deref(), &t.provider, &t.model, tokens).await?;
                let waited_ms = lease.waited.as_millis() as u64;
                let mut event = json!({
                    "call_index": call.call_index,
                    "attempt": attempt,
                    "provider": t.provider,
                    "model": t.model,
                    "waited_ms": waited_ms,
                });
                let e = match endpoint.open(&endpoint.request_body(&args, &t.model)).await {
                    Ok(resp) => {
                        self.limits.stats.attempt(&t.provider, "ok");
                        event["outcome"] = json!("ok");
                        event["status"] = json!(resp.status().as_u16());
                        sink.event(MODEL_ATTEMPT, event).await?;
                        let mut answer = endpoint.read(resp, sink, &t.model).await;
                        // The cost by the price table, on the answer's usage.
                        if let Ok(Answer { usage: Some(u), .. }) = &mut answer {
                            u.cost_usd = self
                                .prices
                                .iter()
                                .find(|p| p.provider == t.provider && p.model == t.model)
                                .map(|p| p.cost(u.prompt_tokens, u.completion_tokens, u.cached_tokens));
                        }
                        let used = answer.as_ref().ok().and_then(|a| a.usage);
                        lease
                            .end(used.map(|u| (u.prompt_tokens + u.completion_tokens).min(i64::MAX as u64) as i64))
                            .await;
                        if let Some(u) = used {
                            self.limits.record(owner.as_ref(), &t.provider, &t.model, &u).await;
                        }
                        return Ok(answer?.into_json());
                    }
                    Err(e) => e,
                };
                lease.end(None).await;
                let outcome = match (e.retryable, attempt < total) {
                    (false, _) | (_, false) => "error",
                    _ if i + 1 < targets.len() => "fallback",
                    _ => "retry",
                };
                self.limits.stats.attempt(&t.provider, outcome);
                event["outcome"] = json!(outcome);
                if let Some(status) = e.status {
                    event["status"] = json!(status);
                }
                event["error"] = json!(clip(&e.message(1), ATTEMPT_ERROR_BYTES_MAX));
                if let Some(after) = e.retry_after {
                    event["retry_after_ms"] = json!(after.as_millis() as u64);
                    if e.status == Some(429) {
                        match self.limits.shared(&t.provider, &t.model) {
                            // Every process waits it out, this call too (in
                            // the limit's queue at its next attempt).
                            true => self.limits.pause(&t.provider, &t.model, after).await,
                            false => paused_until[i] = Some(Instant::now() + after),
                        }
                    }
                }
                sink.event(MODEL_ATTEMPT, event).await?;
                if outcome == "error" {
                    return Err(failed(e.message(attempt)));
                }
                last = Some(e);
            }
            if round < self.retry.attempts && attempt < total {
                tokio::time::sleep(self.retry.backoff(round)).await;
            }
        }
        let e = last.expect("at least one attempt was made");
        Err(failed(e.message(attempt)))
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A model call has no side effect: one whose outcome is unknown is asked again.
    fn idempotent(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use axum::{Json, Router};

    use super::*;
    use crate::tools::test_support::{call, serve, Collect};
    use crate::tools::{parse_tools_file_with, ToolRegistry, ToolsConfig, LLM_TOOL};

    /// A provider answering `status` (or, for 200, a one-piece stream), counting requests.
    async fn provider(status: u16, headers: &'static [(&'static str, &'static str)]) -> (Arc<AtomicUsize>, String) {
        let n = Arc::new(AtomicUsize::new(0));
        let handler = move |State(n): State<Arc<AtomicUsize>>, Json(body): Json<Value>| async move {
            n.fetch_add(1, Ordering::SeqCst);
            if status != 200 {
                let mut res: Response = (StatusCode::from_u16(status).unwrap(), "no").into_response();
                for (k, v) in headers {
                    res.headers_mut().insert(*k, v.parse().unwrap());
                }
                return res;
            }
            let model = body["model"].as_str().unwrap().to_string();
            let chunk = json!({ "choices": [{ "index": 0, "delta": { "content": format!("from {model}") }, "finish_reason": "stop" }] });
            ([("content-type", "text/event-stream")], format!("data: {chunk}\n\ndata: [DONE]\n\n")).into_response()
        };
        let addr = serve(Router::new().route("/v1/chat/completions", post(handler)).with_state(n.clone())).await;
        (n, format!("http://{addr}/v1"))
    }

    fn registry(file: &str, default_model: &str) -> Result<ToolRegistry, String> {
        let tools: ToolsConfig = parse_tools_file_with(file, &|_| None)?;
        let llm = LlmConfig { model: default_model.into(), ..LlmConfig::default() };
        ToolRegistry::from_tools(&llm, &tools)
    }

    fn attempts(sink: &Collect) -> Vec<Value> {
        sink.events().into_iter().filter(|(k, _)| k == MODEL_ATTEMPT).map(|(_, p)| p).collect()
    }

    async fn ask(r: &ToolRegistry, sink: &Collect, args: Value) -> Result<Value, HostError> {
        let answer = r.invoke(call(LLM_TOOL, args), sink, std::future::pending()).await?;
        Ok(serde_json::from_str(&answer).unwrap())
    }

    #[tokio::test]
    async fn an_alias_falls_back_past_a_5xx_and_a_4xx_is_never_retried() {
        let (down_n, down) = provider(503, &[]).await;
        let (up_n, up) = provider(200, &[]).await;
        let (bad_n, bad) = provider(401, &[]).await;
        let file = format!(
            "[[provider]]\nname = \"down\"\nbase_url = \"{down}\"\n[[provider]]\nname = \"up\"\nbase_url = \"{up}\"\n\
             [[provider]]\nname = \"bad\"\nbase_url = \"{bad}\"\n\
             [[model]]\nname = \"fast\"\ntargets = [\"down/m1\", \"up/m2\"]\n\
             [[model]]\nname = \"wrong\"\ntargets = [\"bad/m3\", \"up/m2\"]\n\
             [model_retry]\nattempts = 2\nbackoff_ms = 1\nbackoff_max_ms = 2\n"
        );
        let r = registry(&file, "fast").unwrap();
        let sink = Collect::default();
        let answer = ask(&r, &sink, json!({ "messages": [{ "role": "user", "content": "hi" }] })).await.unwrap();
        assert_eq!(answer["content"], "from m2");
        let a = attempts(&sink);
        assert_eq!(a.len(), 2, "{a:?}");
        assert_eq!(
            (&a[0]["provider"], &a[0]["outcome"], &a[0]["status"]),
            (&json!("down"), &json!("fallback"), &json!(503))
        );
        assert_eq!((&a[1]["provider"], &a[1]["model"], &a[1]["outcome"]), (&json!("up"), &json!("m2"), &json!("ok")));
        assert_eq!((down_n.load(Ordering::SeqCst), up_n.load(Ordering::SeqCst)), (1, 1));

        // A plugin may name the alias, a provider's model, or a model of the only... none here.
        let sink = Collect::default();
        let e = ask(&r, &sink, json!({ "model": "wrong", "messages": [{ "role": "user", "content": "hi" }] }))
            .await
            .unwrap_err();
        assert_eq!(e, HostError::ToolFailed("model endpoint answered 401 Unauthorized: no".into()));
        assert_eq!(bad_n.load(Ordering::SeqCst), 1, "a 401 is not retried, nor does it fall back");
        assert_eq!(attempts(&sink)[0]["outcome"], "error");
        let sink = Collect::default();
        let answer = ask(&r, &sink, json!({ "model": "up/other", "messages": [{ "role": "user", "content": "hi" }] }))
            .await
            .unwrap();
        assert_eq!(answer["content"], "from other");
        let e = ask(&r, &sink, json!({ "model": "nope", "messages": [{ "role": "user", "content": "hi" }] }))
            .await
            .unwrap_err();
        assert!(matches!(&e, HostError::Invalid(m) if m.contains("\"nope\" is no [[model]] alias")), "{e:?}");

        // Both down: the rounds of the policy, each target once a round.
        let file = format!(
            "[[provider]]\nname = \"down\"\nbase_url = \"{down}\"\n[[provider]]\nname = \"bad\"\nbase_url = \"{down}\"\n\
             [[model]]\nname = \"fast\"\ntargets = [\"down/m1\", \"bad/m2\"]\n\
             [model_retry]\nattempts = 2\nbackoff_ms = 1\nbackoff_max_ms = 2\n"
        );
        let r = registry(&file, "fast").unwrap();
        let sink = Collect::default();
        let e = ask(&r, &sink, json!({ "messages": [{ "role": "user", "content": "hi" }] })).await.unwrap_err();
        assert_eq!(
            e,
            HostError::ToolFailed("model endpoint answered 503 Service Unavailable (after 4 attempts): no".into())
        );
        let outcomes: Vec<Value> = attempts(&sink).iter().map(|a| a["outcome"].clone()).collect();
        assert_eq!(outcomes, [json!("fallback"), json!("retry"), json!("fallback"), json!("error")]);
    }

    #[tokio::test]
    async fn a_retry_after_without_a_shared_limit_is_waited_out_by_the_call() {
        let (n, url) = provider(429, &[("retry-after-ms", "300")]).await;
        let file = format!("[[provider]]\nname = \"p\"\nbase_url = \"{url}\"\n[model_retry]\nattempts = 2\nbackoff_ms = 1\nbackoff_max_ms = 2\n");
        let r = registry(&file, "m").unwrap();
        let sink = Collect::default();
        let started = std::time::Instant::now();
        let e = ask(&r, &sink, json!({ "messages": [{ "role": "user", "content": "hi" }] })).await.unwrap_err();
        assert!(started.elapsed() >= Duration::from_millis(300), "{:?}", started.elapsed());
        assert_eq!(n.load(Ordering::SeqCst), 2);
        assert!(
            matches!(e, HostError::ToolFailed(m) if m.starts_with("model endpoint answered 429 Too Many Requests (after 2 attempts)"))
        );
        assert_eq!(attempts(&sink)[0]["retry_after_ms"], 300);
    }

    #[test]
    fn bad_models_config_is_refused_at_start() {
        for (file, why) in [
            ("[[model]]\nname = \"a\"\ntargets = [\"x\"]\n", "is not <provider>/<model>"),
            ("[[model]]\nname = \"a\"\ntargets = [\"x/y\"]\n", "names no provider"),
            ("[[provider]]\nname = \"p\"\nbase_url = \"ftp://x\"\n", "base_url"),
            ("[[provider]]\nname = \"p\"\nbase_url = \"http://x\"\n[[limit]]\nprovider = \"q\"\n", "names no provider"),
            ("[[provider]]\nname = \"p\"\nbase_url = \"http://x\"\n[[limit]]\nprovider = \"p\"\nconcurrent = 0\n", "at least 1"),
            ("[[provider]]\nname = \"p\"\nbase_url = \"http://x\"\n[[limit]]\nprovider = \"p\"\nminute_ms = 5\n", "minute_ms"),
            ("[model_retry]\nattempts = 0\n", "attempts must be 1 to 10"),
            (
                "[[provider]]\nname = \"p\"\nbase_url = \"http://x\"\n[[provider]]\nname = \"q\"\nbase_url = \"http://x\"\n",
                "--llm-model",
            ),
        ] {
            let e = registry(file, "gpt").err().unwrap_or_else(|| panic!("{file} was accepted"));
            assert!(e.contains(why), "{file}: {e}");
        }
        // One provider: a bare model name is its.
        assert!(registry("[[provider]]\nname = \"p\"\nbase_url = \"http://x\"\n", "gpt").is_ok());
    }

    #[test]
    fn backoff_doubles_with_jitter_up_to_its_cap() {
        let r = RetryConfig { attempts: 5, backoff_ms: 100, backoff_max_ms: 300 };
        for _ in 0..50 {
            let b = |n| r.backoff(n).as_millis() as u64;
            assert!((50..=100).contains(&b(1)) && (100..=200).contains(&b(2)) && (150..=300).contains(&b(3)));
            assert!((150..=300).contains(&b(9)));
        }
    }
}
