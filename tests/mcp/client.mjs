// The official TypeScript SDK's client (@modelcontextprotocol/sdk, npm)
// against agent-host's MCP server (POST /mcp): run by tests/mcp_server.rs
// with the node_modules scripts/test installs from tests/mcp/package-lock.json
// (AGENT_HOST_TEST_MCP_NODE_MODULES). Prints one line of JSON.
//
//     node client.mjs URL TOKEN   list, call with progress, a task to its result, a task cancelled

import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const modules = process.env.AGENT_HOST_TEST_MCP_NODE_MODULES;
const sdk = (path) => import(pathToFileURL(join(modules, '@modelcontextprotocol/sdk/dist/esm', path)).href);
const { Client } = await sdk('client/index.js');
const { StreamableHTTPClientTransport } = await sdk('client/streamableHttp.js');
const { CallToolResultSchema, CreateTaskResultSchema } = await sdk('types.js');

const [url, token] = process.argv.slice(2);
const transport = new StreamableHTTPClientTransport(new URL(`${url}/mcp`), {
  requestInit: { headers: { Authorization: `Bearer ${token}` } },
});
const client = new Client({ name: 'agent-host-test', version: '1.0.0' });
await client.connect(transport);
const out = { protocol: transport.protocolVersion ?? null };

const { tools } = await client.listTools();
out.tools = tools.map((t) => [t.name, t.execution?.taskSupport ?? null, t.inputSchema.required]);

const text = (result) => result.content.filter((c) => c.type === 'text').map((c) => c.text).join('');
const progress = [];
const counted = await client.callTool(
  { name: 'sleep', arguments: { prompt: 'count', config: { steps: 3, step_ms: 150 } } },
  CallToolResultSchema,
  { onprogress: (p) => progress.push([p.progress, p.message]) },
);
out.progress = { text: text(counted), notes: progress };

// A task to its end: created, polled (tasks/get), its result (tasks/result).
const seen = [];
let taskText = null;
for await (const m of client.experimental.tasks.callToolStream(
  { name: 'sleep', arguments: { prompt: 'nap', config: { steps: 2, step_ms: 100 } } },
  CallToolResultSchema,
  { task: { ttl: 600000 } },
)) {
  if (m.type === 'taskCreated') seen.push(['created', m.task.status]);
  else if (m.type === 'taskStatus') seen.push(['status', m.task.status]);
  else if (m.type === 'result') taskText = text(m.result);
  else if (m.type === 'error') seen.push(['error', String(m.error)]);
}
out.task = { events: seen, text: taskText };

// A long task, cancelled.
const created = await client.request(
  {
    method: 'tools/call',
    params: { name: 'sleep', arguments: { prompt: 'long nap', config: { steps: 100000, step_ms: 50 } }, task: { ttl: 600000 } },
  },
  CreateTaskResultSchema,
);
const id = created.task.taskId;
const cancelled = await client.experimental.tasks.cancelTask(id);
const after = await client.experimental.tasks.getTask(id);
const listed = (await client.experimental.tasks.listTasks()).tasks.map((t) => t.taskId);
out.cancel = { id, answer: cancelled.status, after: after.status, listed: listed.includes(id) };

await client.close();
console.log(JSON.stringify(out));
