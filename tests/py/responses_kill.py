"""A host process killed mid-stream (run by tests/responses.rs): the SDK
client streams response RESPONSE_ID from HOST_A, SIGKILLs that process
(HOST_A_PID) after the first delta, and resumes on HOST_B with
starting_after its last sequence_number: no gap, no duplicate, and the
events are exactly those of a whole replay."""

import os
import signal
import sys

from common import check, client, dumps, numbers, valid_events

A = client(os.environ["HOST_A"])
B = client(os.environ["HOST_B"])
rid = os.environ["RESPONSE_ID"]

seen = []
try:
    for e in A.responses.retrieve(rid, stream=True):
        seen.append(e)
        if e.type == "response.output_text.delta" and len([x for x in seen if x.type == e.type]) == 2:
            # The run is live (in_progress, on B) right before A dies.
            live = B.responses.retrieve(rid).status
            check(live == "in_progress", f"the run is in progress when A is killed, not {live}")
            os.kill(int(os.environ["HOST_A_PID"]), signal.SIGKILL)
except Exception as err:  # whatever the transport raises for a body cut off
    print(f"responses_kill: the stream broke as the process died: {type(err).__name__}", file=sys.stderr)

check(seen and seen[-1].type != "response.completed", f"killed mid-stream, after {len(seen)} events")
check(B.responses.retrieve(rid).status == "in_progress", "the run outlived the process that served its stream")
last = seen[-1].sequence_number
rest = list(B.responses.retrieve(rid, stream=True, starting_after=last))
whole = list(B.responses.retrieve(rid, stream=True))
got = numbers(seen) + numbers(rest)
check(got == list(range(len(whole))), f"no gap or duplicate in sequence_number: {got}")
check(dumps(seen) + dumps(rest) == dumps(whole), "the resumed events are exactly the remaining ones")
check(whole[-1].type == "response.completed", f"the run went on elsewhere and completed: {whole[-1].type}")
valid_events(whole, "resumed stream")
print(f"responses_kill: {len(seen)} events from A, {len(rest)} from B after {last}; all passed")
