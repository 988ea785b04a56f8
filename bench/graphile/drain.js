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
// preset, with this process's own CPU over the pass).
//
// Usage: node drain.js <connection-url> <jobs> <concurrency> <passes> <samples> [all|drain|pickup|prepare|defaults|batched]
"use strict";
const { run, makeWorkerUtils } = require("graphile-worker");

const MODES = ["all", "drain", "pickup", "prepare", "defaults", "batched"];
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

// One drain of the prepared jobs: jobs/s, and this process's CPU per job
// (user and system, µs) over the same window.
async function drainPass(preset) {
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
    taskList: { noop: async () => {} },
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
  const presets = {
    defaults: {},
    batched: { preset: { worker: { localQueue: { size: concurrency + 1 }, completeJobBatchDelay: 0, failJobBatchDelay: 0 } } },
  };
  const out = { version: require("./package-lock.json").packages["node_modules/graphile-worker"].version };
  if (modeArg === "prepare") {
    await prepare(utils);
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
