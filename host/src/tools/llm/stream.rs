//! A chat-completions stream folded into one reply: each SSE chunk's text
//! delta (journaled as it arrives by the caller), its tool-call fragments
//! joined by index, the model, the finish reason and the usage.

use super::*;

#[derive(Deserialize)]
pub(super) struct Chunk {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    choices: Option<Vec<Choice>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Deserialize)]
pub(super) struct Choice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
pub(super) struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<CallDelta>>,
}

#[derive(Deserialize)]
pub(super) struct CallDelta {
    #[serde(default)]
    index: Option<u64>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<FunctionDelta>,
}

#[derive(Deserialize)]
pub(super) struct FunctionDelta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

/// A tool call as the stream's fragments build it.
#[derive(Default)]
pub(super) struct CallSoFar {
    pub(super) id: String,
    pub(super) name: String,
    pub(super) arguments: String,
}

/// A folded reply's calls in their order: one without a name is the
/// provider's error; one without an id gets `call_<index>`.
pub(super) fn calls_in_order(calls: BTreeMap<u64, CallSoFar>) -> Result<Vec<AnswerCall>, HostError> {
    let mut tool_calls = Vec::with_capacity(calls.len());
    for (index, call) in calls {
        if call.name.is_empty() {
            return Err(failed(format!("model asked for tool call #{index} without a name")));
        }
        let id = if call.id.is_empty() { format!("call_{index}") } else { call.id };
        tool_calls.push(AnswerCall { id, name: call.name, arguments: call.arguments });
    }
    Ok(tool_calls)
}

/// Adds a piece of text to a reply within its bound; returns it, to be
/// streamed (`None` when empty).
pub(super) fn take_text(content: &mut String, bytes: &mut usize, text: String) -> Result<Option<String>, HostError> {
    *bytes += text.len();
    if *bytes > REPLY_BYTES_MAX {
        return Err(failed(format!("model reply exceeds {REPLY_BYTES_MAX} bytes")));
    }
    if text.is_empty() {
        return Ok(None);
    }
    content.push_str(&text);
    Ok(Some(text))
}

/// The reply as the stream has built it so far.
#[derive(Default)]
pub(super) struct Reply {
    content: String,
    calls: BTreeMap<u64, CallSoFar>,
    pub(super) finish_reason: Option<String>,
    usage: Option<Usage>,
    model: Option<String>,
    bytes: usize,
    pub(super) done: bool,
}

impl Reply {
    /// Applies one event; returns its text, to be streamed.
    pub(super) fn apply(&mut self, data: &str) -> Result<Option<String>, HostError> {
        if data.trim() == "[DONE]" {
            self.done = true;
            return Ok(None);
        }
        let chunk: Chunk = serde_json::from_str(data).map_err(|e| {
            failed(format!("model stream sent a malformed chunk ({e}): {}", clip(data, CHUNK_SNIPPET_BYTES)))
        })?;
        if let Some(error) = chunk.error {
            let message =
                error.get("message").and_then(Value::as_str).map_or_else(|| error.to_string(), str::to_string);
            return Err(failed(format!("model stream reported an error: {}", clip(&message, CHUNK_SNIPPET_BYTES))));
        }
        if chunk.model.is_some() {
            self.model = chunk.model;
        }
        if chunk.usage.is_some() {
            self.usage = chunk.usage.map(Usage::normalised);
        }
        let mut text = String::new();
        for choice in chunk.choices.unwrap_or_default() {
            if let Some(reason) = choice.finish_reason {
                self.finish_reason = Some(reason);
            }
            let Some(delta) = choice.delta else { continue };
            if let Some(piece) = delta.content {
                text.push_str(&piece);
            }
            for (position, call) in delta.tool_calls.unwrap_or_default().into_iter().enumerate() {
                let so_far = self.calls.entry(call.index.unwrap_or(position as u64)).or_default();
                if let Some(id) = call.id.filter(|id| !id.is_empty()) {
                    so_far.id = id;
                }
                let function = call.function.unwrap_or(FunctionDelta { name: None, arguments: None });
                if let Some(name) = function.name.filter(|n| !n.is_empty()) {
                    so_far.name = name;
                }
                if let Some(arguments) = function.arguments {
                    self.bytes += arguments.len();
                    so_far.arguments.push_str(&arguments);
                }
            }
        }
        take_text(&mut self.content, &mut self.bytes, text)
    }

    pub(super) fn finish(self, configured_model: &str) -> Result<Answer, HostError> {
        let tool_calls = calls_in_order(self.calls)?;
        // Some servers say "stop" even when the reply is tool calls.
        let finish_reason = match self.finish_reason.as_deref() {
            None | Some("stop") if !tool_calls.is_empty() => "tool_calls".to_string(),
            None => "stop".to_string(),
            Some(reason) => reason.to_string(),
        };
        Ok(Answer {
            content: self.content,
            tool_calls,
            finish_reason,
            usage: self.usage,
            model: self.model.unwrap_or_else(|| configured_model.to_string()),
        })
    }
}
