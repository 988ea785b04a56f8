// Builds a JavaScript agent into a component of the agent-host:plugin world:
// node componentize.mjs <source.js> <wit dir> <out.wasm>
// (scripts/build-plugin runs it with the pinned componentize-js installed).
// WASI features the host does not grant are left out: no outgoing HTTP
// (`fetch`), no incoming-request handler. stdio (to the host's capped logs),
// clocks and random stay: the host provides them (replayed on resume).
import { writeFile } from "node:fs/promises";
import { pathToFileURL } from "node:url";

// The pinned install lives outside the clone: scripts/build-plugin names it.
const where = process.env.AGENT_HOST_COMPONENTIZE_JS;
const { componentize } = await import(where ? pathToFileURL(where).href : "@bytecodealliance/componentize-js");

const [sourcePath, witPath, out] = process.argv.slice(2);
if (!out) {
  console.error("usage: node componentize.mjs <source.js> <wit dir> <out.wasm>");
  process.exit(2);
}
const { component } = await componentize({
  sourcePath,
  witPath,
  worldName: "agent",
  disableFeatures: ["http", "fetch-event"],
});
await writeFile(out, component);
