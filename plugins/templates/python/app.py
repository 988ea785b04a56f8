"""{{name}}: a chat agent. Each turn sends the conversation to the model (the
host's `llm` tool, granted in manifest.json) and returns its answer; the host
streams the model's text into the run as it arrives. A stop asked for before
the model call ends the turn `cancelled`.

Build it with `agent-host build`, upload it with `agent-host plugins upload`,
run it with `agent-host runs create --plugin {{name}} "hello"` (README.md).
"""

from agent_plugin import Turn, export


def run(turn: Turn) -> str:
    messages = []
    system = turn.config.get("system")
    if isinstance(system, str):
        messages.append({"role": "system", "content": system})
    messages.extend({"role": m.role, "content": m.content} for m in turn.history)
    messages.append({"role": "user", "content": turn.content})
    turn.check_cancel()  # a stop was asked for: raises Cancelled, the turn ends
    answer = turn.call_tool("llm", {"messages": messages})
    return answer.get("content") or ""


WitWorld = export(run)
