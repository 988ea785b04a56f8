"""A chat agent in Python, the same loop as the Rust `chat` plugin: ask the
model, run the tools it asks for, ask again with their results, until it
answers in text. The host streams the model's text to the run as it arrives.

Config: `system` (a system prompt), `tools` (what the model is offered:
`[{name, description, parameters}]`, each granted in the manifest or a
function the client runs; or `"granted"`: every host tool the plugin was
granted but the model itself and `wait`, an MCP server's included, plus the
client's functions), `input` (chat messages that are this turn, in
place of the user's message), `max_steps` (model calls per turn, default 8).

Switches for trying the host's limits (the tests use them):
`hold_ms` streams a "." every 20 ms for that long before the answer,
stopping when a stop is asked for; with `ignore_stop` it does not look;
`hoard_mb` keeps that many MiB alive first (past the memory limit the run
fails with reason `limit`); `answer` is returned as is, with no model call
(the benchmark's bare turn).
"""

import json
import time

from agent_plugin import Cancelled, Fenced, Refusal, Turn, export


def run_tool(turn: Turn, call: dict) -> str:
    """One tool call the model asked for. Its failure is told to the model,
    which can try otherwise; only a stop or a lost run ends the turn."""
    try:
        args = json.loads(call.get("arguments") or "{}")
    except ValueError as e:
        return f"error: the arguments are not JSON: {e}"
    try:
        answer = turn.call_tool(call.get("name", ""), args)
    except (Cancelled, Fenced):
        raise
    except Refusal as e:
        return f"error: {e}"
    return answer if isinstance(answer, str) else json.dumps(answer)


def hold(turn: Turn) -> None:
    """The `hold_ms` / `ignore_stop` switches."""
    hold_ms = turn.config_int("hold_ms", 0)
    ignore = bool(turn.config.get("ignore_stop"))
    deadline = time.monotonic() + hold_ms / 1000
    while time.monotonic() < deadline:
        if not ignore:
            turn.check_cancel()
        try:
            turn.delta(".")
        except Refusal:
            if not ignore:
                raise
        time.sleep(0.02)


def chat(turn: Turn) -> str:
    hoard = [bytearray(1 << 20) for _ in range(turn.config_int("hoard_mb", 0))]  # noqa: F841
    hold(turn)
    if isinstance(turn.config.get("answer"), str):
        return turn.config["answer"]
    messages = []
    system = turn.config.get("system")
    if isinstance(system, str):
        messages.append({"role": "system", "content": system})
    messages.extend({"role": m.role, "content": m.content} for m in turn.history)
    if isinstance(turn.config.get("input"), list):
        messages.extend(turn.config["input"])
    else:
        messages.append({"role": "user", "content": turn.content})
    tools = turn.config.get("tools", [])
    if tools == "granted":
        tools = turn.model_tools() + [
            {"name": t.name, "description": t.description, "parameters": t.parameters} for t in turn.client_tools
        ]
    max_steps = min(max(turn.config_int("max_steps", 8), 1), 64)
    for n in range(1, max_steps + 1):
        turn.emit("step", {"n": n})
        # Instructions queued for this turn since the last step (steering).
        messages.extend({"role": "user", "content": i} for i in turn.take_instructions())
        answer = turn.call_tool("llm", {"messages": messages, "tools": tools})
        content = answer.get("content") or ""
        calls = answer.get("tool_calls") or []
        if not calls:
            return content
        # Calls the client runs end the turn: the client answers them in its next one.
        for_client = [c for c in calls if turn.is_client_tool(c.get("name", ""))]
        if for_client:
            for c in for_client:
                turn.call_client(c.get("id", ""), c.get("name", ""), c.get("arguments", ""))
            return content
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": run_tool(turn, call)})
    raise RuntimeError(f"no final answer after {max_steps} model calls")


WitWorld = export(chat)
