// {{name}}: a chat agent. Each turn sends the conversation to the model (the
// host's `llm` tool) with the other tools manifest.json grants offered to it,
// runs the calls the model asks for and asks again with their answers, until
// the model answers in text. The host streams the model's text into the run
// as it arrives. A stop asked for ends the turn `cancelled` at the next step.
//
// Grant a tool in manifest.json (`"tools": ["llm", "clock"]` on the demo
// host, or an MCP server's `"docs.search"`) and the model is offered it.
// `agent-plugin` is agent-host's SDK, an npm package with its types
// (package.json): `agent-host build` installs it into node_modules,
// type-checks and compiles this file with the TypeScript compiler agent-host
// pins, and bundles it with the SDK.
import { exportAgent, Cancelled, Fenced, Refusal, type Turn } from "agent-plugin";

const MAX_STEPS = 8;

type ToolCall = { id: string; name: string; arguments?: string };
type Message = { role: string; content: string; tool_calls?: ToolCall[]; tool_call_id?: string };
type Answer = { content?: string; tool_calls?: ToolCall[] };

// One call the model asked for; a failure is told to the model.
function call(turn: Turn, c: ToolCall): string {
  try {
    const answer: unknown = turn.callTool(c.name, JSON.parse(c.arguments || "{}"));
    return typeof answer === "string" ? answer : JSON.stringify(answer);
  } catch (e) {
    if (e instanceof Cancelled || e instanceof Fenced) throw e;
    if (e instanceof Refusal || e instanceof SyntaxError) return `error: ${e.message}`;
    throw e;
  }
}

function chat(turn: Turn): string {
  const messages: Message[] = [];
  const system = turn.config.system;
  if (typeof system === "string") messages.push({ role: "system", content: system });
  for (const m of turn.history) messages.push({ role: m.role, content: m.content });
  messages.push({ role: "user", content: turn.content });
  const tools = turn.modelTools(); // the granted tools, named as a model takes them
  for (let step = 0; step < MAX_STEPS; step++) {
    turn.checkCancel(); // a stop was asked for: throws Cancelled, the turn ends
    const answer: Answer = turn.callTool("llm", { messages, tools });
    const calls = answer.tool_calls ?? [];
    if (calls.length === 0) return answer.content ?? "";
    messages.push({ role: "assistant", content: answer.content ?? "", tool_calls: calls });
    for (const c of calls) messages.push({ role: "tool", tool_call_id: c.id, content: call(turn, c) });
  }
  throw new Error(`no answer after ${MAX_STEPS} model calls`);
}

export const run = exportAgent(chat);
