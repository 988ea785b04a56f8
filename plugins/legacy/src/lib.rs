//! A component built for the `agent-host:plugin@0.1.0` world, as plugins were
//! before 0.2.0 (its own bindings, not the SDK, which moved on): it streams
//! the user's message back word by word and answers it. The host keeps
//! running such components unchanged.

wit_bindgen::generate!({ path: "../../wit/0.1.0", world: "agent" });

use agent_host::plugin::host;

struct Legacy;

impl Guest for Legacy {
    fn run(input: RunInput) -> Result<String, String> {
        for word in input.content.split_inclusive(' ') {
            let payload = serde_json::json!({ "delta": word }).to_string();
            host::emit_event("content_delta", &payload).map_err(|e| format!("{e:?}"))?;
        }
        Ok(input.content)
    }
}

export!(Legacy);
