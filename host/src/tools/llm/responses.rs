//! OpenAI's Responses API as a provider's protocol (`protocol = "responses"`
//! on a `[[provider]]`): the guest's chat request as a `POST
//! {base_url}/responses` body (stateless: `store: false`, the whole
//! conversation as input items), and the provider's typed event stream
//! folded into the same reply a chat-completions stream gives, so the guest,
//! the journal, the limits and the fallback see no difference.

use super::stream::{calls_in_order, take_text, CallSoFar};
use super::*;

/// The request body: messages as input items (an assistant's tool calls as
/// `function_call` items, a tool's answer as `function_call_output`), the
/// guest's tools as function tools.
pub(super) fn body(args: &LlmArgs, model: &str) -> Value {
    let mut input = Vec::with_capacity(args.messages.len());
    for m in &args.messages {
        match m.role {
            Role::System => input.push(json!({ "role": "system", "content": m.text() })),
            Role::User => input.push(json!({ "role": "user", "content": m.text() })),
            Role::Assistant => {
                if !m.text().is_empty() || m.tool_calls.is_empty() {
                    input.push(json!({ "role": "assistant", "content": m.text() }));
                }
                for c in &m.tool_calls {
                    input.push(json!({
                        "type": "function_call",
                        "call_id": c.id,
                        "name": c.name,
                        "arguments": c.arguments_text(),
                    }));
                }
            }
            Role::Tool => input.push(json!({
                "type": "function_call_output",
                "call_id": m.tool_call_id,
                "output": m.text(),
            })),
        }
    }
    let mut body = json!({ "model": model, "input": input, "stream": true, "store": false });
    if !args.tools.is_empty() {
        let tools: Vec<Value> = args
            .tools
            .iter()
            .map(|t| {
                let mut tool = json!({ "type": "function", "name": t.name, "parameters": t.schema(), "strict": false });
                if let Some(d) = &t.description {
                    tool["description"] = json!(d);
                }
                tool
            })
            .collect();
        body["tools"] = json!(tools);
    }
    if let Some(t) = args.temperature {
        body["temperature"] = json!(t);
    }
    if let Some(n) = args.max_tokens {
        body["max_output_tokens"] = json!(n);
    }
    body
}

/// The reply as the event stream has built it so far.
#[derive(Default)]
pub(super) struct Fold {
    content: String,
    /// Function calls by their output index.
    calls: BTreeMap<u64, CallSoFar>,
    /// `response.incomplete`'s reason (`max_output_tokens`, `content_filter`).
    incomplete: Option<String>,
    usage: Option<Usage>,
    model: Option<String>,
    bytes: usize,
    /// `response.completed` or `response.incomplete` was read: the reply is whole.
    pub(super) done: bool,
}

/// The usage a Responses API response reports.
#[derive(Deserialize)]
struct ResponsesUsage {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
    #[serde(default)]
    input_tokens_details: Option<InputDetails>,
}

#[derive(Deserialize)]
struct InputDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

fn error_message(error: &Value) -> String {
    let message = error.get("message").and_then(Value::as_str).map_or_else(|| error.to_string(), str::to_string);
    format!("model stream reported an error: {}", clip(&message, CHUNK_SNIPPET_BYTES))
}

impl Fold {
    /// Applies one event; returns its text, to be streamed. Events this
    /// host has no use for (reasoning, content parts, annotations) pass.
    pub(super) fn apply(&mut self, data: &str) -> Result<Option<String>, HostError> {
        if data.trim() == "[DONE]" {
            return Ok(None);
        }
        let event: Value = serde_json::from_str(data).map_err(|e| {
            failed(format!("model stream sent a malformed event ({e}): {}", clip(data, CHUNK_SNIPPET_BYTES)))
        })?;
        let kind = event.get("type").and_then(Value::as_str).unwrap_or_default();
        let index = event.get("output_index").and_then(Value::as_u64).unwrap_or(0);
        let str_at = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
        let mut text = None;
        match kind {
            "response.output_text.delta" | "response.refusal.delta" => text = str_at(&event, "delta"),
            "response.output_item.added" | "response.output_item.done" => {
                let item = event.get("item").unwrap_or(&Value::Null);
                if item.get("type").and_then(Value::as_str) == Some("function_call") {
                    let call = self.calls.entry(index).or_default();
                    if let Some(id) = str_at(item, "call_id").filter(|s| !s.is_empty()) {
                        call.id = id;
                    }
                    if let Some(name) = str_at(item, "name").filter(|s| !s.is_empty()) {
                        call.name = name;
                    }
                    if let Some(arguments) = str_at(item, "arguments").filter(|s| !s.is_empty()) {
                        self.bytes += arguments.len().saturating_sub(call.arguments.len());
                        call.arguments = arguments;
                    }
                }
            }
            "response.function_call_arguments.delta" => {
                if let Some(delta) = str_at(&event, "delta") {
                    self.bytes += delta.len();
                    self.calls.entry(index).or_default().arguments.push_str(&delta);
                }
            }
            "response.function_call_arguments.done" => {
                let call = self.calls.entry(index).or_default();
                if let Some(arguments) = str_at(&event, "arguments") {
                    self.bytes += arguments.len().saturating_sub(call.arguments.len());
                    call.arguments = arguments;
                }
                if let Some(name) = str_at(&event, "name").filter(|s| !s.is_empty()) {
                    call.name = name;
                }
            }
            "response.completed" | "response.incomplete" => {
                let response = event.get("response").unwrap_or(&Value::Null);
                self.model = str_at(response, "model").or(self.model.take());
                if let Some(u) = response.get("usage").filter(|u| !u.is_null()) {
                    let u = ResponsesUsage::deserialize(u)
                        .map_err(|e| failed(format!("model stream sent a malformed usage ({e})")))?;
                    let cached = u.input_tokens_details.and_then(|d| d.cached_tokens).unwrap_or(0);
                    let mut usage = Usage::new(u.input_tokens, u.output_tokens);
                    usage.cached_tokens = cached.min(u.input_tokens);
                    self.usage = Some(usage);
                }
                if kind == "response.incomplete" {
                    let reason = response.pointer("/incomplete_details/reason").and_then(Value::as_str);
                    self.incomplete = Some(reason.unwrap_or("incomplete").to_string());
                }
                self.done = true;
            }
            "response.failed" => {
                let error = event.pointer("/response/error").cloned().unwrap_or(Value::Null);
                return Err(failed(error_message(&error)));
            }
            "error" => return Err(failed(error_message(event.get("error").unwrap_or(&event)))),
            _ => {}
        }
        take_text(&mut self.content, &mut self.bytes, text.unwrap_or_default())
    }

