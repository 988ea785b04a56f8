// graphile-worker's side of agent-host-bench's drain comparison: the same
// shape as the host's figure (N pre-enqueued no-op jobs, C in flight, jobs/s
// from the worker's start to its last success), with its defaults and with
// its batching (local queue, batched completions), then pickup latency
// (addJob resolved to task start, and from its call, idle worker). Prints
// one JSON line.
// `mode` picks what is measured: `all` (the default: every drain pass, then
// pickup), `drain` (the drain passes only), `pickup`, or one step of a drain that agent-host-bench measures
// from outside (the server's CPU, WAL and commits around the step):
// `prepare` (empty the queue, enqueue N jobs, VACUUM ANALYZE), then
// `defaults` or `batched` (one drain pass of the prepared jobs with that
// preset, with this process's own CPU over the pass); or `prepare-equal`
// then `equal` for the equal-work preset.
//
// The equal-work preset (issue 43): its batching, and a task that writes
// what a drained no-op run of agent-host writes, into tables shaped like
// the host's `message` and `run_event` (same columns, keys, checks and
// indexes as its migrations leave them, foreign keys dropped as its 0014
// drops them) in a schema of their own, `bench_work`: the user message's
// status, one assistant message and three journal events, in one
// transaction (BEGIN, one statement, COMMIT on the task's own pg client).
// `prepare-equal` seeds one queued user message per job and enqueues the
// jobs with its ids. The job's own completion is graphile-worker's commit,
// apart from the task's (as it is for any task that writes).
//
// Usage: node drain.js <connection-url> <jobs> <concurrency> <passes> <samples> [all|drain|pickup|prepare|defaults|batched|prepare-equal|equal]
"use strict";
const { run, makeWorkerUtils } = require("graphile-worker");
const { randomUUID } = require("crypto");

const MODES = ["all", "drain", "pickup", "prepare", "defaults", "batched", "prepare-equal", "equal"];
const [url, jobsArg, concArg, passesArg, samplesArg, modeArg = "all"] = process.argv.slice(2);
const jobs = Number(jobsArg);
const concurrency = Number(concArg);
const passes = Number(passesArg);
const samples = Number(samplesArg);
if (!url || !(jobs > 0 && concurrency > 0 && passes > 0 && samples > 0) || !MODES.includes(modeArg)) {
  console.error(`usage: node drain.js <connection-url> <jobs> <concurrency> <passes> <samples> [${MODES.join("|")}]`);
  process.exit(2);
}
// Bound on one drain pass or one pickup.
const PASS_MAX_MS = 600_000;
const ENQUEUE_CHUNK = 5_000;
const WARMUP = 20;

// Errors only: the per-job lines would drown the figures.
const logFactory = () => (level, message) => {
  if (level === "error") console.error(message);
};
const { Logger } = require("graphile-worker");
const logger = new Logger(logFactory);

