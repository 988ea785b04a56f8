// {{name}}: a chat agent. Each turn sends the conversation to the model (the
// host's `llm` tool) with the other tools manifest.json grants offered to it,
// runs the calls the model asks for and asks again with their answers, until
// the model answers in text. The host streams the model's text into the run
// as it arrives. A stop asked for ends the turn `cancelled` at the next step.
//
// Grant a tool in manifest.json (`"tools": ["llm", "clock"]` on the demo
// host, or an MCP server's `"docs.search"`) and the model is offered it.
// `agent-plugin` is agent-host's SDK, an npm package (package.json):
// `agent-host build` installs it into node_modules and bundles it with this.
import { exportAgent, Cancelled, Fenced, Refusal } from "agent-plugin";

const MAX_STEPS = 8;

// One call the model asked for; a failure is told to the model.
function call(turn, c) {
  try {
    const answer = turn.callTool(c.name, JSON.parse(c.arguments || "{}"));
    return typeof answer === "string" ? answer : JSON.stringify(answer);
  } catch (e) {
    if (e instanceof Cancelled || e instanceof Fenced) throw e;
    if (e instanceof Refusal || e instanceof SyntaxError) return `error: ${e.message}`;
    throw e;
  }
}

function chat(turn) {
  const messages = [];
  if (typeof turn.config.system === "string") messages.push({ role: "system", content: turn.config.system });
  for (const m of turn.history) messages.push({ role: m.role, content: m.content });
  messages.push({ role: "user", content: turn.content });
  const tools = turn.modelTools(); // the granted tools, named as a model takes them
  for (let step = 0; step < MAX_STEPS; step++) {
    turn.checkCancel(); // a stop was asked for: throws Cancelled, the turn ends
    const answer = turn.callTool("llm", { messages, tools });
    const calls = answer.tool_calls ?? [];
    if (calls.length === 0) return answer.content ?? "";
    messages.push({ role: "assistant", content: answer.content ?? "", tool_calls: calls });
    for (const c of calls) messages.push({ role: "tool", tool_call_id: c.id, content: call(turn, c) });
  }
  throw new Error(`no answer after ${MAX_STEPS} model calls`);
}

export const run = exportAgent(chat);
