// The guest side of agent-host for JavaScript and TypeScript: write one
// function from a turn to its answer and export it with `exportAgent`.
// Built against the `agent-host:plugin@0.2.0` world with componentize-js
// (see scripts/build-plugin); types are in index.d.ts. The npm package
// `agent-plugin` (this directory: `npm pack`); an agent beside plugins/ may
// also import it as "../sdk-js/index.js".
//
//   import { exportAgent } from "agent-plugin";
//   export const run = exportAgent((turn) => {
//     turn.delta(turn.content);
//     return turn.content;
//   });
//
// Host refusals arrive as exceptions (subclasses of `Refusal`); an exception
// that leaves the function ends the run failed with its message.

import { emitEvent, callTool, checkCancel, listTools } from "agent-host:plugin/host@0.2.0";

/** Client calls a turn may end with, at most. */
export const CLIENT_CALLS_MAX = 64;

/** The longest tool name a model takes (the `llm` tool's bound). */
export const MODEL_NAME_BYTES_MAX = 64;

/**
 * A host tool's name as a model takes it: 1-64 letters, digits, `_` and `-`.
 * Another character (the `.` of `<server>.<tool>`) becomes `_`; a longer name
 * is cut and ends with `_` and a hash of the whole name (FNV-1a, the same in
 * every SDK).
 */
export function modelName(name) {
  const clean = Array.from(name, (c) => (/^[A-Za-z0-9_-]$/.test(c) ? c : "_")).join("");
  if (clean.length > 0 && clean.length <= MODEL_NAME_BYTES_MAX) return clean;
  let h = 0x811c9dc5;
  for (const b of new TextEncoder().encode(name)) h = Math.imul(h ^ b, 0x01000193) >>> 0;
  const suffix = `_${h.toString(16).padStart(8, "0")}`;
  return clean.slice(0, MODEL_NAME_BYTES_MAX - suffix.length) + suffix;
}

/** The host refused a call; `kind` names the WIT `host-error` case. */
export class Refusal extends Error {
  constructor(kind, message = "") {
    super(message ? `${kind}: ${message}` : kind);
    this.name = "Refusal";
    this.kind = kind;
    this.detail = message;
  }
}
/** A stop was requested: wind down and return. */
export class Cancelled extends Refusal {
  constructor() { super("cancelled"); this.name = "Cancelled"; }
}
/** This worker no longer holds the run: nothing more will be written. */
export class Fenced extends Refusal {
  constructor() { super("fenced"); this.name = "Fenced"; }
}
/** Not granted to this plugin (a tool outside its manifest). */
export class Denied extends Refusal {
  constructor(m) { super("denied", m); this.name = "Denied"; }
}
/** Malformed input (a reserved event kind, a payload not a JSON object). */
export class Invalid extends Refusal {
  constructor(m) { super("invalid", m); this.name = "Invalid"; }
}
/** A limit of the plugin's manifest was reached. */
export class LimitReached extends Refusal {
  constructor(m) { super("limit", m); this.name = "LimitReached"; }
}
/** The tool ran and failed. */
export class ToolFailed extends Refusal {
  constructor(m) { super("tool failed", m); this.name = "ToolFailed"; }
}

const CASES = {
  cancelled: () => new Cancelled(),
  fenced: () => new Fenced(),
  denied: (m) => new Denied(m),
  invalid: (m) => new Invalid(m),
  limit: (m) => new LimitReached(m),
  "tool-failed": (m) => new ToolFailed(m),
};

// A WIT `host-error` (thrown by an import as `{tag, val}`, possibly wrapped in
// an error whose `payload` it is) as a Refusal.
function refusal(e) {
  const v = e && typeof e === "object" && "payload" in e ? e.payload : e;
  const make = v && CASES[v.tag];
  return make ? make(v.val) : new Refusal("refusal", String(v));
}

function host(f) {
  try {
    return f();
  } catch (e) {
    throw refusal(e);
  }
}

function parse(text, fallback) {
  try {
    return JSON.parse(text);
  } catch {
    return fallback;
  }
}

/** One turn, with the host's imports as methods. */
export class Turn {
  constructor(input) {
    this.runId = input.runId;
    this.conversationId = input.conversationId;
    this.content = input.content;
    this.history = input.history.map((m) => ({ role: m.role, content: m.content }));
    const config = parse(input.config, {});
    this.config = config && typeof config === "object" && !Array.isArray(config) ? config : {};
    this.clientTools = input.clientTools.map((t) => ({
      name: t.name,
      description: t.description,
      parameters: parse(t.parameters, {}),
    }));
    this.clientCalls = [];
    this.modelNames = new Map();
  }

  /** Streams a piece of the answer. */
  delta(text) {
    this.emit("content_delta", { delta: text });
  }

