//! The WIT host interface, translated to [`RunHost`] and nothing more: every
//! check, limit, ordinal and journal write lives behind `RunHost`, so a guest
//! gets exactly what a built-in agent gets.

use super::bindings::agent_host::plugin::{host as wit_host, types as wit_types};
use super::Guest;
use crate::error::HostError;

fn to_wit(e: HostError) -> wit_types::HostError {
    match e {
        HostError::Cancelled => wit_types::HostError::Cancelled,
        HostError::Fenced => wit_types::HostError::Fenced,
        HostError::Denied(m) => wit_types::HostError::Denied(m),
        HostError::Invalid(m) => wit_types::HostError::Invalid(m),
        HostError::Limit(m) => wit_types::HostError::Limit(m),
        // WIT 0.1.0 has no `unavailable`: the nearest is a failed tool.
        HostError::ToolFailed(m) | HostError::Unavailable(m) => wit_types::HostError::ToolFailed(m),
    }
}

impl wit_types::Host for Guest {}

impl wit_host::Host for Guest {
    async fn emit_event(
        &mut self,
        kind: String,
        payload: String,
    ) -> wasmtime::Result<Result<(), wit_types::HostError>> {
        Ok(self.host.emit_event_json(&kind, &payload).await.map_err(to_wit))
    }

    async fn call_tool(
        &mut self,
        name: String,
        args: String,
    ) -> wasmtime::Result<Result<String, wit_types::HostError>> {
        Ok(self.host.call_tool(&name, &args).await.map_err(to_wit))
    }

    async fn check_cancel(&mut self) -> wasmtime::Result<bool> {
        Ok(self.host.check_cancel())
    }
}
