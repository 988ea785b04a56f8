//! The `llm` tool with no model behind it: the default when no endpoint is
//! configured, so the demo and the tests run with no network. Its replies
//! depend only on the request, word for word, so tests can assert them.

use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};

use super::{parse_args, Answer, AnswerCall, LlmArgs, Role, Usage};
use crate::error::HostError;
use crate::tools::{EventSink, Tool, ToolCall};

/// The model name offline answers carry.
const OFFLINE_MODEL: &str = "offline";

pub(crate) struct Offline {
    timeout: Duration,
}

impl Offline {
    pub fn new(timeout: Duration) -> Self {
        Offline { timeout }
    }
}

#[async_trait]
impl Tool for Offline {
    async fn call(&self, call: &ToolCall<'_>, sink: &dyn EventSink) -> Result<Value, HostError> {
        let answer = reply(&parse_args(&call.args)?);
        for word in answer.content.split_inclusive(' ') {
            sink.delta(word).await?;
        }
        Ok(answer.into_json())
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A model call has no side effect: one whose outcome is unknown is asked again.
    fn idempotent(&self) -> bool {
        true
    }
}

fn words(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

/// When tools are offered and none has answered since the user spoke, one
/// call to the first tool with the user's words as `input`; otherwise text
/// that quotes the user and every tool result since.
fn reply(args: &LlmArgs) -> Answer {
    let last_user = args.messages.iter().rposition(|m| m.role == Role::User);
    let asked = last_user.map_or("", |i| args.messages[i].text());
    let since = &args.messages[last_user.map_or(0, |i| i + 1)..];
    let results: Vec<_> = since.iter().filter(|m| m.role == Role::Tool).collect();
    let prompt_tokens = args.messages.iter().map(|m| words(m.text())).sum();
    if let (Some(tool), true) = (args.tools.first(), results.is_empty()) {
        let earlier_calls = args.messages.iter().map(|m| m.tool_calls.len()).sum::<usize>();
        let arguments = json!({ "input": asked }).to_string();
        let usage = Usage::new(prompt_tokens, words(&arguments));
        return Answer {
            content: String::new(),
            tool_calls: vec![AnswerCall {
                id: format!("call_{}", earlier_calls + 1),
                name: tool.name.clone(),
                arguments,
            }],
            finish_reason: "tool_calls".into(),
            usage: Some(usage),
            model: OFFLINE_MODEL.into(),
        };
    }
    let mut content = format!("Offline reply to: {asked}");
    for result in results {
        let id = result.tool_call_id.as_deref().unwrap_or_default();
        // Name the tool the model called with this id, as a person would.
        let name =
            args.messages.iter().flat_map(|m| &m.tool_calls).find(|c| c.id == id).map_or(id, |c| c.name.as_str());
        content.push_str(&format!(" Tool {name} said: {}", result.text()));
    }
    let usage = Usage::new(prompt_tokens, words(&content));
    Answer {
        content,
        tool_calls: Vec::new(),
        finish_reason: "stop".into(),
        usage: Some(usage),
        model: OFFLINE_MODEL.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::test_support::{call, Collect};
    use crate::tools::{LlmConfig, ToolRegistry, LLM_TOOL};

    async fn ask(args: Value) -> (Result<Value, HostError>, Collect) {
        let config = LlmConfig {
            base_url: None,
            api_key: None,
            model: "ignored".into(),
            timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(1),
        };
        let r = ToolRegistry::from_config(&config, &[]).unwrap();
        let sink = Collect::default();
        let answer = r.invoke(call(LLM_TOOL, args), &sink, std::future::pending()).await;
        (answer.map(|a| serde_json::from_str(&a).unwrap()), sink)
    }

    #[tokio::test]
    async fn it_replies_with_exact_text_streamed_word_by_word() {
        let (answer, sink) = ask(json!({ "messages": [
            { "role": "system", "content": "be nice" },
            { "role": "user", "content": "first question" },
            { "role": "assistant", "content": "first answer" },
            { "role": "user", "content": "what is up" },
        ] }))
        .await;
        assert_eq!(
            answer.unwrap(),
            json!({
                "content": "Offline reply to: what is up",
                "tool_calls": [],
                "finish_reason": "stop",
                "usage": { "prompt_tokens": 9, "completion_tokens": 6 },
                "model": "offline",
            })
        );
        assert_eq!(sink.deltas(), ["Offline ", "reply ", "to: ", "what ", "is ", "up"]);
        assert_eq!(sink.finished()["usage"], json!({ "prompt_tokens": 9, "completion_tokens": 6 }));
    }

    #[tokio::test]
    async fn it_calls_the_first_offered_tool() {
        let (answer, sink) = ask(json!({
            "messages": [{ "role": "user", "content": "weather in Lyon" }],
            "tools": [{ "name": "weather" }, { "name": "time" }],
        }))
        .await;
        assert_eq!(
            answer.unwrap(),
            json!({
                "content": "",
                "tool_calls": [{ "id": "call_1", "name": "weather", "arguments": "{\"input\":\"weather in Lyon\"}" }],
                "finish_reason": "tool_calls",
                "usage": { "prompt_tokens": 3, "completion_tokens": 3 },
                "model": "offline",
            })
        );
        assert!(sink.deltas().is_empty());
    }

    #[tokio::test]
    async fn it_answers_with_the_tool_results_once_they_are_in() {
        let (answer, sink) = ask(json!({
            "messages": [
                { "role": "user", "content": "weather in Lyon" },
                {
                    "role": "assistant",
                    "content": null,
                    "tool_calls": [{ "id": "call_1", "name": "weather", "arguments": "{}" }],
                },
                { "role": "tool", "tool_call_id": "call_1", "content": "{\"sky\":\"clear\"}" },
            ],
            "tools": [{ "name": "weather" }],
        }))
        .await;
        let answer = answer.unwrap();
        let text = "Offline reply to: weather in Lyon Tool weather said: {\"sky\":\"clear\"}";
        assert_eq!(answer["content"], text);
        assert_eq!(answer["finish_reason"], "stop");
        assert_eq!(answer["tool_calls"], json!([]));
        assert_eq!(sink.deltas().concat(), text);
    }

    #[tokio::test]
    async fn a_later_turn_gets_a_fresh_call_id() {
        let (answer, _) = ask(json!({
            "messages": [
                { "role": "user", "content": "a" },
                { "role": "assistant", "tool_calls": [{ "id": "call_1", "name": "t", "arguments": "{}" }] },
                { "role": "tool", "tool_call_id": "call_1", "content": "r" },
                { "role": "assistant", "content": "done" },
                { "role": "user", "content": "again" },
            ],
            "tools": [{ "name": "t" }],
        }))
        .await;
        assert_eq!(answer.unwrap()["tool_calls"][0]["id"], "call_2");
    }

    #[tokio::test]
    async fn malformed_arguments_are_invalid() {
        let (answer, sink) = ask(json!({ "messages": "hello" })).await;
        let Err(HostError::Invalid(m)) = answer else { panic!("{answer:?}") };
        assert!(m.starts_with("llm arguments: invalid type"), "{m}");
        assert_eq!(sink.finished()["outcome"], "error");
    }
}
