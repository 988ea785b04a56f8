// {{name}}: a chat agent. Each turn sends the conversation to the model (the
// host's `llm` tool, granted in manifest.json) and returns its answer; the
// host streams the model's text into the run as it arrives. A stop asked for
// before the model call ends the turn `cancelled`.
//
// `../sdk-js/index.js` is agent-host's SDK: `agent-host build` builds this
// file beside a copy of it, wherever this directory is.
import { exportAgent } from "../sdk-js/index.js";

function chat(turn) {
  const messages = [];
  if (typeof turn.config.system === "string") messages.push({ role: "system", content: turn.config.system });
  for (const m of turn.history) messages.push({ role: m.role, content: m.content });
  messages.push({ role: "user", content: turn.content });
  turn.checkCancel(); // a stop was asked for: throws Cancelled, the turn ends
  const answer = turn.callTool("llm", { messages });
  return answer.content ?? "";
}

export const run = exportAgent(chat);
