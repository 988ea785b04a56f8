"""An MCP server for the host's tests, built on the `mcp` Python SDK from PyPI
(its FastMCP server, named `MCPServer` since mcp 2), served over Streamable
HTTP on loopback.

    python py_server.py PORT EVENTS_FILE

Tools: `echo` (answers its input as text), `weather` (structured content),
`fail` (a tool error result), `slow` (sleeps `seconds`, 60 by default; a
cancellation the server sees is appended to EVENTS_FILE as
`cancelled <seconds>`), `add_late` (adds a tool `late` to the list).
"""

import sys

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel

port = int(sys.argv[1])
events = sys.argv[2]

server = MCPServer("agent-host-test-py")


def note(line: str) -> None:
    with open(events, "a", encoding="utf-8") as f:
        f.write(line + "\n")


@server.tool(description="Answers its input back", annotations=ToolAnnotations(readOnlyHint=True), structured_output=False)
def echo(input: str) -> str:
    note(f"echo {input}")
    return f"echo: {input}"


class Weather(BaseModel):
    city: str
    sky: str
    celsius: int


@server.tool(description="Today's weather for a city", annotations=ToolAnnotations(idempotentHint=True))
def weather(city: str) -> Weather:
    return Weather(city=city, sky="clear", celsius=21)


@server.tool(description="Always fails")
def fail(why: str) -> str:
    raise ToolError(f"it failed because {why}")


@server.tool(description="Sleeps for a while", annotations=ToolAnnotations(destructiveHint=True), structured_output=False)
async def slow(input: str = "", seconds: float = 60) -> str:
    note(f"started {seconds}")
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        note(f"cancelled {seconds}")
        raise
    note(f"finished {seconds}")
    return "slept"


@server.tool(description="Notes that it was called", structured_output=False)
def ping() -> str:
    note("ping")
    return "pong"


def late(input: str = "") -> str:
    return f"late: {input}"


@server.tool(description="Adds the tool `late` to this server's list", structured_output=False)
def add_late() -> str:
    server.add_tool(late, description="A tool added while the server runs", structured_output=False)
    return "added"


server.run("streamable-http", host="127.0.0.1", port=port)