    pub(super) fn finish(self, configured_model: &str) -> Result<Answer, HostError> {
        let tool_calls = calls_in_order(self.calls)?;
        let finish_reason = match self.incomplete.as_deref() {
            _ if !tool_calls.is_empty() => "tool_calls",
            None => "stop",
            Some("max_output_tokens") => "length",
            Some(reason) => reason,
        }
        .to_string();
        Ok(Answer {
            content: self.content,
            tool_calls,
            finish_reason,
            usage: self.usage,
            model: self.model.unwrap_or_else(|| configured_model.to_string()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: Value) -> LlmArgs {
        parse_args(&v).unwrap()
    }

    #[test]
    fn a_conversation_with_tool_calls_becomes_input_items() {
        let a = args(json!({
            "messages": [
                { "role": "system", "content": "Be brief." },
                { "role": "user", "content": "Weather in Oslo?" },
                { "role": "assistant", "content": null, "tool_calls": [
                    { "id": "call_1", "name": "weather", "arguments": "{\"city\":\"Oslo\"}" } ] },
                { "role": "tool", "tool_call_id": "call_1", "content": "sunny" },
            ],
            "tools": [ { "name": "weather", "description": "Looks it up." } ],
            "max_tokens": 50,
        }));
        let b = body(&a, "gpt-x");
        assert_eq!(b["model"], "gpt-x");
        assert_eq!(b["stream"], true);
        assert_eq!(b["max_output_tokens"], 50);
        let input = b["input"].as_array().unwrap();
        assert_eq!(input.len(), 4, "{input:?}");
        assert_eq!(
            input[2],
            json!({ "type": "function_call", "call_id": "call_1", "name": "weather",
                                     "arguments": "{\"city\":\"Oslo\"}" })
        );
        assert_eq!(input[3], json!({ "type": "function_call_output", "call_id": "call_1", "output": "sunny" }));
        assert_eq!(b["tools"][0]["type"], "function");
        assert_eq!(b["tools"][0]["description"], "Looks it up.");
    }

    #[test]
    fn events_fold_into_text_calls_usage_and_a_finish_reason() {
        let mut f = Fold::default();
        let events = [
            json!({ "type": "response.created", "response": { "id": "r" } }),
            json!({ "type": "response.output_text.delta", "output_index": 0, "delta": "Hel" }),
            json!({ "type": "response.output_text.delta", "output_index": 0, "delta": "lo" }),
            json!({ "type": "response.output_item.added", "output_index": 1,
                    "item": { "type": "function_call", "call_id": "c9", "name": "weather", "arguments": "" } }),
            json!({ "type": "response.function_call_arguments.delta", "output_index": 1, "delta": "{\"a\"" }),
            json!({ "type": "response.function_call_arguments.delta", "output_index": 1, "delta": ":1}" }),
        ];
        let mut streamed = String::new();
        for e in &events {
            if let Some(t) = f.apply(&e.to_string()).unwrap() {
                streamed.push_str(&t);
            }
        }
        assert_eq!(streamed, "Hello");
        assert!(!f.done);
        let done = json!({ "type": "response.incomplete", "response": { "model": "gpt-x-2026",
            "incomplete_details": { "reason": "max_output_tokens" },
            "usage": { "input_tokens": 10, "output_tokens": 4, "input_tokens_details": { "cached_tokens": 20 } } } });
        f.apply(&done.to_string()).unwrap();
        assert!(f.done);
        let a = f.finish("configured").unwrap();
        assert_eq!(a.content, "Hello");
        assert_eq!(a.model, "gpt-x-2026");
        assert_eq!(a.finish_reason, "tool_calls");
        assert_eq!((a.tool_calls[0].id.as_str(), a.tool_calls[0].arguments.as_str()), ("c9", "{\"a\":1}"));
        let u = a.usage.unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens, u.cached_tokens), (10, 4, 10));
    }

    #[test]
    fn a_failed_response_or_an_error_event_is_the_calls_error() {
        let failed = json!({ "type": "response.failed", "response": { "error": { "code": "server_error", "message": "overloaded" } } });
        let e = Fold::default().apply(&failed.to_string()).unwrap_err();
        assert!(e.to_string().contains("overloaded"), "{e}");
        let error = json!({ "type": "error", "code": "rate_limit_exceeded", "message": "slow down" });
        let e = Fold::default().apply(&error.to_string()).unwrap_err();
        assert!(e.to_string().contains("slow down"), "{e}");
        let mut f = Fold::default();
        let cut = json!({ "type": "response.incomplete", "response": { "incomplete_details": { "reason": "content_filter" } } });
        f.apply(&cut.to_string()).unwrap();
        assert_eq!(f.finish("m").unwrap().finish_reason, "content_filter");
    }
}
