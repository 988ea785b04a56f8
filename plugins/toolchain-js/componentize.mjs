// Builds a JavaScript agent into a component of the agent-host:plugin world:
// node componentize.mjs <source.js> <wit dir> <out.wasm>
// (scripts/build-plugin runs it with this directory's pinned toolchain
// installed, naming its node_modules in AGENT_HOST_TOOLCHAIN_JS).
//
// First esbuild bundles the agent with everything it imports into one ES
// module: componentize-js resolves relative imports only, not packages in
// node_modules (`import ... from "agent-plugin"`, the SDK as a package).
// The world's own imports (`agent-host:plugin/...`) stay imports: they are
// the host's, bound by componentize-js.
//
// Then componentize-js makes the module a component. WASI features the host
// does not grant are left out: no outgoing HTTP (`fetch`), no
// incoming-request handler. stdio (to the host's capped logs), clocks and
// random stay: the host provides them (replayed on resume).
import { writeFile, mkdtemp, rm } from "node:fs/promises";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [sourcePath, witPath, out] = process.argv.slice(2);
if (!out) {
  console.error("usage: node componentize.mjs <source.js> <wit dir> <out.wasm>");
  process.exit(2);
}

// The pinned install lives outside the clone: scripts/build-plugin names it.
const modules = process.env.AGENT_HOST_TOOLCHAIN_JS;
if (!modules) {
  console.error("componentize.mjs: AGENT_HOST_TOOLCHAIN_JS names the toolchain's node_modules (scripts/build-plugin sets it)");
  process.exit(2);
}
const esbuild = createRequire(join(modules, "noop.js"))("esbuild");
const { componentize } = await import(
  pathToFileURL(join(modules, "@bytecodealliance/componentize-js/src/componentize.js")).href
);

const scratch = await mkdtemp(join(tmpdir(), "agent-host-bundle-"));
try {
  const bundled = join(scratch, "agent.js");
  await esbuild.build({
    entryPoints: [sourcePath],
    bundle: true,
    format: "esm",
    // No Node, no browser: the engine componentize-js embeds. A package is
    // found by its "exports" (the SDK's), else "module", else "main".
    platform: "neutral",
    mainFields: ["module", "main"],
    external: ["agent-host:*"],
    outfile: bundled,
    logLevel: "error",
  });
  const { component } = await componentize({
    sourcePath: bundled,
    witPath,
    worldName: "agent",
    disableFeatures: ["http", "fetch-event"],
  });
  await writeFile(out, component);
} catch (e) {
  // esbuild has already printed its errors (a missing package, a syntax error).
  if (!e.errors) console.error(e);
  process.exitCode = 1;
} finally {
  await rm(scratch, { recursive: true, force: true });
}
