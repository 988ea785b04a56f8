// A chat agent in JavaScript, the same loop as the Rust `chat` plugin: ask
// the model, run the tools it asks for, ask again with their results, until
// it answers in text. The host streams the model's text to the run as it
// arrives.
//
// Config: `system`, `tools` (`[{name, description, parameters}]`, each granted
// in the manifest or a function the client runs; or `"granted"`: every host
// tool the plugin was granted but the model itself and `wait`, an MCP
// server's included, plus the client's functions), `input` (chat messages that
// are this turn), `max_steps` (model calls per turn, default 8).
//
// Switches for trying the host's limits (the tests use them): `hold_ms`
// streams a "." every 20 ms for that long before the answer, stopping when a
// stop is asked for; with `ignore_stop` it does not look; `hoard_mb` keeps
// that many MiB alive first (past the memory limit the run fails with reason
// `limit`); `answer` is returned as is, with no model call (the benchmark's
// bare turn).

import { exportAgent, Cancelled, Fenced, Refusal } from "../sdk-js/index.js";

/** @param {import("../sdk-js/index.js").Turn} turn */
function runTool(turn, call) {
  let args;
  try {
    args = JSON.parse(call.arguments || "{}");
  } catch (e) {
    return `error: the arguments are not JSON: ${e.message}`;
  }
  try {
    const answer = turn.callTool(call.name || "", args);
    return typeof answer === "string" ? answer : JSON.stringify(answer);
  } catch (e) {
    // Its failure is told to the model; only a stop or a lost run ends the turn.
    if (e instanceof Cancelled || e instanceof Fenced || !(e instanceof Refusal)) throw e;
    return `error: ${e.message}`;
  }
}

function hold(turn) {
  const ignore = !!turn.config.ignore_stop;
  const deadline = Date.now() + turn.configInt("hold_ms", 0);
  while (Date.now() < deadline) {
    if (!ignore) turn.checkCancel();
    try {
      turn.delta(".");
    } catch (e) {
      if (!ignore) throw e;
    }
    const next = Date.now() + 20;
    while (Date.now() < next) {}
  }
}

/** @param {import("../sdk-js/index.js").Turn} turn */
function chat(turn) {
  const hoard = [];
  for (let i = 0; i < turn.configInt("hoard_mb", 0); i++) hoard.push(new Uint8Array(1 << 20).fill(1));
  hold(turn);
  if (typeof turn.config.answer === "string") return turn.config.answer;
  const messages = [];
  if (typeof turn.config.system === "string") messages.push({ role: "system", content: turn.config.system });
  for (const m of turn.history) messages.push({ role: m.role, content: m.content });
  if (Array.isArray(turn.config.input)) messages.push(...turn.config.input);
  else messages.push({ role: "user", content: turn.content });
  const tools = turn.config.tools === "granted" ? [...turn.modelTools(), ...turn.clientTools] : turn.config.tools ?? [];
  const maxSteps = Math.min(Math.max(turn.configInt("max_steps", 8), 1), 64);
  for (let n = 1; n <= maxSteps; n++) {
    turn.emit("step", { n });
    // Instructions queued for this turn since the last step (steering).
    for (const instruction of turn.takeInstructions()) messages.push({ role: "user", content: instruction });
    const answer = turn.callTool("llm", { messages, tools });
    const content = answer.content ?? "";
    const calls = answer.tool_calls ?? [];
    if (calls.length === 0) return content;
    // Calls the client runs end the turn: the client answers them in its next one.
    const forClient = calls.filter((c) => turn.isClientTool(c.name ?? ""));
    if (forClient.length > 0) {
      for (const c of forClient) turn.callClient(c.id ?? "", c.name ?? "", c.arguments ?? "");
      return content;
    }
    messages.push({ role: "assistant", content, tool_calls: calls });
    for (const call of calls) messages.push({ role: "tool", tool_call_id: call.id, content: runTool(turn, call) });
  }
  throw new Error(`no final answer after ${maxSteps} model calls`);
}

export const run = exportAgent(chat);
