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
        let (tools, names) = offered(&turn);
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
                let result = run_tool(&turn, call, &names)?;
                messages.push(json!({ "role": "tool", "tool_call_id": call["id"], "content": result }));
            }
        }
        Err(format!("no final answer after {max_steps} model calls"))
    }
}

/// The longest tool name the `llm` tool accepts.
const MODEL_NAME_BYTES_MAX: usize = 64;

/// A model's tool names are 1-64 letters, digits, `_` and `-`: another
/// character of a host tool's name (the `.` of `<server>.<tool>`) is offered
/// as `_`, and a longer name is cut and ends with `_` and a hash of the
/// whole name (so two long names stay apart). `offered` maps it back.
fn model_name(name: &str) -> String {
    let clean: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' }).collect();
    if !clean.is_empty() && clean.len() <= MODEL_NAME_BYTES_MAX {
        return clean;
    }
    // FNV-1a, 32 bits: stable across builds and hosts.
    let hash = name.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
    let suffix = format!("_{hash:08x}");
    // `clean` is ASCII: any byte index is a character boundary.
    let keep = clean.len().min(MODEL_NAME_BYTES_MAX - suffix.len());
    format!("{}{suffix}", &clean[..keep])
}

/// The tools the model is offered, and the host tool each offered name
/// stands for (where it differs).
fn offered(turn: &Turn) -> (Value, Vec<(String, String)>) {
    let tools = turn.config.get("tools").cloned().unwrap_or_else(|| json!([]));
    if tools.as_str() != Some("granted") {
        return (tools, Vec::new());
    }
    let mut offered = Vec::new();
    let mut names = Vec::new();
    for t in turn.granted_tools().into_iter().filter(|t| t.name != "llm" && t.name != "wait") {
        let name = model_name(&t.name);
        if names.iter().any(|(n, _): &(String, String)| *n == name) {
            continue;
        }
        let parameters: Value = serde_json::from_str(&t.input_schema).unwrap_or_else(|_| json!({ "type": "object" }));
        offered.push(json!({ "name": name, "description": t.description, "parameters": parameters }));
        names.push((name, t.name));
    }
    for t in &turn.client_tools {
        let parameters: Value = serde_json::from_str(&t.parameters).unwrap_or_else(|_| json!({ "type": "object" }));
        offered.push(json!({ "name": t.name, "description": t.description, "parameters": parameters }));
    }
    (Value::Array(offered), names)
}

/// One tool call the model asked for. Its failure is told to the model, which
/// can try otherwise; only a stop or a lost run ends the turn.
fn run_tool(turn: &Turn, call: &Value, names: &[(String, String)]) -> Result<String, Refusal> {
    let name = call["name"].as_str().unwrap_or_default();
    let name = names.iter().find(|(offered, _)| offered == name).map_or(name, |(_, host)| host.as_str());
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

#[cfg(test)]
mod tests {
    use super::model_name;

    #[test]
    fn every_offered_name_is_one_the_llm_tool_accepts() {
        assert_eq!(model_name("docs.search"), "docs_search");
        let long = format!("docs.{}", "x".repeat(120));
        let other = format!("docs.{}y", "x".repeat(119));
        let (a, b) = (model_name(&long), model_name(&other));
        assert_eq!(a.len(), 64);
        assert_ne!(a, b, "two long names stay apart");
        assert!(a.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-'), "{a}");
        assert_eq!(model_name(&long), a, "the same name maps the same way");
    }
}
