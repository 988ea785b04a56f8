// {{name}}: a chat agent. Each turn sends the conversation to the model (the
// host's `llm` tool, granted in manifest.json) and returns its answer; the
// host streams the model's text into the run as it arrives. A stop asked for
// before the model call ends the turn `cancelled`.
//
// `../sdk-js/index.js` is agent-host's SDK (its types are index.d.ts):
// `agent-host build` type-checks and compiles this file with the TypeScript
// compiler agent-host pins, beside a copy of the SDK, wherever this is.
import { exportAgent, type Turn } from "../sdk-js/index.js";

type Message = { role: string; content: string };

function chat(turn: Turn): string {
  const messages: Message[] = [];
  const system = turn.config.system;
  if (typeof system === "string") messages.push({ role: "system", content: system });
  for (const m of turn.history) messages.push({ role: m.role, content: m.content });
  messages.push({ role: "user", content: turn.content });
  turn.checkCancel(); // a stop was asked for: throws Cancelled, the turn ends
  const answer: { content?: string } = turn.callTool("llm", { messages });
  return answer.content ?? "";
}

export const run = exportAgent(chat);
