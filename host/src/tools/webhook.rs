//! Operator-defined webhook tools: a guest's call becomes one POST to the
//! configured URL. The receiver gets an `Idempotency-Key` of
//! `{run_id}:{call_index}`, so it can make its side effect happen once even if
//! it sees the same call twice. Guests never see the URL or the headers.

use std::time::Duration;

use async_trait::async_trait;
use reqwest::header::HeaderMap;
use serde_json::{json, Value};

use super::models::{Failed, RetryConfig};
use super::{body_snippet, describe, read_capped, EventSink, Tool, ToolCall, WebhookConfig};
use crate::error::HostError;

pub(crate) struct Webhook {
    client: reqwest::Client,
    url: String,
    headers: HeaderMap,
    timeout: Duration,
    max_response_bytes: usize,
    idempotent: bool,
    approval: bool,
    description: Option<String>,
    retry: Option<RetryConfig>,
}

impl Webhook {
    /// `headers` are the config's, as checked by [`WebhookConfig::check`].
    pub fn new(config: &WebhookConfig, headers: HeaderMap, client: reqwest::Client) -> Self {
        Webhook {
            client,
            url: config.url.clone(),
            headers,
            timeout: Duration::from_millis(config.timeout_ms),
            max_response_bytes: usize::try_from(config.max_response_bytes).unwrap_or(usize::MAX),
            idempotent: config.idempotent,
            approval: config.approval == Some(super::config::Approval::Always),
            description: config.description.clone(),
            retry: config.retry.clone(),
        }
    }

    /// One attempt: the answer, or the failure and whether another attempt
    /// may be made (see [`WebhookConfig::retry`]) and how long to wait first.
    async fn attempt(&self, call: &ToolCall<'_>) -> Result<Value, Failed> {
        let name = call.name;
        let call_id = format!("{}:{}", call.run_id, call.call_index);
        let body = json!({ "run_id": call.run_id.to_string(), "call_id": call_id, "name": name, "args": call.args });
        let resp = match self
            .client
            .post(&self.url)
            .headers(self.headers.clone())
            .header("Idempotency-Key", &call_id)
            .json(&body)
            .send()
            .await
        {
            Ok(resp) => resp,
            Err(e) => {
                // Not connected: the receiver never saw the call.
                let retryable = e.is_connect();
                let error = HostError::ToolFailed(format!("webhook {name:?} could not be called: {}", describe(e)));
                return Err(Failed { error, status: None, after: None, retryable });
            }
        };
        let status = resp.status();
        if !status.is_success() {
            let after = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(|s| Duration::from_secs(s.min(600)));
            let retryable = self.idempotent && (matches!(status.as_u16(), 408 | 429) || status.is_server_error());
            let secrets: Vec<&str> = self
                .headers
                .values()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| [v, v.split_once(' ').map_or(v, |(_, secret)| secret)])
                .collect();
            let snippet = body_snippet(resp, &secrets).await;
            let error = HostError::ToolFailed(format!("webhook {name:?} answered {status}{snippet}"));
            return Err(Failed { error, status: Some(status.as_u16()), after, retryable });
        }
        let max = self.max_response_bytes;
        let fail = |error: HostError| Failed { error, status: Some(status.as_u16()), after: None, retryable: false };
        let bytes = read_capped(resp, max)
            .await
            .map_err(|e| {
                fail(HostError::ToolFailed(format!("webhook {name:?}: reading the answer failed: {}", describe(e))))
            })?
            .ok_or_else(|| fail(HostError::ToolFailed(format!("webhook {name:?}: response exceeds {max} bytes"))))?;
        // A receiver that answers plain text still answers something useful.
        Ok(serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned())))
    }
}

