"""The official openai SDK as an agent-host client (run by tests/responses.rs
against two real host processes, A and B, on one database): background
create, a dropped stream resumed on the other process with starting_after,
the stream helper, cancel twice, previous_response_id, a function-call round
trip, Idempotency-Key through extra_headers, and the spec's error shape.
Every object and event is checked against the bundled Open Responses schema."""

import os
import sys
import uuid

import openai

from common import check, client, dumps, numbers, valid_events, valid_response, wait_status

A = client(os.environ["HOST_A"])
B = client(os.environ["HOST_B"])
# The builtin `sleep` streams `steps` deltas, one each `step_ms`; the
# agent-host extension `config` is its config.
LONG = {"config": {"steps": 100000, "step_ms": 20}}
SHORT = {"config": {"steps": 12, "step_ms": 30}}


def background_create_and_resume_elsewhere():
    r = A.responses.create(model="sleep", input="count", background=True, extra_body=SHORT)
    check(r.status == "queued", f"background create answers queued at once, not {r.status}")
    check(r.background is True, "background is echoed")
    valid_response(r, "the queued object")
    # A stream on A, dropped after the first delta.
    first = []
    with A.responses.retrieve(r.id, stream=True) as stream:
        for e in stream:
            first.append(e)
            if e.type == "response.output_text.delta":
                break
    n = first[-1].sequence_number
    # The rest, from B.
    rest = list(B.responses.retrieve(r.id, stream=True, starting_after=n))
    whole = list(B.responses.retrieve(r.id, stream=True))
    check(numbers(first) + numbers(rest) == list(range(len(whole))), f"no gap or duplicate: {numbers(first)} + {numbers(rest)}")
    check(dumps(first) + dumps(rest) == dumps(whole), "the resumed events are exactly the remaining ones")
    check(whole[0].type == "response.created" and whole[0].sequence_number == 0, "response.created is number 0")
    check(whole[-1].type == "response.completed", f"ends completed, not {whole[-1].type}")
    valid_events(whole, "background stream")
    text = "".join(e.delta for e in whole if e.type == "response.output_text.delta")
    check(text == "".join(f"step {i}. " for i in range(12)), f"the deltas make the text: {text!r}")
    final = B.responses.retrieve(r.id)
    valid_response(final, "the completed object")
    check(final.output_text == text, "the object's text is the streamed text")
    check(final.usage is not None and final.usage.total_tokens == 0, "usage is there (no model call: zero tokens)")
    # Past the end: nothing but [DONE].
    check(list(A.responses.retrieve(r.id, stream=True, starting_after=len(whole) - 1)) == [], "nothing after the end")
    return r.id


def stream_helper(rid):
    with B.responses.stream(response_id=rid) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    check(final.status == "completed" and final.output_text.startswith("step 0."), f"helper's final: {final.status}")


def create_streaming():
    events = list(A.responses.create(model="chat", input="Count from 1 to 5.", stream=True))
    types = [e.type for e in events]
    check(types[:3] == ["response.created", "response.queued", "response.in_progress"], f"the lifecycle: {types[:3]}")
    check(types[-1] == "response.completed", f"ends completed: {types[-1]}")
    check(numbers(events) == list(range(len(events))), "numbered 0..n")
    valid_events(events, "streaming create")
    final = events[-1].response
    check(final.output_text == "Offline reply to: Count from 1 to 5.", f"text: {final.output_text!r}")
    check(final.usage.input_tokens > 0 and final.usage.output_tokens > 0, "usage from the run")
    check(final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens, "total")


