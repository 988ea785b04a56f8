// Types of the host interface the `agent-host:plugin@0.2.0` world imports,
// as componentize-js binds it (the SDK in index.js wraps it; a plugin rarely
// imports it directly). A refused call throws the WIT `host-error` value
// (`{ tag, val? }`), which the SDK turns into a Refusal.

declare module "agent-host:plugin/host@0.2.0" {
  export type HostError =
    | { tag: "cancelled" }
    | { tag: "fenced" }
    | { tag: "denied"; val: string }
    | { tag: "invalid"; val: string }
    | { tag: "limit"; val: string }
    | { tag: "tool-failed"; val: string };
  /** Appends an event to the run's journal; `payload` is a JSON object's text. */
  export function emitEvent(kind: string, payload: string): void;
  /** Calls a granted host tool; JSON text in and out. */
  export function callTool(name: string, args: string): string;
  /** Whether a stop was requested for this run. */
  export function checkCancel(): boolean;
  /** A host tool the plugin was granted. */
  export interface ToolInfo {
    name: string;
    description?: string;
    /** Its arguments' JSON schema, a JSON text. */
    inputSchema: string;
  }
  /** The granted host tools the host has now, sorted by name. */
  export function listTools(): ToolInfo[];
}
