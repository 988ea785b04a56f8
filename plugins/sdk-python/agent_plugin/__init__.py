"""The guest side of agent-host for Python: write one function from a turn to
its answer and export it with :func:`export`. Built against the
``agent-host:plugin@0.2.0`` world with ``componentize-py`` (see
``scripts/build-plugin``), whose bindings (``wit_world``) are generated from
``wit/0.2.0`` at build time.

.. code-block:: python

    from agent_plugin import Turn, export

    def run(turn: Turn) -> str:
        turn.delta(turn.content)
        return turn.content

    WitWorld = export(run)

Host refusals arrive as exceptions (subclasses of :class:`Refusal`); an
exception that leaves ``run`` ends the run ``failed`` with its message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

try:
    from componentize_py_types import Err
    from wit_world.imports import host
    from wit_world.imports import types as wit
except ModuleNotFoundError as missing:
    # The host's bindings exist only inside a component build: say so,
    # rather than leave a bare "No module named 'wit_world'".
    if missing.name not in ("componentize_py_types", "wit_world", "wit_world.imports"):
        raise
    raise ImportError(
        "agent_plugin runs inside an agent-host plugin: its host bindings (wit_world) are generated when "
        "`agent-host build` (componentize-py) builds the plugin into a component, so it does not import in "
        "a plain Python"
    ) from missing

__all__ = [
    "Turn",
    "Message",
    "ClientTool",
    "ToolInfo",
    "Refusal",
    "Cancelled",
    "Fenced",
    "Denied",
    "Invalid",
    "LimitReached",
    "ToolFailed",
    "export",
    "CLIENT_CALLS_MAX",
]

#: Client calls a turn may end with, at most.
CLIENT_CALLS_MAX = 64

#: The longest tool name a model takes (the ``llm`` tool's bound).
MODEL_NAME_BYTES_MAX = 64


def model_name(name: str) -> str:
    """A host tool's name as a model takes it: 1-64 letters, digits, ``_``
    and ``-``. Another character (the ``.`` of ``<server>.<tool>``) becomes
    ``_``; a longer name is cut and ends with ``_`` and a hash of the whole
    name (FNV-1a, the same in every SDK)."""
    clean = "".join(c if (c.isascii() and c.isalnum()) or c in "_-" else "_" for c in name)
    if clean and len(clean) <= MODEL_NAME_BYTES_MAX:
        return clean
    h = 0x811C9DC5
    for b in name.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    suffix = f"_{h:08x}"
    return clean[: MODEL_NAME_BYTES_MAX - len(suffix)] + suffix


class Refusal(Exception):
    """The host refused a call. ``kind`` names the WIT ``host-error`` case."""

    kind = "refusal"

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}" if self.message else self.kind


class Cancelled(Refusal):
    """A stop was requested: wind down and return."""

    kind = "cancelled"


class Fenced(Refusal):
    """This worker no longer holds the run: nothing more will be written."""

    kind = "fenced"


class Denied(Refusal):
    """Not granted to this plugin (a tool outside its manifest)."""

    kind = "denied"


class Invalid(Refusal):
    """Malformed input (a reserved event kind, a payload not a JSON object)."""

    kind = "invalid"


class LimitReached(Refusal):
    """A limit of the plugin's manifest was reached."""

    kind = "limit"


class ToolFailed(Refusal):
    """The tool ran and failed."""

    kind = "tool failed"


def _refusal(error: Any) -> Refusal:
    """The exception for a WIT ``host-error`` value."""
    if isinstance(error, wit.HostError_Cancelled):
        return Cancelled()
    if isinstance(error, wit.HostError_Fenced):
        return Fenced()
    cases = {
        wit.HostError_Denied: Denied,
        wit.HostError_Invalid: Invalid,
        wit.HostError_Limit: LimitReached,
        wit.HostError_ToolFailed: ToolFailed,
    }
    for case, exc in cases.items():
        if isinstance(error, case):
            return exc(str(error.value))
    return Refusal(repr(error))


@dataclass
class Message:
    """One message of the conversation before this turn."""

    role: str
    content: str


@dataclass
class ClientTool:
    """A function the run's client runs itself (offer it to the model)."""

    name: str
    description: Optional[str]
    #: Its parameters' JSON schema, parsed.
    parameters: Any


@dataclass
class ToolInfo:
    """A host tool this plugin was granted, as the host lists it."""

    #: The name :meth:`Turn.call_tool` takes (an MCP server's tools are
    #: ``<server>.<tool>``).
    name: str
    description: Optional[str]
    #: Its arguments' JSON schema, parsed.
    input_schema: Any