  /** Emits an event of the plugin's own kind (reserved kinds are refused). */
  emit(kind, payload) {
    host(() => emitEvent(kind, JSON.stringify(payload)));
  }

  /**
   * Calls a granted host tool with JSON arguments; returns its JSON answer.
   * `name` is the host's, or the one `modelTools` gave the model for it.
   */
  callTool(name, args) {
    const hostName = this.modelNames.get(name) ?? name;
    const out = host(() => callTool(hostName, JSON.stringify(args)));
    try {
      return JSON.parse(out);
    } catch (e) {
      throw new ToolFailed(`tool answered non-JSON: ${e.message}`);
    }
  }

  /**
   * The host tools this plugin was granted that the host has now (an MCP
   * server's among them, as `<server>.<tool>`), sorted by name: what
   * `callTool` may reach.
   */
  grantedTools() {
    return listTools().map((t) => ({ name: t.name, description: t.description, inputSchema: parse(t.inputSchema, {}) }));
  }

  /**
   * The granted tools to offer a model, as the `llm` tool's `tools` takes
   * them (`{name, description, parameters}`): every granted tool but the
   * model itself and `wait`, each named as a model accepts (`py.echo` is
   * offered as `py_echo`); `callTool` takes the offered name. Add
   * `clientTools` for the client's functions.
   */
  modelTools() {
    const offered = [];
    const seen = new Set();
    for (const t of this.grantedTools()) {
      const name = modelName(t.name);
      if (t.name === "llm" || t.name === "wait" || seen.has(name)) continue;
      seen.add(name);
      this.modelNames.set(name, t.name);
      offered.push({ name, description: t.description, parameters: t.inputSchema });
    }
    return offered;
  }

  /**
   * The instructions queued for this turn since the last take
   * (`POST /v1/runs/{id}/steer`), oldest first, each taken once: append them
   * to the model's context before its next call. A resumed run takes the
   * same ones at the same point. Empty when none are queued.
   */
  takeInstructions() {
    const out = host(() => callTool("take-instructions", "{}"));
    return (JSON.parse(out).instructions ?? []).map(String);
  }

  /**
   * Starts a child run of `plugin` (a sub-agent: the manifest grants
   * `agent:<plugin>`) with `input` as its user message, and answers its run
   * id at once; `awaitAgents` waits for it. A resumed run never starts the
   * same child twice.
   */
  startAgent(plugin, input, config) {
    const args = { input };
    if (config !== undefined) args.config = config;
    const out = host(() => callTool(`agent:${plugin}`, JSON.stringify(args)));
    return String(JSON.parse(out).run_id);
  }

  /**
   * Waits for child runs this run started (every one when `runs` is empty):
   * all of them, or with `any` the first to end, suspended with nothing held
   * meanwhile. Answers each awaited child as `{run_id, plugin,
   * conversation_id, status, output, error}`; a failed child is a value
   * here, not this run's failure.
   */
  awaitAgents(runs = [], any = false) {
    const out = host(() => callTool("await-agents", JSON.stringify({ runs, mode: any ? "any" : "all" })));
    return JSON.parse(out).runs ?? [];
  }

  /** Whether a stop was requested: return soon (the host interrupts a guest that does not). */
  cancelled() {
    return checkCancel();
  }

  /** Throws Cancelled when a stop was requested. */
  checkCancel() {
    if (this.cancelled()) throw new Cancelled();
  }

  /** Whether `name` is a function the client runs. */
  isClientTool(name) {
    return this.clientTools.some((t) => t.name === name);
  }

  /** Adds a call of a client's function to the calls this turn ends with. */
  callClient(callId, name, args) {
    if (!this.isClientTool(name)) throw new Invalid(`${JSON.stringify(name)} is not a function the client runs`);
    if (this.clientCalls.length >= CLIENT_CALLS_MAX) throw new LimitReached(`at most ${CLIENT_CALLS_MAX} client calls a turn`);
    this.clientCalls.push({ callId, name, arguments: args });
  }

  /** An integer config value, or `fallback`. */
  configInt(key, fallback) {
    const v = this.config[key];
    return Number.isInteger(v) ? v : fallback;
  }
}

/**
 * The component's `run` export for `agent`: assign it to an exported `run`
 * in the module componentize-js builds.
 */
export function exportAgent(agent) {
  return function run(input) {
    const turn = new Turn(input);
    let text;
    try {
      text = agent(turn);
    } catch (e) {
      // The run ends failed with the message (a WIT `result` error).
      throw (e && e.message) || String(e);
    }
    if (typeof text !== "string") throw `the agent returned ${typeof text}, not a string`;
    return { text, clientCalls: turn.clientCalls };
  };
}