def cancel_twice():
    r = A.responses.create(model="sleep", input="long", background=True, extra_body=LONG)
    wait_status(A, r.id, {"in_progress"})
    c1 = B.responses.cancel(r.id)
    check(c1.id == r.id and c1.status in ("in_progress", "cancelled"), f"cancel answers the object: {c1.status}")
    done = wait_status(A, r.id, {"cancelled"})
    valid_response(done, "the cancelled object")
    c2 = A.responses.cancel(r.id)
    check(c2.status == "cancelled", f"a second cancel answers the ended object, not {c2.status}")
    events = list(B.responses.retrieve(r.id, stream=True))
    check(events[-1].type == "response.incomplete" and events[-1].response.status == "cancelled",
          f"a cancelled stream ends with a cancelled snapshot: {events[-1].type}")
    check(numbers(events) == list(range(len(events))), "numbered")
    # A queued one is cancelled outright, and answers cancelled at once.
    q = A.responses.create(model="sleep", input="long", background=True, extra_body=LONG,
                           previous_response_id=r.id)
    blocker = A.responses.create(model="sleep", input="long", background=True, extra_body=LONG,
                                 previous_response_id=q.id)
    check(A.responses.cancel(blocker.id).status == "cancelled", "a queued turn cancels at once")
    A.responses.cancel(q.id)
    wait_status(A, q.id, {"cancelled"})


def multi_turn():
    r1 = A.responses.create(model="chat", input="My name is Alice.")
    check(r1.status == "completed", f"a blocking create answers the ended object: {r1.status}")
    valid_response(r1, "blocking create")
    r2 = B.responses.create(model="chat", input="What is my name?", previous_response_id=r1.id)
    check(r2.previous_response_id == r1.id, "previous_response_id echoed")
    check(r2.output_text == "Offline reply to: What is my name?", r2.output_text)
    # The offline model counts every word it was sent: this turn's four, plus the history.
    check(r2.usage.input_tokens > 4, f"the history was sent: {r2.usage.input_tokens} input tokens")
    items = A.responses.input_items.list(r2.id)
    check([i.type for i in items.data] == ["message"], "input_items")


def function_call_round_trip():
    tools = [{"type": "function", "name": "get_weather", "description": "weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": False}]
    r1 = A.responses.create(model="chat", input="weather in Lyon", tools=tools)
    check(r1.status == "completed", r1.status)
    calls = [o for o in r1.output if o.type == "function_call"]
    check(len(calls) == 1 and calls[0].name == "get_weather", f"a function_call item: {r1.output}")
    check(calls[0].arguments == '{"input":"weather in Lyon"}', calls[0].arguments)
    valid_response(r1, "function call")
    r2 = B.responses.create(model="chat", previous_response_id=r1.id, tools=tools,
                            input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    check(r2.output_text == "Offline reply to: weather in Lyon Tool get_weather said: sunny", r2.output_text)


def idempotency():
    key = f"k-{uuid.uuid4()}"
    body = dict(model="chat", input="once", background=True, extra_headers={"Idempotency-Key": key})
    first = A.responses.with_raw_response.create(**body)
    again = B.responses.with_raw_response.create(**body)
    check(first.parse().id == again.parse().id, "a retried create with its key is the first response")
    check(again.headers.get("idempotent-replayed") == "true", "marked as a replay")
    other = dict(body, input="another")
    try:
        A.responses.create(**other)
        check(False, "the same key with another body is refused")
    except openai.ConflictError as e:
        check(e.body["code"] == "idempotency_key_reused", e.body)


def errors_and_delete():
    try:
        A.responses.create(model="no-such-plugin", input="hi")
        check(False, "an unknown model is refused")
    except openai.NotFoundError as e:
        check(e.body["param"] == "model" and e.body["type"] == "invalid_request_error", e.body)
        check(set(e.body) == {"message", "type", "param", "code"}, e.body)
    try:
        A.responses.create(model="chat", input="hi", store=False)
        check(False, "store: false is refused")
    except openai.BadRequestError as e:
        check(e.body["param"] == "store", e.body)
    r = A.responses.create(model="chat", input="to delete", metadata={"k": "v"}, instructions="be brief")
    check(r.metadata == {"k": "v"} and r.instructions == "be brief", "metadata and instructions are kept")
    d = B.responses.delete(r.id)
    check(d is None, "delete answers")
    try:
        A.responses.retrieve(r.id)
        check(False, "a deleted response is not found")
    except openai.NotFoundError:
        pass


def main():
    rid = background_create_and_resume_elsewhere()
    stream_helper(rid)
    create_streaming()
    cancel_twice()
    multi_turn()
    function_call_round_trip()
    idempotency()
    errors_and_delete()
    print("responses_sdk: all passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"responses_sdk: FAILED: {e}", file=sys.stderr)
        raise
