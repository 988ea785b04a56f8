"""The official MCP client (the `mcp` Python SDK, PyPI) against agent-host's
MCP server (POST /mcp): run by tests/mcp_server.rs with the venv scripts/test
caches for tests/mcp/requirements.txt. Each scenario prints one line of JSON
the Rust test asserts on.

    client.py main URL URL2 TOKEN   list, call, call with progress, a task cancelled,
                                    a task found and read by a new session on URL2
    client.py approval URL TOKEN    a task whose run waits for a person: input_required, approved
                                    through the native API, then its result
    client.py other URL TOKEN TASK  another tenant: its tools, and the task not found
"""

import asyncio
import json
import sys

import httpx2
import mcp_types as types
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError


def client(url, token):
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(120))
    return Client(streamable_http_client(f"{url}/mcp", http_client=http))


async def start_task(c, name, arguments):
    """tools/call as a task (2025-11-25): the SDK's typed call_tool has no
    task parameter and validates a CallToolResult, so the request goes out
    through the session's dispatcher and its CreateTaskResult is read here."""
    raw = await c.session._dispatcher.send_raw_request(
        "tools/call", {"name": name, "arguments": arguments, "task": {"ttl": 600000}}, {}
    )
    return types.CreateTaskResult.model_validate(raw).task


async def get_task(c, task_id):
    return await c.session.send_request(
        types.GetTaskRequest(params=types.GetTaskRequestParams(task_id=task_id)), types.GetTaskResult
    )


async def task_result(c, task_id):
    return await c.session.send_request(
        types.GetTaskPayloadRequest(params=types.GetTaskPayloadRequestParams(task_id=task_id)), types.CallToolResult
    )


async def list_tasks(c):
    return await c.session.send_request(types.ListTasksRequest(), types.ListTasksResult)


def meta(result):
    return result.model_dump(by_alias=True, mode="json").get("_meta") or {}


def text(result):
    return "".join(b.text for b in result.content if b.type == "text")


async def until(c, task_id, statuses, within=60):
    """Polls the task until it reaches one of `statuses`, or fails at the deadline."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        t = await get_task(c, task_id)
        if t.status in statuses:
            return t
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"task {task_id} never reached {statuses} within {within} s: {t}")
        await asyncio.sleep(0.05)


async def main(url, url2, token):
    out = {}
    async with client(url, token) as c:
        out["protocol"] = c.protocol_version
        caps = c.server_capabilities
        out["tasks_capability"] = caps.tasks is not None and caps.tasks.requests.tools.call is not None
        tools = (await c.list_tools()).tools
        out["tools"] = {
            t.name: {
                "description": t.description,
                "properties": sorted(t.input_schema.get("properties", {})),
                "required": t.input_schema.get("required"),
                "config": t.input_schema["properties"]["config"],
                "task_support": t.execution.task_support if t.execution else None,
            }
            for t in tools
        }

        answer = await c.call_tool("echo", {"prompt": "hello there"})
        out["call"] = {"text": text(answer), "error": answer.is_error, "run": meta(answer).get("agent-host/run")}

        progress = []

        async def on_progress(value, total, message):
            progress.append([value, message])

        counted = await c.call_tool(
            "sleep", {"prompt": "count", "config": {"steps": 4, "step_ms": 150}}, progress_callback=on_progress
        )
        # The SDK runs each progress callback as a task of its own: the
        # result may come back before the last of them has run.
        deadline = asyncio.get_running_loop().time() + 10
        while "".join(m for _, m in sorted(progress)) != text(counted):
            if asyncio.get_running_loop().time() > deadline:
                break  # the Rust test reports what arrived
            await asyncio.sleep(0.01)
        out["progress"] = {"text": text(counted), "notes": sorted(progress)}

        bad = await c.call_tool("echo", {})
        out["bad_arguments"] = {"error": bad.is_error, "text": text(bad)}
        try:
            await c.call_tool("nobody", {"prompt": "hi"})
            out["unknown_tool"] = "no error"
        except MCPError as e:
            out["unknown_tool"] = e.error.code

        # A long call as a task, cancelled: a durable stop of its run.
        long = await start_task(c, "sleep", {"prompt": "long nap", "config": {"steps": 100000, "step_ms": 50}})
        first = long.status
        await until(c, long.task_id, {"working"})
        listed = [t.task_id for t in (await list_tasks(c)).tasks]
        cancelled = await c.session.send_request(
            types.CancelTaskRequest(params=types.CancelTaskRequestParams(task_id=long.task_id)), types.CancelTaskResult
        )
        after = await get_task(c, long.task_id)
        try:
            await c.session.send_request(
                types.CancelTaskRequest(params=types.CancelTaskRequestParams(task_id=long.task_id)),
                types.CancelTaskResult,
            )
            again = "no error"
        except MCPError as e:
            again = e.error.code
        out["cancel"] = {"id": long.task_id, "first": first, "listed": long.task_id in listed,
                         "answer": cancelled.status, "after": after.status, "again": again}

        # A task whose client goes away: started here...
        short = await start_task(c, "sleep", {"prompt": "nap", "config": {"steps": 3, "step_ms": 100}})
        out["reconnect_created"] = {"id": short.task_id, "status": short.status, "ttl": short.ttl,
                                    "poll": short.poll_interval}
        try:
            await get_task(c, "00000000-0000-7000-8000-000000000000")
            out["unknown_task"] = "no error"
        except MCPError as e:
            out["unknown_task"] = e.error.code

    # ...and found by a new session (on another process): its state, then its result.
    async with client(url2, token) as c:
        found = await get_task(c, short.task_id)
        result = await task_result(c, short.task_id)
        done = await get_task(c, short.task_id)
        out["reconnect"] = {"found": found.status, "text": text(result), "error": result.is_error,
                            "related": meta(result).get("io.modelcontextprotocol/related-task"),
                            "after": done.status}
    print(json.dumps(out), flush=True)


async def approval(url, token):
    offered = {"tools": [{"name": "send", "description": "send it", "parameters": {"type": "object"}}]}
    async with client(url, token) as c:
        t = await start_task(c, "chat", {"prompt": "send the report", "config": offered})
        waiting = await until(c, t.task_id, {"input_required"})
        # A person decides through the native API: the run is the same one.
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60)
        run = (await http.get(f"{url}/v1/runs/{t.task_id}")).json()
        call = run["pending_approval"]["call_id"]
        decided = await http.post(f"{url}/v1/runs/{t.task_id}/approvals/{call}", json={"decision": "approve"})
        result = await task_result(c, t.task_id)
        done = await get_task(c, t.task_id)
    print(json.dumps({"id": t.task_id, "waiting": waiting.status, "note": waiting.status_message,
                      "decided": decided.status_code, "text": text(result), "error": result.is_error,
                      "after": done.status}), flush=True)


async def other(url, token, task):
    out = {}
    async with client(url, token) as c:
        out["tools"] = sorted(t.name for t in (await c.list_tools()).tools)
        try:
            await get_task(c, task)
            out["get"] = "found"
        except MCPError as e:
            out["get"] = e.error.code
        try:
            await task_result(c, task)
            out["result"] = "found"
        except MCPError as e:
            out["result"] = e.error.code
        out["listed"] = [t.task_id for t in (await list_tasks(c)).tasks]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    asyncio.run({"main": main, "approval": approval, "other": other}[what](*args))