const median = (v) => {
  const s = [...v].sort((a, b) => a - b);
  const n = s.length;
  return n % 2 ? s[(n - 1) / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
};
const pct = (v, p) => {
  const s = [...v].sort((a, b) => a - b);
  return s[Math.min(s.length, Math.max(1, Math.ceil(p * s.length))) - 1];
};

async function reset(utils) {
  await utils.withPgClient((c) => c.query("DELETE FROM graphile_worker._private_jobs"));
}

async function enqueue(utils, n) {
  for (let left = n; left > 0; left -= ENQUEUE_CHUNK) {
    const k = Math.min(left, ENQUEUE_CHUNK);
    await utils.addJobs(Array.from({ length: k }, () => ({ identifier: "noop", payload: {} })));
  }
  await utils.withPgClient((c) => c.query("VACUUM ANALYZE graphile_worker._private_jobs"));
}

function within(promise, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} took over ${PASS_MAX_MS} ms`)), PASS_MAX_MS);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

async function prepare(utils) {
  await reset(utils);
  await enqueue(utils, jobs);
}

// The host's `message` and `run_event` as its migrations leave them
// (0001_run_core, 0005_durable's `op`, 0014's dropped foreign keys).
const WORK_SCHEMA = `
CREATE SCHEMA IF NOT EXISTS bench_work;
CREATE TABLE IF NOT EXISTS bench_work.message (
    id              uuid PRIMARY KEY,
    conversation_id uuid NOT NULL,
    run_id          uuid,
    role            text NOT NULL CHECK (role IN ('user', 'assistant')),
    content         text NOT NULL,
    status          text NOT NULL CHECK (status IN ('queued', 'complete', 'draft', 'partial')),
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS message_conversation ON bench_work.message (conversation_id, created_at);
CREATE TABLE IF NOT EXISTS bench_work.run_event (
    run_id      uuid NOT NULL,
    seq         integer NOT NULL CHECK (seq >= 1),
    type        text NOT NULL,
    payload     jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    op          bigint,
    PRIMARY KEY (run_id, seq)
);
CREATE UNIQUE INDEX IF NOT EXISTS run_event_one_complete ON bench_work.run_event (run_id) WHERE type = 'complete';
`;

// What a drained no-op run writes, in one statement: its user message
// complete, its (empty) answer in the transcript, three journal events.
const WORK_SQL = `
WITH umsg AS (
    UPDATE bench_work.message SET status = 'complete' WHERE id = $1::uuid
),
amsg AS (
    INSERT INTO bench_work.message (id, conversation_id, run_id, role, content, status)
    VALUES ($5::uuid, $2::uuid, $3::uuid, 'assistant', '', 'complete')
)
INSERT INTO bench_work.run_event (run_id, seq, type, payload)
VALUES ($3::uuid, 1, 'run_started', jsonb_build_object('worker_id', $4::text)),
       ($3::uuid, 2, 'message', jsonb_build_object('content', '')),
       ($3::uuid, 3, 'complete', jsonb_build_object('status', 'completed'))`;

async function workTask(payload, helpers) {
  await helpers.withPgClient(async (c) => {
    await c.query("BEGIN");
    try {
      await c.query(WORK_SQL, [payload.m, payload.c, payload.r, "graphile", randomUUID()]);
      await c.query("COMMIT");
    } catch (e) {
      await c.query("ROLLBACK");
      throw e;
    }
  });
}

// Empty the queue and the work tables, seed one queued user message per
// job (its own conversation, as a drained run's first turn), enqueue one
// `work` job per message carrying its ids.
async function prepareEqual(utils) {
  await reset(utils);
  await utils.withPgClient(async (c) => {
    await c.query(WORK_SCHEMA);
    await c.query("TRUNCATE bench_work.message, bench_work.run_event");
    await c.query(
      `INSERT INTO bench_work.message (id, conversation_id, role, content, status)
       SELECT gen_random_uuid(), gen_random_uuid(), 'user', 'bench', 'queued' FROM generate_series(1, $1)`,
      [jobs],
    );
  });
  const { rows } = await utils.withPgClient((c) =>
    c.query("SELECT id, conversation_id FROM bench_work.message ORDER BY id"),
  );
  for (let at = 0; at < rows.length; at += ENQUEUE_CHUNK) {
    const chunk = rows.slice(at, at + ENQUEUE_CHUNK);
    await utils.addJobs(
      chunk.map((m) => ({ identifier: "work", payload: { m: m.id, c: m.conversation_id, r: randomUUID() } })),
    );
  }
  await utils.withPgClient(async (c) => {
    await c.query("VACUUM ANALYZE graphile_worker._private_jobs");
    await c.query("VACUUM ANALYZE bench_work.message");
    await c.query("VACUUM ANALYZE bench_work.run_event");
  });
}

// One drain of the prepared jobs: jobs/s, and this process's CPU per job
// (user and system, µs) over the same window.
async function drainPass({ taskList = { noop: async () => {} }, ...preset }) {
  let done = 0;
  let finish;
  const finished = new Promise((resolve) => (finish = resolve));
  const cpu0 = process.cpuUsage();
  const t0 = process.hrtime.bigint();
  const runner = await run({
    connectionString: url,
    concurrency,
    noHandleSignals: true,
    logger,
    taskList,
    ...preset,
  });
  runner.events.on("job:success", () => {
    done += 1;
    if (done === jobs) finish(process.hrtime.bigint());
  });
  const t1 = await within(finished, "a drain pass");
  const cpu = process.cpuUsage(cpu0);
  await runner.stop();
  return { rate: jobs / (Number(t1 - t0) / 1e9), cpu_us_per_job: (cpu.user + cpu.system) / jobs };
}

async function pickup(utils) {
  await reset(utils);
  let started;
  const runner = await run({
    connectionString: url,
    concurrency,
    noHandleSignals: true,
    logger,
    taskList: { pickup: async () => started(process.hrtime.bigint()) },
  });
  const out = [];
  const fromCall = [];
  for (let i = 0; i < samples + WARMUP; i++) {
    const begun = new Promise((resolve) => (started = resolve));
    const called = process.hrtime.bigint();
    await utils.addJob("pickup", {});
    const committed = process.hrtime.bigint();
    const t = await within(begun, "a pickup");
    if (i >= WARMUP) {
      out.push(Number(t - committed) / 1e6);
      fromCall.push(Number(t - called) / 1e6);
    }
  }
  await runner.stop();
  return { p50_ms: pct(out, 0.5), p99_ms: pct(out, 0.99), from_call_p50_ms: pct(fromCall, 0.5) };
}

async function main() {
  const utils = await makeWorkerUtils({ connectionString: url, logger });
  await utils.migrate();
  const batching = { worker: { localQueue: { size: concurrency + 1 }, completeJobBatchDelay: 0, failJobBatchDelay: 0 } };
  const presets = {
    defaults: {},
    batched: { preset: batching },
  };
  // Not in `all`/`drain`: agent-host-bench runs it step by step.
  const equal = { preset: batching, taskList: { work: workTask } };
  const out = { version: require("./package-lock.json").packages["node_modules/graphile-worker"].version };
  if (modeArg === "prepare") {
    await prepare(utils);
  } else if (modeArg === "prepare-equal") {
    await prepareEqual(utils);
  } else if (modeArg === "equal") {
    out.pass = await drainPass(equal);
    const { rows } = await utils.withPgClient((c) =>
      c.query(`SELECT (SELECT count(*) FROM bench_work.message WHERE role = 'assistant')::int AS answers,
                      (SELECT count(*) FROM bench_work.message WHERE role = 'user' AND status = 'queued')::int AS queued,
                      (SELECT count(*) FROM bench_work.run_event)::int AS events`),
    );
    const w = rows[0];
    if (w.answers !== jobs || w.queued !== 0 || w.events !== 3 * jobs) {
      throw new Error(`the equal-work pass wrote ${JSON.stringify(w)} for ${jobs} jobs`);
    }
    out.pass.written = w;
  } else if (modeArg in presets) {
    out.pass = await drainPass(presets[modeArg]);
  } else if (modeArg === "all" || modeArg === "drain") {
    const rates = { defaults: [], batched: [] };
    for (let pass = 0; pass < passes; pass++) {
      for (const name of Object.keys(presets)) {
        await prepare(utils);
        rates[name].push((await drainPass(presets[name])).rate);
      }
    }
    out.defaults = { median: median(rates.defaults), passes: rates.defaults };
    out.batched = { median: median(rates.batched), passes: rates.batched };
  }
  if (modeArg === "all" || modeArg === "pickup") out.pickup = await pickup(utils);
  await utils.release();
  console.log(JSON.stringify(out));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
