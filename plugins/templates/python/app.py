"""{{name}}: a chat agent. Each turn sends the conversation to the model (the
host's `llm` tool) with the other tools manifest.json grants offered to it,
runs the calls the model asks for and asks again with their answers, until
the model answers in text. The host streams the model's text into the run as
it arrives. A stop asked for ends the turn `cancelled` at the next step.

Grant a tool in manifest.json (`"tools": ["llm", "clock"]` on the demo host,
or an MCP server's `"docs.search"`) and the model is offered it. Build with
`agent-host build`, upload with `agent-host plugins upload`, run with
`agent-host runs create --plugin {{name}} "hello"` (README.md).
"""

import json

from agent_plugin import Cancelled, Fenced, Refusal, Turn, export

MAX_STEPS = 8


def call(turn: Turn, c: dict) -> str:
    """One call the model asked for; a failure is told to the model."""
    try:
        answer = turn.call_tool(c["name"], json.loads(c.get("arguments") or "{}"))
    except (Cancelled, Fenced):
        raise
    except (Refusal, ValueError) as e:
        return f"error: {e}"
    return answer if isinstance(answer, str) else json.dumps(answer)


def run(turn: Turn) -> str:
    messages = []
    system = turn.config.get("system")
    if isinstance(system, str):
        messages.append({"role": "system", "content": system})
    messages.extend({"role": m.role, "content": m.content} for m in turn.history)
    messages.append({"role": "user", "content": turn.content})
    tools = turn.model_tools()  # the granted tools, named as a model takes them
    for _ in range(MAX_STEPS):
        turn.check_cancel()  # a stop was asked for: raises Cancelled, the turn ends
        answer = turn.call_tool("llm", {"messages": messages, "tools": tools})
        calls = answer.get("tool_calls") or []
        if not calls:
            return answer.get("content") or ""
        messages.append({"role": "assistant", "content": answer.get("content") or "", "tool_calls": calls})
        for c in calls:
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": call(turn, c)})
    raise RuntimeError(f"no answer after {MAX_STEPS} model calls")


WitWorld = export(run)