@dataclass
class Turn:
    """One turn, with the host's imports as methods."""

    run_id: str
    conversation_id: str
    #: The user's message this turn answers.
    content: str
    #: The conversation before this turn, oldest first.
    history: List[Message]
    #: The run's config (a JSON object, parsed).
    config: dict
    #: Functions the run's client runs itself.
    client_tools: List[ClientTool]
    _client_calls: List[wit.ClientCall] = field(default_factory=list)
    _model_names: dict = field(default_factory=dict)

    def delta(self, text: str) -> None:
        """Streams a piece of the answer."""
        self.emit("content_delta", {"delta": text})

    def emit(self, kind: str, payload: dict) -> None:
        """Emits an event of the plugin's own kind (reserved kinds are refused)."""
        try:
            host.emit_event(kind, json.dumps(payload))
        except Err as e:
            raise _refusal(e.value) from None

    def call_tool(self, name: str, args: Any) -> Any:
        """Calls a granted host tool with JSON arguments; returns its JSON
        answer. ``name`` is the host's, or the one :meth:`model_tools` gave
        the model for it."""
        try:
            out = host.call_tool(self._model_names.get(name, name), json.dumps(args))
        except Err as e:
            raise _refusal(e.value) from None
        try:
            return json.loads(out)
        except ValueError as e:
            raise ToolFailed(f"tool answered non-JSON: {e}") from None

    def granted_tools(self) -> List[ToolInfo]:
        """The host tools this plugin was granted that the host has now (an
        MCP server's among them, as ``<server>.<tool>``), sorted by name:
        what :meth:`call_tool` may reach."""
        return [ToolInfo(t.name, t.description, _schema(t.input_schema)) for t in host.list_tools()]

    def model_tools(self) -> List[dict]:
        """The granted tools to offer a model, as the ``llm`` tool's ``tools``
        takes them (``{name, description, parameters}``): every granted tool
        but the model itself and ``wait``, each named as a model accepts
        (``py.echo`` is offered as ``py_echo``); :meth:`call_tool` takes the
        offered name. Add :attr:`client_tools` for the client's functions."""
        offered = []
        seen = set()
        for t in self.granted_tools():
            name = model_name(t.name)
            if t.name in ("llm", "wait") or name in seen:
                continue
            seen.add(name)
            self._model_names[name] = t.name
            offered.append({"name": name, "description": t.description, "parameters": t.input_schema})
        return offered

    def cancelled(self) -> bool:
        """Whether a stop was requested: return soon (the host interrupts a
        guest that does not)."""
        return host.check_cancel()

    def take_instructions(self) -> List[str]:
        """The instructions queued for this turn since the last take
        (``POST /v1/runs/{id}/steer``), oldest first, each taken once: append
        them to the model's context before its next call. A resumed run
        takes the same ones at the same point. Empty when none are queued."""
        try:
            out = host.call_tool("take-instructions", "{}")
        except Err as e:
            raise _refusal(e.value) from None
        taken = json.loads(out).get("instructions") or []
        return [str(i) for i in taken]

    def start_agent(self, plugin: str, input: str, config: Optional[dict] = None) -> str:
        """Starts a child run of ``plugin`` (a sub-agent: the manifest grants
        ``agent:<plugin>``) with ``input`` as its user message, and answers
        its run id at once; :meth:`await_agents` waits for it. A resumed run
        never starts the same child twice."""
        args: Dict[str, Any] = {"input": input}
        if config is not None:
            args["config"] = config
        try:
            out = host.call_tool("agent:" + plugin, json.dumps(args))
        except Err as e:
            raise _refusal(e.value) from None
        return str(json.loads(out)["run_id"])

    def await_agents(self, runs: Optional[List[str]] = None, any: bool = False) -> List[Dict[str, Any]]:
        """Waits for child runs this run started (every one when ``runs`` is
        empty): all of them, or with ``any`` the first to end, suspended with
        nothing held meanwhile. Answers each awaited child as ``{run_id,
        plugin, conversation_id, status, output, error}``; a failed child is
        a value here, not this run's failure."""
        args = {"runs": list(runs or []), "mode": "any" if any else "all"}
        try:
            out = host.call_tool("await-agents", json.dumps(args))
        except Err as e:
            raise _refusal(e.value) from None
        return list(json.loads(out).get("runs") or [])

    def check_cancel(self) -> None:
        """Raises :class:`Cancelled` when a stop was requested."""
        if self.cancelled():
            raise Cancelled()

    def is_client_tool(self, name: str) -> bool:
        """Whether ``name`` is a function the client runs."""
        return any(t.name == name for t in self.client_tools)

    def call_client(self, call_id: str, name: str, arguments: str) -> None:
        """Adds a call of a client's function to the calls this turn ends with
        (return soon after: the client answers them in its next turn)."""
        if not self.is_client_tool(name):
            raise Invalid(f"{name!r} is not a function the client runs")
        if len(self._client_calls) >= CLIENT_CALLS_MAX:
            raise LimitReached(f"at most {CLIENT_CALLS_MAX} client calls a turn")
        self._client_calls.append(wit.ClientCall(call_id=call_id, name=name, arguments=arguments))

    def config_int(self, key: str, default: int) -> int:
        """An integer config value, or ``default``."""
        value = self.config.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else default


def _schema(text: str) -> Any:
    """A JSON schema's text, parsed (an unreadable one as ``{}``)."""
    try:
        return json.loads(text)
    except ValueError:
        return {}


def _turn(input: wit.RunInput) -> Turn:
    try:
        config = json.loads(input.config)
    except ValueError:
        config = {}
    if not isinstance(config, dict):
        config = {}

    return Turn(
        run_id=input.run_id,
        conversation_id=input.conversation_id,
        content=input.content,
        history=[Message(m.role, m.content) for m in input.history],
        config=config,
        client_tools=[ClientTool(t.name, t.description, _schema(t.parameters)) for t in input.client_tools],
    )


def export(run: Callable[[Turn], str]) -> type:
    """The component's ``WitWorld`` class for ``run``: assign it to a
    module-level ``WitWorld`` in the app module componentize-py builds."""

    class WitWorld:
        def run(self, input: wit.RunInput) -> wit.TurnOutput:
            turn = _turn(input)
            try:
                text = run(turn)
            except Err:
                raise
            except Exception as e:  # the run ends failed with its message
                raise Err(str(e) or type(e).__name__) from None
            if not isinstance(text, str):
                raise Err(f"run returned {type(text).__name__}, not str")
            return wit.TurnOutput(text=text, client_calls=list(turn._client_calls))

    return WitWorld
