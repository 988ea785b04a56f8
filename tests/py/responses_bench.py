"""The Responses route beside the native one (docs/src/performance.md): create to the
first text delta for the same run (the builtin `echo`), through each route,
with one HTTP client (http.client, a fresh connection per request, like an
SDK's first call); and the events per second one Responses stream carries
when it replays a long journal. Run by hand against a running host:

    AGENT_HOST_TOKEN=... HOST=127.0.0.1:8080 python tests/py/responses_bench.py
"""

import http.client
import json
import os
import statistics
import time

HOST = os.environ["HOST"]
KEY = os.environ["AGENT_HOST_TOKEN"]
ROUNDS = int(os.environ.get("ROUNDS", "40"))


def request(method, path, body=None, sse=False):
    conn = http.client.HTTPConnection(HOST, timeout=60)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if sse:
        headers["Accept"] = "text/event-stream"
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    return conn, conn.getresponse()


def first_event(res, kind):
    """Reads SSE frames until one of `kind`; the instant it arrived."""
    event = None
    while True:
        line = res.readline()
        if not line:
            raise RuntimeError(f"the stream ended before {kind}")
        line = line.rstrip(b"\n")
        if line.startswith(b"event: "):
            event = line[7:].decode()
        elif line == b"" and event == kind:
            return time.perf_counter()


def native():
    t0 = time.perf_counter()
    conn, res = request("POST", "/v1/runs", {"plugin": "echo", "content": "a short answer"})
    run = json.loads(res.read())["run_id"]
    conn.close()
    conn, res = request("GET", f"/v1/runs/{run}/events", sse=True)
    t1 = first_event(res, "content_delta")
    conn.close()
    return t1 - t0


def responses():
    t0 = time.perf_counter()
    conn, res = request("POST", "/v1/responses", {"model": "echo", "input": "a short answer", "stream": True})
    t1 = first_event(res, "response.output_text.delta")
    conn.close()
    return t1 - t0


def responses_two_step():
    """As the native route does it: create (background), then open the stream."""
    t0 = time.perf_counter()
    conn, res = request("POST", "/v1/responses", {"model": "echo", "input": "a short answer", "background": True})
    rid = json.loads(res.read())["id"]
    conn.close()
    conn, res = request("GET", f"/v1/responses/{rid}?stream=true", sse=True)
    t1 = first_event(res, "response.output_text.delta")
    conn.close()
    return t1 - t0


def replay_rate(rid):
    conn, res = request("GET", f"/v1/responses/{rid}?stream=true", sse=True)
    t0, n = time.perf_counter(), 0
    for line in res:
        if line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: "):
            n += 1
    conn.close()
    return n, n / (time.perf_counter() - t0)


def main():
    for f in (native, responses, responses_two_step):  # warm-up
        f()
    a, b, c = [], [], []
    for _ in range(ROUNDS):
        a.append(native())
        b.append(responses())
        c.append(responses_two_step())
    med_a, med_b, med_c = statistics.median(a), statistics.median(b), statistics.median(c)
    print(f"create to first delta, median of {ROUNDS}: native (POST, then GET events) {med_a * 1000:.1f} ms; "
          f"responses stream: true (one request) {med_b * 1000:.1f} ms, ratio {med_b / med_a:.2f}; "
          f"responses background, then GET stream {med_c * 1000:.1f} ms, ratio {med_c / med_a:.2f}")
    rid = os.environ.get("LONG_RESPONSE")
    if rid:
        n, rate = replay_rate(rid)
        print(f"one stream replaying {n} events: {rate:.0f} events/s")


if __name__ == "__main__":
    main()
