"""A scripted model provider that speaks OpenAI's Responses API on loopback,
for tests/models.rs (issue 46: providers with `protocol = "responses"`).

What it sends is built from the `openai` SDK's own pydantic types (each event
validated by them), and each request it gets is validated against the SDK's
`ResponseCreateParamsStreaming`, so the host is held to OpenAI's published
shapes, not to a stand-in of ours. Its script: a request whose input has no
`function_call_output` and that offers tools is answered with a call of the
first tool; any other is answered with text that quotes the last tool output
(or says hello), streamed in pieces, then `response.completed` with usage.

Usage: responses_provider.py LOG  -- prints `PORT <n>`, then serves until
killed; every request's JSON body goes to LOG, one line each.
"""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pydantic
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
)
from openai.types.responses.response_create_params import ResponseCreateParamsStreaming
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails

LOG = sys.argv[1]
REQUEST = pydantic.TypeAdapter(ResponseCreateParamsStreaming)
lock = threading.Lock()
counter = [0]


def materialise(value):
    """Pydantic validates an `Iterable[...]` field lazily: walk it."""
    if isinstance(value, dict):
        return {k: materialise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ in ("ValidatorIterator", "generator"):
        return [materialise(v) for v in value]
    return value


def response(rid, model, output, status, usage=None):
    return Response(
        id=rid,
        object="response",
        created_at=time.time(),
        model=model,
        output=output,
        status=status,
        parallel_tool_calls=True,
        tool_choice="auto",
        tools=[],
        usage=usage,
    )


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def refuse(self, status, message):
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error"}}).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("content-length", "0")))
        body = json.loads(raw)
        with lock:
            with open(LOG, "a") as f:
                f.write(json.dumps(body) + "\n")
            counter[0] += 1
            n = counter[0]
        if self.path != "/v1/responses":
            return self.refuse(404, f"no route {self.path}")
        try:
            materialise(REQUEST.validate_python(body))
        except pydantic.ValidationError as e:
            return self.refuse(400, f"not a ResponseCreateParamsStreaming: {str(e)[:600]}")
        if body.get("stream") is not True:
            return self.refuse(400, "this provider only streams")
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.end_headers()
        seq = [0]

        def send(event):
            payload = event.model_copy(update={"sequence_number": seq[0]})
            seq[0] += 1
            data = payload.model_dump_json(exclude_none=True)
            self.wfile.write(f"event: {payload.type}\ndata: {data}\n\n".encode())
            self.wfile.flush()

        rid, model = f"resp_{n}", body["model"]
        send(ResponseCreatedEvent(type="response.created", sequence_number=0,
                                  response=response(rid, model, [], "in_progress")))
        items = body["input"] if isinstance(body["input"], list) else []
        outputs = [i for i in items if i.get("type") == "function_call_output"]
        tools = [t for t in body.get("tools", []) if t.get("type") == "function"]
        usage = ResponseUsage(
            input_tokens=11, output_tokens=7, total_tokens=18,
            input_tokens_details=InputTokensDetails(cached_tokens=3, cache_write_tokens=0),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        )
        if tools and not outputs:
            call = ResponseFunctionToolCall(type="function_call", id=f"fc_{n}", call_id=f"call_{n}",
                                            name=tools[0]["name"], arguments="", status="in_progress")
            send(ResponseOutputItemAddedEvent(type="response.output_item.added", output_index=0,
                                              item=call, sequence_number=0))
            args = '{"city": "Oslo"}'
            for piece in (args[:8], args[8:]):
                send(ResponseFunctionCallArgumentsDeltaEvent(
                    type="response.function_call_arguments.delta", item_id=call.id, output_index=0,
                    delta=piece, sequence_number=0))
            send(ResponseFunctionCallArgumentsDoneEvent(
                type="response.function_call_arguments.done", item_id=call.id, output_index=0,
                arguments=args, name=call.name, sequence_number=0))
            done = call.model_copy(update={"arguments": args, "status": "completed"})
            send(ResponseOutputItemDoneEvent(type="response.output_item.done", output_index=0,
                                             item=done, sequence_number=0))
            output = [done]
        else:
            said = outputs[-1]["output"] if outputs else "hello"
            text = f"The tool said: {said}" if outputs else "Hello from the Responses API."
            message = ResponseOutputMessage(type="message", id=f"msg_{n}", role="assistant",
                                            status="in_progress", content=[])
            send(ResponseOutputItemAddedEvent(type="response.output_item.added", output_index=0,
                                              item=message, sequence_number=0))
            part = ResponseOutputText(type="output_text", text="", annotations=[])
            send(ResponseContentPartAddedEvent(type="response.content_part.added", item_id=message.id,
                                               output_index=0, content_index=0, part=part,
                                               sequence_number=0))
            pieces = [text[i:i + 6] for i in range(0, len(text), 6)]
            for piece in pieces:
                send(ResponseTextDeltaEvent(type="response.output_text.delta", item_id=message.id,
                                            output_index=0, content_index=0, delta=piece, logprobs=[],
                                            sequence_number=0))
            send(ResponseTextDoneEvent(type="response.output_text.done", item_id=message.id,
                                       output_index=0, content_index=0, text=text, logprobs=[],
                                       sequence_number=0))
            done = message.model_copy(update={
                "status": "completed",
                "content": [ResponseOutputText(type="output_text", text=text, annotations=[])],
            })
            send(ResponseOutputItemDoneEvent(type="response.output_item.done", output_index=0,
                                             item=done, sequence_number=0))
            output = [done]
        send(ResponseCompletedEvent(type="response.completed", sequence_number=0,
                                    response=response(rid, model, output, "completed", usage)))
        self.close_connection = True


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(f"PORT {server.server_address[1]}", flush=True)
server.serve_forever()
