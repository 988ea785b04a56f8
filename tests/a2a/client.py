"""The official A2A client (a2a-sdk, PyPI) against agent-host's A2A
endpoints: run by tests/a2a.rs with the venv scripts/test caches. Each
scenario prints progress lines and, last, one line of JSON the Rust test
asserts on.

    client.py main URL TOKEN           card, blocking, background, list, stream, cancel, context, errors
    client.py rejoin URL_W URL_A URL_B TOKEN
                                       a task started on W, subscribed on A until A dies, rejoined on B
    client.py approval URL TOKEN       a task that needs a person's approval: INPUT_REQUIRED, then approved
    client.py other URL TOKEN TASK     another tenant: the task is not found
    client.py push URL TOKEN HOOK      push notification configs: on a send, created, read, listed,
                                       deleted, refused; a background task and an approval's
    client.py verify KEY FILE          the notifications received (FILE, JSON): each verified as a
                                       Standard Webhooks receiver does (`standardwebhooks`, PyPI)
                                       and parsed as the protocol's StreamResponse
"""

import asyncio
import json
import sys
import uuid

import httpx
from google.protobuf import json_format

from a2a.client import ClientConfig, ClientFactory
from a2a.client.card_resolver import A2ACardResolver
from standardwebhooks.webhooks import Webhook
from a2a.types.a2a_pb2 import (
    AuthenticationInfo,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
    TaskState,
)


def http(token):
    return httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120)


async def client(url, token, agent, streaming):
    config = ClientConfig(streaming=streaming, httpx_client=http(token))
    return await ClientFactory(config).create_from_url(f"{url}/a2a/{agent}")


def message(text, context=None, task=None, config=None, data=None):
    m = Message(message_id=str(uuid.uuid4()), role=Role.ROLE_USER, parts=[Part(text=text)])
    if data is not None:
        m.parts.append(Part(data=json_format.ParseDict(data, Part().data)))
    if context:
        m.context_id = context
    if task:
        m.task_id = task
    if config is not None:
        m.metadata.update({"config": config})
    return m


def state(task):
    return TaskState.Name(task.status.state)


def text(task):
    return "".join(p.text for a in task.artifacts for p in a.parts)


async def send(c, m, immediately=False, push=None):
    """SendMessage (the client is not streaming): the one task answered."""
    config = SendMessageConfiguration(return_immediately=immediately)
    if push is not None:
        config.task_push_notification_config.CopyFrom(push)
    req = SendMessageRequest(message=m, configuration=config)
    got = [r async for r in c.send_message(req)]
    assert len(got) == 1 and got[0].HasField("task"), got
    return got[0].task


