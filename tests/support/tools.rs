#![allow(dead_code)]
//! Helpers for the tools tests (tests/mcp.rs, tests/http_tool.rs): an event
//! sink that collects what a call journaled, and a tools file from its text
//! with `${env:...}` taken from a given list (never the process's
//! environment, which the tests' threads share).

use std::sync::Mutex;

use agent_host::error::HostError;
use agent_host::tools::{EventSink, ToolsConfig};
use async_trait::async_trait;
use serde_json::Value;

/// What a call journaled, collected.
#[derive(Default)]
pub struct Sink(pub Mutex<Vec<(String, Value)>>);

#[async_trait]
impl EventSink for Sink {
    async fn delta(&self, _text: &str) -> Result<(), HostError> {
        Ok(())
    }

    async fn event(&self, kind: &str, payload: Value) -> Result<(), HostError> {
        self.0.lock().unwrap().push((kind.to_string(), payload));
        Ok(())
    }
}

impl Sink {
    /// The last `tool_call_finished` payload.
    pub fn finished(&self) -> Value {
        let events = self.0.lock().unwrap();
        events.iter().rev().find(|(k, _)| k == "tool_call_finished").expect("tool_call_finished").1.clone()
    }
}

/// A tools file's text, checked, with `env` for `${env:...}`.
pub fn tools_file(text: &str, env: &[(&str, &str)]) -> ToolsConfig {
    let lookup = |name: &str| env.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string());
    agent_host::tools::parse_tools_file_with(text, &lookup).unwrap()
}
