//! A chat agent: ask the model, run the tools it asks for, ask again with
//! their results, until it answers in text. The host streams the model's text
//! to the run as it arrives, so this loop emits no deltas of its own.
//!
//! Config: `system` (a system prompt), `tools` (what the model is offered:
//! `[{name, description, parameters}]`, each granted in the manifest or
//! a function the client runs; or `"granted"`: every host tool the plugin
//! was granted but the model itself and `wait`, as the host lists them, an
//! MCP server's included, plus the client's functions), `input` (chat messages that are this turn, in
//! place of the user's message: the Responses API's input items),
//! `max_steps` (model calls per turn, default 8).
//!
//! Functions the client runs (the turn's `client_tools`, the Responses API's
//! `function` tools): a model call of one ends the turn with it, as a client
//! call of the 0.2.0 world (the Responses API shows a `function_call` item);
//! the client answers in its next turn.

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
        let tools = offered(&turn);
        let max_steps = turn.config_u64("max_steps", 8).clamp(1, 64);
        for n in 1..=max_steps {
            turn.emit("step", &json!({ "n": n }))?;
            // Instructions queued for this turn since the last step (steering).
            for instruction in turn.take_instructions()? {
                messages.push(json!({ "role": "user", "content": instruction }));
            }
            let answer = turn.call_tool("llm", &json!({ "messages": messages, "tools": tools }))?;
            let content = answer["content"].as_str().unwrap_or_default().to_string();
            let calls = answer["tool_calls"].as_array().cloned().unwrap_or_default();
            if calls.is_empty() {
                return Ok(content);
            }
            // Calls the client runs end the turn: the client answers them in its next one.
            let str_of = |call: &Value, k: &str| call[k].as_str().unwrap_or_default().to_string();
            let for_client: Vec<&Value> = calls.iter().filter(|c| turn.is_client_tool(&str_of(c, "name"))).collect();
            if !for_client.is_empty() {
                for call in for_client {
                    turn.call_client(&str_of(call, "id"), &str_of(call, "name"), &str_of(call, "arguments"))?;
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

/// The tools the model is offered: the config's list as it is, or for
/// `"granted"` the SDK's [`Turn::model_tools`] and the client's functions.
fn offered(turn: &Turn) -> Value {
    let tools = turn.config.get("tools").cloned().unwrap_or_else(|| json!([]));
    if tools.as_str() != Some("granted") {
        return tools;
    }
    let mut offered = turn.model_tools();
    for t in &turn.client_tools {
        let parameters: Value = serde_json::from_str(&t.parameters).unwrap_or_else(|_| json!({ "type": "object" }));
        offered.push(json!({ "name": t.name, "description": t.description, "parameters": parameters }));
    }
    Value::Array(offered)
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
