//! Built-in agents, for demos, tests and the benchmark: they run in the host
//! process behind the same [`Agent`] trait and [`RunHost`] as Wasm guests.

use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;

use super::{Agent, AgentError, HostError, RunHost, RunInput};

/// Returns at once with an empty answer: the queue's own cost, nothing else.
pub struct Noop;

#[async_trait]
impl Agent for Noop {
    async fn run(&self, _host: &RunHost, _input: RunInput) -> Result<String, AgentError> {
        Ok(String::new())
    }
}

/// Streams the user's message back word by word, then returns it.
pub struct Echo;

#[async_trait]
impl Agent for Echo {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        for word in input.content.split_inclusive(' ') {
            host.emit_delta(word).await?;
        }
        Ok(input.content)
    }
}

/// A long turn for demos and tests: `config.steps` deltas (default 10), one
/// every `config.step_ms` (default 100), stopping at once when cancelled.
pub struct Sleep;

#[async_trait]
impl Agent for Sleep {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        let steps = input.config.get("steps").and_then(Value::as_u64).unwrap_or(10).min(100_000);
        let step_ms = input.config.get("step_ms").and_then(Value::as_u64).unwrap_or(100).min(3_600_000);
        let mut text = String::new();
        for i in 0..steps {
            tokio::select! {
                _ = host.cancelled() => return Err(HostError::Cancelled.into()),
                _ = tokio::time::sleep(Duration::from_millis(step_ms)) => {}
            }
            let piece = format!("step {i}. ");
            host.emit_delta(&piece).await?;
            text.push_str(&piece);
        }
        Ok(text)
    }
}
