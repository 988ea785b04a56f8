//! A chat agent: ask the model, run the tools it asks for, ask again with
//! their results, until it answers in text. The host streams the model's text
//! to the run as it arrives, so this loop emits no deltas of its own.
//!
//! Config: `system` (a system prompt), `tools` (what the model is offered:
//! `[{name, description, parameters}]`, each granted in the manifest or
//! named in `client_tools`), `client_tools` (names of functions the client
//! runs: a call of one ends the turn with a `function_call` event
//! `{call_id, name, arguments}` per such call, which the Responses API shows
//! as `function_call` items), `input` (chat messages that are this turn, in
//! place of the user's message: the Responses API's input items),
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
        match turn.config.get("input").and_then(Value::as_array) {
            Some(input) => messages.extend(input.iter().cloned()),
            None => messages.push(json!({ "role": "user", "content": turn.content })),
        }
        let tools = turn.config.get("tools").cloned().unwrap_or_else(|| json!([]));
        let client_tools: Vec<&str> = turn
            .config
            .get("client_tools")
            .and_then(Value::as_array)
            .map(|names| names.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let max_steps = turn.config_u64("max_steps", 8).clamp(1, 64);
        for n in 1..=max_steps {
            turn.emit("step", &json!({ "n": n }))?;
            let answer = turn.call_tool("llm", &json!({ "messages": messages, "tools": tools }))?;
            let content = answer["content"].as_str().unwrap_or_default().to_string();
            let calls = answer["tool_calls"].as_array().cloned().unwrap_or_default();
            if calls.is_empty() {
                return Ok(content);
            }
            // Calls the client runs end the turn: the client answers them in its next one.
            let for_client: Vec<&Value> =
                calls.iter().filter(|c| client_tools.contains(&c["name"].as_str().unwrap_or_default())).collect();
            if !for_client.is_empty() {
                for call in for_client {
                    let call = json!({ "call_id": call["id"], "name": call["name"], "arguments": call["arguments"] });
                    turn.emit("function_call", &call)?;
                }
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
