//! The completion-webhook sender, on every process: claims due outbox rows
//! (`db::webhooks`), POSTs each signed in the Standard Webhooks style, and
//! records the outcome: delivered, retried with backoff, or `failed` after
//! the bounded attempts. Every attempt of one delivery carries the same
//! `webhook-id`, so the receiver can drop repeats.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use hmac::{Hmac, Mac};
use serde_json::Value;
use sha2::Sha256;

use crate::db;

use super::Shared;

/// Deliveries one pass sends at most.
const BATCH_MAX: i64 = 32;
/// How long one attempt may take; also its lease on the row.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest pause between two attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(600);

/// How the sender signs and retries.
#[derive(Clone)]
pub struct WebhookConfig {
    /// The signing key (`AGENT_HOST_WEBHOOK_SECRET`; `whsec_<base64>` or raw).
    pub secret: Vec<u8>,
    /// Attempts per delivery before it is `failed`.
    pub attempts_max: u32,
    /// The first retry's pause; each next one doubles it.
    pub backoff: Duration,
    /// How often the sender looks for due deliveries.
    pub poll: Duration,
}

impl std::fmt::Debug for WebhookConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookConfig")
            .field("secret", &"<redacted>")
            .field("attempts_max", &self.attempts_max)
            .field("backoff", &self.backoff)
            .field("poll", &self.poll)
            .finish()
    }
}

/// A secret as the environment gives it: `whsec_` and base64 (as Standard
/// Webhooks writes them), or the raw bytes.
pub fn secret_bytes(secret: &str) -> Result<Vec<u8>, String> {
    match secret.strip_prefix("whsec_") {
        Some(b64) => base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| format!("AGENT_HOST_WEBHOOK_SECRET: whsec_ is not followed by base64: {e}")),
        None if secret.len() >= 16 => Ok(secret.as_bytes().to_vec()),
        None => Err("AGENT_HOST_WEBHOOK_SECRET must be at least 16 bytes (or whsec_<base64>)".into()),
    }
}

/// The key one tenant's deliveries are signed with: HMAC-SHA256, under the
/// operator's secret, of `agent-host webhook key for tenant <tenant>`. A
/// tenant's admin reads it from `GET /v1/webhooks/signing-key`; a key one
/// tenant's receiver holds verifies no other tenant's deliveries, and tells
/// nothing of the operator's secret.
pub fn tenant_key(secret: &[u8], tenant: &str) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(format!("agent-host webhook key for tenant {tenant}").as_bytes());
    mac.finalize().into_bytes().to_vec()
}

/// The `webhook-signature` value: `v1,` and base64 of HMAC-SHA256 over
/// `{id}.{timestamp}.{body}`.
pub fn sign(secret: &[u8], id: &str, timestamp: i64, body: &str) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(format!("{id}.{timestamp}.{body}").as_bytes());
    format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes()))
}

pub(super) async fn run(shared: Arc<Shared>, config: WebhookConfig) {
    let client = match reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .timeout(ATTEMPT_TIMEOUT)
        .build()
    {
        Ok(c) => c,
        Err(e) => return tracing::error!(error = %e, "the webhook sender cannot build its HTTP client"),
    };
    let poll = config.poll;
    super::every(&shared, poll, false, || async {
        if let Err(e) = pass(&shared, &client, &config).await {
            tracing::warn!(error = %e, "webhook pass failed");
        }
    })
    .await;
}

async fn pass(shared: &Shared, client: &reqwest::Client, config: &WebhookConfig) -> Result<(), sqlx::Error> {
    let lease = ATTEMPT_TIMEOUT.as_secs_f64() + 5.0;
    let mut due = db::webhooks::claim_due(&shared.pool, BATCH_MAX, lease, config.attempts_max as i32).await?;
    due.sort_by_key(|d| d.created_at);
    // One receiver's deliveries of one run in the order they were written
    // (an A2A task's state changes), different ones at once.
    let mut groups: Vec<Vec<db::webhooks::Due>> = Vec::new();
    for d in due {
        match groups.iter_mut().find(|g| g[0].run_id == d.run_id && g[0].url == d.url) {
            Some(g) => g.push(d),
            None => groups.push(vec![d]),
        }
    }
    let send = |d: db::webhooks::Due| async move {
        let body = d.payload.to_string();
        let id = d.id.to_string();
        let timestamp = chrono::Utc::now().timestamp();
        let mut request = client.post(&d.url);
        for (name, value) in d.headers.iter().filter_map(Value::as_object).flatten() {
            if let Some(value) = value.as_str() {
                request = request.header(name.as_str(), value);
            }
        }
        let sent = request
            .header("content-type", "application/json")
            .header("webhook-id", &id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", sign(&tenant_key(&config.secret, &d.tenant_id), &id, timestamp, &body))
            .body(body)
            .send()
            .await;
        let error = match sent {
            Ok(r) if r.status().is_success() => None,
            Ok(r) => Some(format!("the receiver answered {}", r.status())),
            Err(e) => Some(format!("the receiver could not be reached: {}", e.without_url())),
        };
        (d, error)
    };
    let sends = groups.into_iter().map(|group| async move {
        let mut sent = Vec::with_capacity(group.len());
        for d in group {
            sent.push(send(d).await);
        }
        sent
    });
    for (d, error) in futures::future::join_all(sends).await.into_iter().flatten() {
        let stats = &shared.stats;
        match error {
            None => {
                db::webhooks::delivered(&shared.pool, d.id, d.attempts).await?;
                stats.webhooks_delivered.fetch_add(1, Ordering::Relaxed);
            }
            Some(error) => {
                let retry = (d.attempts < config.attempts_max as i32).then(|| {
                    let pause = config.backoff.saturating_mul(1 << (d.attempts - 1).clamp(0, 20));
                    pause.min(BACKOFF_MAX).as_secs_f64()
                });
                let failed = db::webhooks::attempt_failed(&shared.pool, d.id, d.attempts, &error, retry).await?;
                let counter = if failed { &stats.webhooks_failed } else { &stats.webhooks_retried };
                counter.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(run_id = %d.run_id, attempt = d.attempts, failed, %error, "webhook delivery failed");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The Standard Webhooks specification's own example.
    #[test]
    fn signatures_match_the_standard_webhooks_example() {
        let secret = super::secret_bytes("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = r#"{"test": 2432232314}"#;
        let signature = super::sign(&secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body);
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }
}
