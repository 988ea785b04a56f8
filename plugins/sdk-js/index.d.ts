// Types of the agent-host JavaScript/TypeScript SDK (index.js) and of the
// `agent-host:plugin@0.2.0` world it is built against (the host interface's
// bindings are typed in wit.d.ts).

/// <reference path="./wit.d.ts" />

/** One message of the conversation before this turn. */
/** A child run as `awaitAgents` answers it. */
export interface AgentResult {
  run_id: string;
  plugin: string;
  conversation_id: string;
  status: "queued" | "running" | "waiting" | "completed" | "failed" | "cancelled";
  output: string | null;
  error: string | null;
  truncated?: boolean;
}

export interface Message {
  /** "user" or "assistant". */
  role: string;
  content: string;
}

/** A function the run's client runs itself (offer it to the model). */
export interface ClientTool {
  name: string;
  description?: string;
  /** Its parameters' JSON schema, parsed. */
  parameters: unknown;
}

/** A host tool this plugin was granted, as the host lists it. */
export interface ToolInfo {
  /** The name `callTool` takes (an MCP server's tools are `<server>.<tool>`). */
  name: string;
  description?: string;
  /** Its arguments' JSON schema, parsed. */
  inputSchema: unknown;
}

/** A tool offered to a model, as the `llm` tool's `tools` takes it. */
export interface ModelTool {
  name: string;
  description?: string;
  parameters: unknown;
}

/** A call of a client's function the turn ends with. */
export interface ClientCall {
  callId: string;
  name: string;
  /** The arguments, a JSON text. */
  arguments: string;
}

/** The WIT world's `run-input`, as the bindings give it. */
export interface RunInput {
  runId: string;
  conversationId: string;
  content: string;
  history: Message[];
  config: string;
  clientTools: { name: string; description?: string; parameters: string }[];
}

/** The WIT world's `turn-output`. */
export interface TurnOutput {
  text: string;
  clientCalls: ClientCall[];
}

export const CLIENT_CALLS_MAX: number;
export const MODEL_NAME_BYTES_MAX: number;
/** A host tool's name as a model takes it (`py.echo` becomes `py_echo`). */
export function modelName(name: string): string;

/** The host refused a call; `kind` names the WIT `host-error` case. */
export class Refusal extends Error {
  readonly kind: "cancelled" | "fenced" | "denied" | "invalid" | "limit" | "tool failed" | "refusal";
  readonly detail: string;
}
export class Cancelled extends Refusal {}
export class Fenced extends Refusal {}
export class Denied extends Refusal {}
export class Invalid extends Refusal {}
export class LimitReached extends Refusal {}
export class ToolFailed extends Refusal {}

/** One turn, with the host's imports as methods. */
export class Turn {
  readonly runId: string;
  readonly conversationId: string;
  /** The user's message this turn answers. */
  readonly content: string;
  /** The conversation before this turn, oldest first. */
  readonly history: Message[];
  /** The run's config (a JSON object, parsed). */
  readonly config: Record<string, unknown>;
  /** Functions the run's client runs itself. */
  readonly clientTools: ClientTool[];
  /** Streams a piece of the answer. */
  delta(text: string): void;
  /** Emits an event of the plugin's own kind (reserved kinds are refused). */
  emit(kind: string, payload: Record<string, unknown>): void;
  /** Calls a granted host tool with JSON arguments; returns its JSON answer. */
  callTool(name: string, args: unknown): any;
  /** The host tools this plugin was granted that the host has now, sorted by name. */
  grantedTools(): ToolInfo[];
  /** The granted tools but `llm` and `wait`, named as a model takes them; `callTool` takes those names. */
  modelTools(): ModelTool[];
  /** The instructions queued for this turn since the last take (steering), oldest first; each taken once. */
  takeInstructions(): string[];
  /** Starts a child run of `plugin` (a sub-agent granted as `agent:<plugin>`); answers its run id at once. */
  startAgent(plugin: string, input: string, config?: Record<string, unknown>): string;
  /** Waits for child runs this run started (all, or the first to end), suspended meanwhile. */
  awaitAgents(runs?: string[], any?: boolean): AgentResult[];
  /** Whether a stop was requested. */
  cancelled(): boolean;
  /** Throws Cancelled when a stop was requested. */
  checkCancel(): void;
  isClientTool(name: string): boolean;
  callClient(callId: string, name: string, args: string): void;
  configInt(key: string, fallback: number): number;
}

/** The component's `run` export for `agent`. */
export function exportAgent(agent: (turn: Turn) => string): (input: RunInput) => TurnOutput;
