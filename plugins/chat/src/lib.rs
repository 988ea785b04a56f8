//! A chat agent: ask the model, run the tools it asks for, ask again with
//! their results, until it answers in text. The host streams the model's text
//! to the run as it arrives, so this loop emits no deltas of its own.
//!
//! Config: `system` (a system prompt), `tools` (what the model is offered:
//! `[{name, description, parameters}]`, each also granted in the manifest),
//! `max_steps` (model calls per turn, default 8).

use agent_plugin::{export_agent, json, Agent, HostError, Refusal, Turn, Value};

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
        let tools = turn.config.get("tools").cloned().unwrap_or_else(|| json!([]));
        let max_steps = turn.config_u64("max_steps", 8).clamp(1, 64);
        for n in 1..=max_steps {
            turn.emit("step", &json!({ "n": n }))?;
            let answer = turn.call_tool("llm", &json!({ "messages": messages, "tools": tools }))?;
            let content = answer["content"].as_str().unwrap_or_default().to_string();
            let calls = answer["tool_calls"].as_array().cloned().unwrap_or_default();
            if calls.is_empty() {
                return Ok(content);
            }
            messages.push(json!({ "role": "assistant", "content": content, "tool_calls": calls }));
            for call in &calls {
                let result = run_tool(&turn, call)?;
                messages.push(json!({ "role": "tool", "tool_call_id": call["id"], "content": result }));
            }
        }
        Err(format!("no final answer after {max_steps} model calls"))
    }
}

/// One tool call the model asked for. Its failure is told to the model, which
/// can try otherwise; only a stop or a lost run ends the turn.
fn run_tool(turn: &Turn, call: &Value) -> Result<String, Refusal> {
    let name = call["name"].as_str().unwrap_or_default();
    let args: Value = match serde_json::from_str(call["arguments"].as_str().unwrap_or("{}")) {
        Ok(args) => args,
        Err(e) => return Ok(format!("error: the arguments are not JSON: {e}")),
    };
    match turn.call_tool(name, &args) {
        Ok(Value::String(text)) => Ok(text),
        Ok(answer) => Ok(answer.to_string()),
        Err(e @ Refusal(HostError::Cancelled | HostError::Fenced)) => Err(e),
        Err(e) => Ok(format!("error: {e}")),
    }
}

export_agent!(Chat);
