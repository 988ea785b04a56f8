"""What the Responses tests share: the SDK client of a host, the spec's
schema (llm-comply's bundled Open Responses document) and a checker."""

import os
import pathlib
import time

import openai
from llm_comply.schema import SpecLoader

SPEC = SpecLoader(str(pathlib.Path(__import__("llm_comply").__file__).parent / "specs" / "openresponses.json"))
KEY = os.environ["AGENT_HOST_TOKEN"]


def client(base):
    """An SDK client of the host at `base` (host:port); no retries, so a
    failure shows at once."""
    return openai.OpenAI(base_url=f"http://{base}/v1", api_key=KEY, max_retries=0, timeout=60)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def valid_response(obj, what):
    """The object validates against the spec's ResponseResource."""
    data = obj if isinstance(obj, dict) else obj.model_dump(mode="json", exclude_unset=True)
    errors = SPEC.validate(data, "ResponseResource")
    check(not errors, f"{what}: not a ResponseResource: {errors}")


def valid_events(events, what):
    """Each event validates against its spec schema, and the numbers run 0, 1, ... without a gap."""
    for e in events:
        data = e.model_dump(mode="json", exclude_unset=True)
        errors = SPEC.validate_sse_event(data["type"], data)
        check(not errors, f"{what}: event {data['type']} #{data['sequence_number']}: {errors}")


def numbers(events):
    return [e.sequence_number for e in events]


def dumps(events):
    return [e.model_dump(mode="json", exclude_unset=True) for e in events]


def wait_status(c, rid, statuses, within_s=30):
    deadline = time.monotonic() + within_s
    while True:
        r = c.responses.retrieve(rid)
        if r.status in statuses:
            return r
        check(time.monotonic() < deadline, f"{rid} never reached {statuses}; last {r.status}")
        time.sleep(0.05)