async def until(c, task_id, states, within=60):
    """Polls the task until it reaches one of `states`, or fails at the deadline."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        t = await c.get_task(GetTaskRequest(id=task_id))
        if state(t) in states:
            return t
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"task {task_id} never reached {states} within {within} s: {t}")
        await asyncio.sleep(0.05)


async def main(url, token):
    out = {}
    resolver = A2ACardResolver(http(token), f"{url}/a2a/echo")
    card = await resolver.get_agent_card()
    out["card"] = {
        "name": card.name,
        "url": card.supported_interfaces[0].url,
        "binding": card.supported_interfaces[0].protocol_binding,
        "streaming": card.capabilities.streaming,
        "skills": [s.id for s in card.skills],
        "security": list(card.security_schemes.keys()),
    }
    echo = await client(url, token, "echo", streaming=False)
    t = await send(echo, message("hello there"))
    out["blocking"] = {"id": t.id, "context": t.context_id, "state": state(t), "text": text(t),
                       "history": [(Role.Name(m.role), m.parts[0].text) for m in t.history]}
    # The next message in the same context: a new task of the same conversation.
    t2 = await send(echo, message("and again", context=t.context_id))
    out["context"] = {"same": t2.context_id == t.context_id, "new_task": t2.id != t.id, "text": text(t2)}
    h = await echo.get_task(GetTaskRequest(id=t2.id, history_length=1))
    out["history_length_1"] = [Role.Name(m.role) for m in h.history]

    sleep = await client(url, token, "sleep", streaming=False)
    bg = await send(sleep, message("nap", config={"steps": 3, "step_ms": 100}), immediately=True)
    out["background_first"] = state(bg)
    done = await until(sleep, bg.id, {"TASK_STATE_COMPLETED"})
    out["background"] = {"state": state(done), "text": text(done)}
    second = await send(sleep, message("nap", context=bg.context_id, config={"steps": 1, "step_ms": 1}))
    page1 = await sleep.list_tasks(ListTasksRequest(context_id=bg.context_id, page_size=1))
    page2 = await sleep.list_tasks(ListTasksRequest(context_id=bg.context_id, page_size=1, page_token=page1.next_page_token))
    out["list"] = {"page1": [x.id for x in page1.tasks], "page2": [x.id for x in page2.tasks],
                   "total": page1.total_size, "last_token": page2.next_page_token, "second": second.id}

    streamer = await client(url, token, "echo", streaming=True)
    events = []
    async for r in streamer.send_message(SendMessageRequest(message=message("a b c"))):
        kind = r.WhichOneof("payload")
        if kind == "task":
            events.append(["task", state(r.task), text(r.task)])
        elif kind == "status_update":
            events.append(["status", TaskState.Name(r.status_update.status.state)])
        elif kind == "artifact_update":
            events.append(["artifact", "".join(p.text for p in r.artifact_update.artifact.parts),
                           r.artifact_update.append])
    out["stream"] = events

    long = await send(sleep, message("long nap", config={"steps": 100000, "step_ms": 50}), immediately=True)
    await until(sleep, long.id, {"TASK_STATE_WORKING"})
    cancelled = await sleep.cancel_task(CancelTaskRequest(id=long.id))
    out["cancel"] = {"id": long.id, "state": state(cancelled)}
    try:
        await sleep.cancel_task(CancelTaskRequest(id=long.id))
        out["cancel_again"] = "no error"
    except Exception as e:  # the client's typed error
        out["cancel_again"] = type(e).__name__
    try:
        await echo.get_task(GetTaskRequest(id=str(uuid.uuid4())))
        out["unknown"] = "no error"
    except Exception as e:
        out["unknown"] = type(e).__name__
    print(json.dumps(out), flush=True)


def record(r, seen):
    """Appends a subscription's task snapshot or delta to `seen`; the event's kind."""
    kind = r.WhichOneof("payload")
    if kind == "task":
        seen.append(["task", text(r.task)])
    elif kind == "artifact_update":
        seen.append(["delta", "".join(p.text for p in r.artifact_update.artifact.parts), r.artifact_update.append])
    return kind


async def rejoin(url_w, url_a, url_b, token):
    w = await client(url_w, token, "sleep", streaming=False)
    task = await send(w, message("count", config={"steps": 40, "step_ms": 100}), immediately=True)
    a = await client(url_a, token, "sleep", streaming=True)
    seen_a, ready, error = [], False, None
    try:
        async for r in a.subscribe(SubscribeToTaskRequest(id=task.id)):
            record(r, seen_a)
            if len(seen_a) >= 4 and not ready:
                ready = True
                print(f"READY {task.id}", flush=True)
    except Exception as e:  # the serving process was killed
        error = type(e).__name__
    b = await client(url_b, token, "sleep", streaming=True)
    seen_b, final = [], None
    async for r in b.subscribe(SubscribeToTaskRequest(id=task.id)):
        if record(r, seen_b) == "status_update":
            final = TaskState.Name(r.status_update.status.state)
    end = await b.get_task(GetTaskRequest(id=task.id))
    print(json.dumps({"id": task.id, "a": seen_a, "a_error": error, "b": seen_b, "final": final,
                      "text": text(end)}), flush=True)


async def approval(url, token):
    offered = {"tools": [{"name": "send", "description": "send it", "parameters": {"type": "object"}}]}
    c = await client(url, token, "chat", streaming=False)
    t = await send(c, message("send the report", config=offered))
    out = {"id": t.id, "first": state(t), "ask": t.status.message.parts[0].text if t.status.HasField("message") else ""}
    try:
        await send(c, message("maybe", task=t.id))
        out["unclear"] = "no error"
    except Exception as e:
        out["unclear"] = type(e).__name__
    done = await send(c, message("approve", task=t.id))
    out["after"] = state(done)
    out["text"] = text(done)
    print(json.dumps(out), flush=True)


async def other(url, token, task):
    c = await client(url, token, "echo", streaming=False)
    out = {"get": await error_name(c.get_task(GetTaskRequest(id=task))),
           "push_list": await error_name(c.list_task_push_notification_configs(
               ListTaskPushNotificationConfigsRequest(task_id=task)))}
    print(json.dumps(out), flush=True)


async def error_name(call):
    try:
        await call
        return "no error"
    except Exception as e:
        return type(e).__name__


async def push(url, token, hook):
    out = {}
    card = await A2ACardResolver(http(token), f"{url}/a2a/sleep").get_agent_card()
    out["capability"] = card.capabilities.push_notifications
    sleep = await client(url, token, "sleep", streaming=False)
    # A config on the send itself: told the task's state from the start.
    first = TaskPushNotificationConfig(url=f"{hook}/a", token="tok-a")
    m = message("nap", config={"steps": 3, "step_ms": 300})
    t = await send(sleep, m, immediately=True, push=first)
    out["task"] = t.id
    out["message_id"] = m.message_id
    b = await sleep.create_task_push_notification_config(TaskPushNotificationConfig(
        task_id=t.id, id="b", url=f"{hook}/b", token="tok-b",
        authentication=AuthenticationInfo(scheme="Bearer", credentials="cred-b")))
    out["created"] = {"task": b.task_id, "id": b.id, "url": b.url, "token": b.token,
                      "scheme": b.authentication.scheme, "credentials": b.authentication.credentials}
    await sleep.create_task_push_notification_config(TaskPushNotificationConfig(
        task_id=t.id, id="gone", url=f"{hook}/gone"))
    await sleep.delete_task_push_notification_config(DeleteTaskPushNotificationConfigRequest(task_id=t.id, id="gone"))
    got = await sleep.get_task_push_notification_config(GetTaskPushNotificationConfigRequest(task_id=t.id, id="b"))
    out["got"] = {"id": got.id, "url": got.url}
    listed = await sleep.list_task_push_notification_configs(ListTaskPushNotificationConfigsRequest(task_id=t.id))
    out["listed"] = sorted(c.id for c in listed.configs)
    out["get_deleted"] = await error_name(sleep.get_task_push_notification_config(
        GetTaskPushNotificationConfigRequest(task_id=t.id, id="gone")))
    out["elsewhere"] = await error_name(sleep.create_task_push_notification_config(TaskPushNotificationConfig(
        task_id=t.id, url="http://elsewhere.example/hook")))
    out["unknown_task"] = await error_name(sleep.create_task_push_notification_config(TaskPushNotificationConfig(
        task_id=str(uuid.uuid4()), url=f"{hook}/x")))
    done = await until(sleep, t.id, {"TASK_STATE_COMPLETED"})
    out["final"] = state(done)
    # A task that needs a person's approval: told INPUT_REQUIRED, then the rest.
    offered = {"tools": [{"name": "send", "description": "send it", "parameters": {"type": "object"}}]}
    chat = await client(url, token, "chat", streaming=False)
    c = await send(chat, message("send the report", config=offered),
                   push=TaskPushNotificationConfig(url=f"{hook}/c", token="tok-c"))
    out["approval_task"] = c.id
    out["approval_first"] = state(c)
    out["approval_after"] = state(await send(chat, message("approve", task=c.id)))
    print(json.dumps(out), flush=True)


async def verify(key, path):
    """Each notification received: verified with the tenant's key, then
    parsed (strictly) as the protocol's StreamResponse."""
    webhook = Webhook(key)
    seen = []
    for d in json.load(open(path)):
        webhook.verify(d["body"], d["headers"])
        r = json_format.Parse(d["body"], StreamResponse())
        assert r.WhichOneof("payload") == "status_update", r
        u = r.status_update
        seen.append({"route": d["route"], "task": u.task_id, "context": u.context_id,
                     "state": TaskState.Name(u.status.state), "at": u.status.timestamp.ToMilliseconds()})
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    asyncio.run({"main": main, "rejoin": rejoin, "approval": approval, "other": other, "push": push,
                 "verify": verify}[what](*args))
