//! The WIT host interface, translated to [`RunHost`] and nothing more: every
//! check, limit, ordinal and journal write lives behind `RunHost`, so a guest
//! gets exactly what a built-in agent gets. Both worlds (0.1.0 and 0.2.0)
//! import the same interface, 0.2.0 with `list-tools` added; one macro
//! writes it for each.

use super::bindings::agent_host::plugin::{host as wit_host, types as wit_types};
use super::bindings_v2::agent_host::plugin::{host as wit_host_v2, types as wit_types_v2};
use super::Guest;
use crate::error::HostError;

/// `impl Host` of one world's host interface for [`Guest`].
macro_rules! host_interface {
    ($host:ident, $types:ident, $to_wit:ident $(, { $($extra:item)* })?) => {
        fn $to_wit(e: HostError) -> $types::HostError {
            match e {
                HostError::Cancelled => $types::HostError::Cancelled,
                HostError::Fenced => $types::HostError::Fenced,
                HostError::Denied(m) => $types::HostError::Denied(m),
                HostError::Invalid(m) => $types::HostError::Invalid(m),
                HostError::Limit(m) => $types::HostError::Limit(m),
                // The WIT has no `unavailable`: the nearest is a failed tool.
                HostError::ToolFailed(m) | HostError::Unavailable(m) => $types::HostError::ToolFailed(m),
                // The run host suspends instead; a guest never sees it.
                HostError::Throttled { limit, wait_ms } => {
                    $types::HostError::Limit(format!("model limit {limit} frees in about {wait_ms} ms"))
                }
            }
        }

        impl $types::Host for Guest {}

        impl $host::Host for Guest {
            async fn emit_event(
                &mut self,
                kind: String,
                payload: String,
            ) -> wasmtime::Result<Result<(), $types::HostError>> {
                if let Err(e) = self.host.count_host_call() {
                    return Ok(Err($to_wit(e)));
                }
                Ok(self.host.emit_event_json(&kind, &payload).await.map_err($to_wit))
            }

            async fn call_tool(
                &mut self,
                name: String,
                args: String,
            ) -> wasmtime::Result<Result<String, $types::HostError>> {
                if let Err(e) = self.host.count_host_call() {
                    return Ok(Err($to_wit(e)));
                }
                Ok(self.host.call_tool(&name, &args).await.map_err($to_wit))
            }

            async fn check_cancel(&mut self) -> wasmtime::Result<bool> {
                // No error to answer with: past the limit the guest traps,
                // and the run ends failed with the limit it hit.
                self.host.count_host_call().map_err(|e| wasmtime::format_err!("{e}"))?;
                Ok(self.host.check_cancel())
            }

            $($($extra)*)?
        }
    };
}

host_interface!(wit_host, wit_types, to_wit);
// 0.2.0 adds `list-tools`; a 0.1.0 component gets no new import.
host_interface!(wit_host_v2, wit_types_v2, to_wit_v2, {
    async fn list_tools(&mut self) -> wasmtime::Result<Vec<wit_types_v2::ToolInfo>> {
        self.host.count_host_call().map_err(|e| wasmtime::format_err!("{e}"))?;
        // A refusal (the run ended, a limit) leaves the list empty: the next
        // import the guest makes gets the refusal itself.
        let tools = self.host.list_tools().await.unwrap_or_default();
        Ok(tools
            .into_iter()
            .map(|t| wit_types_v2::ToolInfo {
                name: t.name,
                description: t.description,
                input_schema: t.input_schema.to_string(),
            })
            .collect())
    }
});
