//! {{name}}: a chat agent. Each turn sends the conversation to the model (the
//! host's `llm` tool, granted in manifest.json) and returns its answer; the
//! host streams the model's text into the run as it arrives. A stop asked for
//! before the model call ends the turn `cancelled`.

use agent_plugin::{export_agent, json, Agent, Turn, Value};

struct Chat;

impl Agent for Chat {
    fn run(turn: Turn) -> Result<String, String> {
        let mut messages = Vec::new();
        if let Some(system) = turn.config.get("system").and_then(Value::as_str) {
            messages.push(json!({ "role": "system", "content": system }));
        }
        for m in &turn.history {
            messages.push(json!({ "role": m.role, "content": m.content }));
        }
        messages.push(json!({ "role": "user", "content": turn.content }));
        turn.check_cancel()?; // a stop was asked for: the turn ends cancelled
        let answer = turn.call_tool("llm", &json!({ "messages": messages }))?;
        Ok(answer["content"].as_str().unwrap_or_default().to_string())
    }
}

export_agent!(Chat);
