//! {{name}}: a chat agent. Each turn sends the conversation to the model (the
//! host's `llm` tool) with the other tools manifest.json grants offered to
//! it, runs the calls the model asks for and asks again with their answers,
//! until the model answers in text. The host streams the model's text into
//! the run as it arrives. A stop asked for ends the turn `cancelled` at the
//! next step.
//!
//! Grant a tool in manifest.json (`"tools": ["llm", "clock"]` on the demo
//! host, or an MCP server's `"docs.search"`) and the model is offered it.

use agent_plugin::{export_agent, json, serde_json, Agent, HostError, Refusal, Turn, Value};

const MAX_STEPS: usize = 8;

struct Chat;

/// One call the model asked for; a failure is told to the model.
fn call(turn: &Turn, c: &Value) -> Result<String, Refusal> {
    let args = match serde_json::from_str(c["arguments"].as_str().unwrap_or("{}")) {
        Ok(args) => args,
        Err(e) => return Ok(format!("error: the arguments are not JSON: {e}")),
    };
    match turn.call_tool(c["name"].as_str().unwrap_or_default(), &args) {
        Ok(Value::String(text)) => Ok(text),
        Ok(answer) => Ok(answer.to_string()),
        Err(e @ Refusal(HostError::Cancelled | HostError::Fenced)) => Err(e),
        Err(e) => Ok(format!("error: {e}")),
    }
}

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
        let tools = turn.model_tools(); // the granted tools, named as a model takes them
        for _ in 0..MAX_STEPS {
            turn.check_cancel()?; // a stop was asked for: the turn ends cancelled
            let answer = turn.call_tool("llm", &json!({ "messages": messages, "tools": tools }))?;
            let calls = answer["tool_calls"].as_array().cloned().unwrap_or_default();
            if calls.is_empty() {
                return Ok(answer["content"].as_str().unwrap_or_default().to_string());
            }
            messages.push(json!({ "role": "assistant", "content": answer["content"], "tool_calls": calls }));
            for c in &calls {
                messages.push(json!({ "role": "tool", "tool_call_id": c["id"], "content": call(&turn, c)? }));
            }
        }
        Err(format!("no answer after {MAX_STEPS} model calls"))
    }
}

export_agent!(Chat);