#[async_trait]
impl Tool for Webhook {
    /// Attempts as the tool's `retry` says, each failed one that is retried
    /// journaled (`tool_attempt`); the registry's timeout bounds them all.
    async fn call(&self, call: &ToolCall<'_>, sink: &dyn EventSink) -> Result<Value, HostError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.attempt(call).await {
                Ok(answer) => return Ok(answer),
                Err(failed) => RetryConfig::again(self.retry.as_ref(), attempt, call, sink, failed).await?,
            }
        }
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn idempotent(&self) -> bool {
        self.idempotent
    }

    fn requires_approval(&self) -> bool {
        self.approval
    }

    fn describe(&self) -> (Option<String>, Value) {
        (self.description.clone(), json!({ "type": "object" }))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use axum::extract::State;
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use axum::{Json, Router};
    use tokio::sync::Notify;

    use super::super::test_support::{call, serve, Collect};
    use super::super::{LlmConfig, ToolRegistry};
    use super::*;
    use crate::db::events::TOOL_ATTEMPT;

    /// What the receiver saw, and a bell it rings when a request arrives.
    #[derive(Default)]
    struct Receiver {
        seen: Mutex<Vec<(HeaderMap, Value)>>,
        arrived: Notify,
    }

    async fn receive(
        State(r): State<Arc<Receiver>>,
        axum::extract::Path(mode): axum::extract::Path<String>,
        headers: HeaderMap,
        Json(body): Json<Value>,
    ) -> Response {
        r.seen.lock().unwrap().push((headers, body.clone()));
        r.arrived.notify_one();
        match mode.as_str() {
            "ok" => Json(json!({ "echo": body["args"], "ok": true })).into_response(),
            // 503 to a tool's first call, then answers.
            "flaky" => match r.seen.lock().unwrap().iter().filter(|(_, b)| b["name"] == body["name"]).count() {
                1 => (StatusCode::SERVICE_UNAVAILABLE, "later").into_response(),
                _ => Json(json!({ "ok": true })).into_response(),
            },
            "text" => "plain words".into_response(),
            "missing" => (StatusCode::NOT_FOUND, "no such city").into_response(),
            "broken" => (StatusCode::BAD_GATEWAY, "").into_response(),
            "redirect" => (StatusCode::FOUND, [("location", "http://127.0.0.1:1/elsewhere")]).into_response(),
            // Chunked, so the cap is met while reading rather than from a Content-Length.
            "big" => {
                let chunks = (0..10).map(|_| Ok::<_, std::io::Error>("x".repeat(1000)));
                axum::body::Body::from_stream(futures::stream::iter(chunks)).into_response()
            }
            // Never answers: the client's timeout or cancel must end the call.
            "hang" => std::future::pending().await,
            other => panic!("unknown mode {other}"),
        }
    }

    /// The offline model and `hooks`.
    fn registry(hooks: &[WebhookConfig]) -> ToolRegistry {
        let llm = LlmConfig {
            base_url: None,
            api_key: None,
            model: "m".into(),
            timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
        };
        ToolRegistry::from_config(&llm, hooks).unwrap()
    }

    /// A registry with one webhook per receiver mode, all pointing at a fresh receiver.
    async fn start() -> (Arc<Receiver>, ToolRegistry) {
        let receiver = Arc::new(Receiver::default());
        let router = Router::new().route("/hook/{mode}", post(receive)).with_state(receiver.clone());
        let addr = serve(router).await;
        let hooks: Vec<WebhookConfig> = ["ok", "text", "missing", "broken", "redirect", "big", "hang"]
            .into_iter()
            .map(|mode| WebhookConfig {
                name: mode.into(),
                url: format!("http://{addr}/hook/{mode}"),
                // Short only where the test waits for it.
                timeout_ms: if mode == "hang" { 300 } else { 10_000 },
                max_response_bytes: 4096,
                headers: [("Authorization".to_string(), "Bearer operator-secret".to_string())].into(),
                description: None,
                idempotent: false,
                approval: None,
                tenants: None,
                retry: None,
            })
            .collect();
        (receiver, registry(&hooks))
    }

    async fn invoke(r: &ToolRegistry, sink: &Collect, name: &str) -> Result<Value, HostError> {
        let answer = r.invoke(call(name, json!({ "city": "Lyon" })), sink, std::future::pending()).await?;
        Ok(serde_json::from_str(&answer).unwrap())
    }

    /// A call that fails as `tool failed: {why}`, journaled with `outcome`;
    /// returns its `tool_call_finished` payload.
    async fn assert_fails(r: &ToolRegistry, name: &str, why: &str, outcome: &str) -> Value {
        let sink = Collect::default();
        assert_eq!(invoke(r, &sink, name).await.unwrap_err(), HostError::ToolFailed(why.into()));
        let finished = sink.finished();
        assert_eq!(finished["outcome"], outcome);
        finished
    }

    #[tokio::test]
    async fn a_2xx_answer_is_the_tool_result_and_the_receiver_gets_the_call() {
        let (receiver, r) = start().await;
        let sink = Collect::default();
        let c = call("ok", json!({ "city": "Lyon" }));
        let run_id = c.run_id;
        let answer = r.invoke(c, &sink, std::future::pending()).await.unwrap();
        assert_eq!(serde_json::from_str::<Value>(&answer).unwrap(), json!({ "echo": { "city": "Lyon" }, "ok": true }));
        let seen = receiver.seen.lock().unwrap();
        let (headers, body) = &seen[0];
        assert_eq!(
            *body,
            json!({
                "run_id": run_id.to_string(),
                "call_id": format!("{run_id}:7"),
                "name": "ok",
                "args": { "city": "Lyon" },
            })
        );
        assert_eq!(headers["idempotency-key"], format!("{run_id}:7"));
        assert_eq!(headers["authorization"], "Bearer operator-secret");
        assert_eq!(headers["content-type"], "application/json");
        assert_eq!(sink.finished()["outcome"], "ok");
    }

    #[tokio::test]
    async fn a_non_json_answer_is_a_json_string() {
        let (_, r) = start().await;
        assert_eq!(invoke(&r, &Collect::default(), "text").await.unwrap(), json!("plain words"));
    }

    #[tokio::test]
    async fn a_4xx_or_5xx_answer_names_the_status() {
        let (_, r) = start().await;
        let why = "webhook \"missing\" answered 404 Not Found: no such city";
        let finished = assert_fails(&r, "missing", why, "error").await;
        assert_eq!(finished["error"], "tool failed: webhook \"missing\" answered 404 Not Found: no such city");
        let e = invoke(&r, &Collect::default(), "broken").await.unwrap_err();
        assert_eq!(e, HostError::ToolFailed("webhook \"broken\" answered 502 Bad Gateway".into()));
    }

    #[tokio::test]
    async fn a_redirect_is_not_followed() {
        let (receiver, r) = start().await;
        let e = invoke(&r, &Collect::default(), "redirect").await.unwrap_err();
        assert_eq!(e, HostError::ToolFailed("webhook \"redirect\" answered 302 Found".into()));
        assert_eq!(receiver.seen.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_receiver_slower_than_the_timeout_ends_the_call() {
        let (receiver, r) = start().await;
        assert_fails(&r, "hang", "tool \"hang\" did not answer within 300 ms", "timeout").await;
        assert_eq!(receiver.seen.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn an_oversized_answer_is_refused() {
        let (_, r) = start().await;
        let e = invoke(&r, &Collect::default(), "big").await.unwrap_err();
        assert_eq!(e, HostError::ToolFailed("webhook \"big\": response exceeds 4096 bytes".into()));
    }

    #[tokio::test]
    async fn a_cancel_during_the_call_ends_it_cancelled() {
        let (receiver, r) = start().await;
        let sink = Collect::default();
        // The stop comes once the receiver holds the request.
        let cancelled = receiver.arrived.notified();
        let e = r.invoke(call("hang", json!({})), &sink, cancelled).await.unwrap_err();
        assert_eq!(e, HostError::Cancelled);
        assert_eq!(receiver.seen.lock().unwrap().len(), 1);
        let events = sink.events();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].0, "tool_call_started");
        assert_eq!(sink.finished()["outcome"], "cancelled");
    }

    #[tokio::test]
    async fn an_unreachable_receiver_is_a_tool_failure_without_its_url() {
        let addr = super::super::tests::closed_address();
        let hook = WebhookConfig {
            name: "gone".into(),
            url: format!("http://{addr}/secret-path?token=abc"),
            timeout_ms: 1000,
            max_response_bytes: 10,
            headers: Default::default(),
            description: None,
            idempotent: false,
            approval: None,
            tenants: None,
            retry: None,
        };
        let r = registry(&[hook]);
        let e = invoke(&r, &Collect::default(), "gone").await.unwrap_err();
        let HostError::ToolFailed(m) = e else { panic!("{e:?}") };
        assert!(m.starts_with("webhook \"gone\" could not be called: "), "{m}");
        assert!(!m.contains("token=abc") && !m.contains(&addr.to_string()), "{m}");
    }

    /// Issue 46: a webhook's retry policy retries a 5xx only when the tool
    /// is idempotent (the receiver may have acted), journaling the attempt.
    #[tokio::test]
    async fn an_idempotent_webhook_is_retried_past_a_5xx_and_another_is_not() {
        let receiver = Arc::new(Receiver::default());
        let router = Router::new().route("/hook/{mode}", post(receive)).with_state(receiver.clone());
        let addr = serve(router).await;
        let hook = |name: &str, idempotent: bool| WebhookConfig {
            name: name.into(),
            url: format!("http://{addr}/hook/flaky"),
            timeout_ms: 10_000,
            max_response_bytes: 4096,
            headers: Default::default(),
            description: None,
            idempotent,
            approval: None,
            tenants: None,
            retry: Some(RetryConfig { attempts: 3, backoff_ms: 1, backoff_max_ms: 2 }),
        };
        let r = registry(&[hook("again", true), hook("once", false)]);
        let sink = Collect::default();
        assert_eq!(invoke(&r, &sink, "again").await.unwrap(), json!({ "ok": true }));
        let attempts: Vec<Value> =
            sink.events().into_iter().filter(|(k, _)| k == TOOL_ATTEMPT).map(|(_, p)| p).collect();
        assert_eq!(attempts.len(), 1, "{attempts:?}");
        assert_eq!(attempts[0]["status"], 503);
        assert_eq!(attempts[0]["attempt"], 1);
        let e = invoke(&r, &Collect::default(), "once").await.unwrap_err();
        assert_eq!(e, HostError::ToolFailed("webhook \"once\" answered 503 Service Unavailable: later".into()));
        let names: Vec<Value> = receiver.seen.lock().unwrap().iter().map(|(_, b)| b["name"].clone()).collect();
        assert_eq!(names, [json!("again"), json!("again"), json!("once")]);
    }
}
