"use strict";
// State lives in localStorage (the token) and the URL hash (conversation and
// run), so a refresh or a host restart picks up where it was. A run's stream
// is the browser's own EventSource on a stream ticket (never the token): it
// replays the journal from seq 1 and, when the connection drops, rejoins with
// Last-Event-ID by itself. Served under a Content-Security-Policy that runs
// this file and no inline script.
const $ = (id) => document.getElementById(id);
const KINDS = ["user_message_created", "run_queued", "run_started", "run_resumed", "content_delta",
               "content_rollback", "tool_call_started", "tool_call_finished", "approval_requested",
               "approval_decided", "wait_started", "wait_elapsed", "steer_received", "steer_taken", "agent_started",
               "agent_finished", "agents_joined", "step",
               "complete"];
let token = localStorage.getItem("agent-host-token") || "";
let source = null, ticker = null;
const run = { id: null, text: "", events: 0, lastSeq: 0, started: null, lastAt: null, pending: null };

// Ids come from the URL, which anyone can link to: only a UUID is taken;
// anything else is set aside (`bad`) and said, never put in a request path.
const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
function hashState() {
  const p = new URLSearchParams(location.hash.slice(1));
  const bad = [p.get("c"), p.get("r")].filter((v) => v !== null && !UUID.test(v));
  const id = (v) => (v !== null && UUID.test(v) ? v : null);
  return { c: id(p.get("c")), r: id(p.get("r")), bad };
}

// A request path with every value encoded as one path segment: an id can
// never climb to another route (`../tokens/...`) or start a query.
function path(strings, ...values) {
  return strings.reduce((out, s, i) => out + s + (i < values.length ? encodeURIComponent(String(values[i])) : ""), "");
}
function setHash(c, r) {
  const p = new URLSearchParams();
  if (c) p.set("c", c);
  if (r) p.set("r", r);
  history.replaceState(null, "", "#" + p.toString());
}

async function api(method, path, body) {
  const res = await fetch(path, {
    method,
    headers: Object.assign({ Authorization: "Bearer " + token }, body ? { "Content-Type": "application/json" } : {}),
    body: body ? JSON.stringify(body) : undefined,
  });
  const data = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error((data.error && data.error.message) || res.statusText);
  return data;
}

// A list route's items, following next_cursor for at most `pagesMax` pages.
async function listAll(path, field, pagesMax) {
  const items = [];
  let after = null;
  for (let i = 0; i < pagesMax; i++) {
    const page = await api("GET", after ? `${path}?after=${encodeURIComponent(after)}` : path);
    items.push(...page[field]);
    if (!page.next_cursor) break;
    after = page.next_cursor;
  }
  return items;
}

// The plugins the caller may run, by name (from sign-in).
let pluginsByName = new Map();

function grantedTools(p) {
  return (p.manifest && Array.isArray(p.manifest.tools)) ? p.manifest.tools : [];
}

// One picker line: name, language, short digest, granted tools.
function pluginLabel(p) {
  if (p.builtin) return `${p.name} · built-in`;
  const tools = grantedTools(p);
  return `${p.name} · ${p.language} · ${p.digest.slice(7, 19)} · tools: ${tools.length ? tools.join(", ") : "none"}`;
}

// The picked plugin in full, under the picker.
function showPluginInfo() {
  const p = pluginsByName.get($("plugin").value);
  const info = $("plugin-info");
  if (!p) { info.textContent = ""; return; }
  if (p.builtin) { info.textContent = "A built-in agent (runs in the host, not sandboxed)."; return; }
  const code = (text) => { const c = document.createElement("code"); c.textContent = text; return c; };
  const tools = grantedTools(p);
  info.replaceChildren(
    `Language: ${p.language} · digest `, code(p.digest),
    ` · granted tools: ${tools.length ? tools.join(", ") : "none"}`,
  );
}
$("plugin").addEventListener("change", showPluginInfo);

async function signIn() {
  token = $("token").value.trim() || token;
  try {
    const plugins = await listAll("/v1/plugins", "plugins", 20);
    localStorage.setItem("agent-host-token", token);
    pluginsByName = new Map(plugins.map((p) => [p.name, p]));
    $("plugin").replaceChildren(...plugins.map((p) => new Option(pluginLabel(p), p.name)));
    const first = ["chat", "echo"].find((n) => pluginsByName.has(n));
    if (first) $("plugin").value = first;
    showPluginInfo();
    $("signin").hidden = true;
    $("app").hidden = false;
    $("who").textContent = "signed in";
    await showState();
    // Live statuses in the list, whatever run is on screen.
    setInterval(() => loadConversations().catch(() => {}), 3000);
  } catch (e) {
    $("signin-error").textContent = "Sign-in failed: " + e.message;
  }
}

async function loadConversations() {
  // Refreshed every few seconds: the newest 500 are enough for a sidebar.
  const conversations = await listAll("/v1/conversations", "conversations", 5);
  const current = hashState().c;
  $("conversations").replaceChildren(...conversations.map((c) => {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    li.className = c.id === current ? "current" : "";
    li.textContent = (c.title || "(empty)") + " ";
    if (c.latest_status) {
      const s = document.createElement("span");
      s.className = "status " + c.latest_status;
      s.textContent = c.latest_status;
      li.append(s);
    }
    li.onclick = () => { setHash(c.id, null); showState(); };
    return li;
  }));
}

// The caller's schedules: cron, plugin, next firing; pause or resume each.
async function loadSchedules() {
  const list = await listAll("/v1/schedules", "schedules", 5);
  $("schedules").replaceChildren(...list.map((s) => {
    const li = document.createElement("li");
    li.className = "schedule";
    li.dataset.id = s.id;
    const next = s.paused ? "paused" : "next " + new Date(s.next_fire_at).toLocaleTimeString();
    li.textContent = `${s.cron} · ${s.plugin} · ${next} `;
    const b = document.createElement("button");
    b.textContent = s.paused ? "Resume" : "Pause";
    b.onclick = async (e) => {
      e.stopPropagation();
      await api("POST", path`/v1/schedules/${s.id}/${s.paused ? "resume" : "pause"}`);
      loadSchedules();
    };
    li.append(b);
    return li;
  }));
}

// Model usage by user, day and model, for admins (GET /v1/usage answers
// others 403, and the panel stays hidden).
async function loadUsage() {
  let rows;
  try {
    rows = (await api("GET", "/v1/usage?by=user&days=31")).usage;
  } catch (e) {
    $("usage-panel").hidden = true;
    return;
  }
  $("usage-panel").hidden = false;
  $("usage").replaceChildren(...rows.slice(0, 50).map((u) => {
    const li = document.createElement("li");
    li.className = "usage";
    li.textContent = `${u.day} · ${u.user_id || "?"} · ${u.provider}/${u.model} · ${u.calls} calls, ` +
      `${u.prompt_tokens}+${u.completion_tokens} tokens` + (u.cost_usd ? ` · $${u.cost_usd.toFixed(4)}` : "");
    return li;
  }));
}

// A conversation's model usage over its ended turns.
function usageLine(u) {
  if (!u || !u.model_calls) return "";
  const calls = u.model_calls === 1 ? "1 model call" : `${u.model_calls} model calls`;
  return `${calls} · ${u.prompt_tokens}+${u.completion_tokens} tokens` +
    (u.cost_usd ? ` · $${u.cost_usd.toFixed(4)}` : "");
}

async function loadTranscript(conversation) {
  if (!conversation) {
    $("transcript").replaceChildren();
    $("conversation-title").textContent = "New conversation";
    $("conversation-usage").textContent = "";
    return null;
  }
  const [messages, view] = await Promise.all([
    listAll(path`/v1/conversations/${conversation}/messages`, "messages", 50),
    api("GET", path`/v1/conversations/${conversation}`),
  ]);
  $("conversation-title").textContent = "Conversation " + conversation.slice(0, 8);
  $("conversation-usage").textContent = usageLine(view.usage);
  $("transcript").replaceChildren(...messages.map((m) => {
    const div = document.createElement("div");
    div.className = "msg " + m.role;
    div.dataset.run = m.run_id || "";
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = `${m.role} · ${m.status}` + (m.run_id ? ` · run ${m.run_id.slice(0, 8)} (open)` : "");
    if (m.run_id) {
      div.style.cursor = "pointer";
      div.title = "Show this run's stream, timeline and timings";
      div.onclick = () => { setHash(conversation, m.run_id); watch(m.run_id); };
    }
    const body = document.createElement("div");
    body.className = "content";
    body.textContent = m.content;
    div.append(meta, body);
    return div;
  }));
  return view;
}

async function showState() {
  const { c, r, bad } = hashState();
  if (bad.length) {
    $("run").hidden = false;
    $("run-error").textContent = "This link's id is not a run or conversation id; it was ignored.";
  }
  await loadConversations();
  loadSchedules().catch(() => {});
  loadUsage();
  const view = await loadTranscript(c);
  const target = r || (view && view.active_run_id);
  if (target) watch(target); else if (!r && !bad.length) $("run").hidden = true;
}

function renderRun() {
  $("output").textContent = run.text;
  const secs = run.started ? ((Date.now() - run.started) / 1000).toFixed(1) : "0.0";
  const idle = run.lastAt ? ((Date.now() - run.lastAt) / 1000).toFixed(1) : "-";
  $("progress").textContent = `${run.text.length} characters · ${run.events} events · seq ${run.lastSeq} · ` +
    `${secs} s watching · last event ${idle} s ago`;
}

function setStatus(status) {
  $("run-status").textContent = status;
  $("run-status").className = "status " + status;
  const ended = ["completed", "failed", "cancelled"].includes(status);
  $("stop").disabled = ended;
  $("steer").disabled = ended;
  $("steer-row").hidden = ended;
  $("fork-row").hidden = !ended;
}

async function showTimings(id) {
  try {
    const v = await api("GET", path`/v1/runs/${id}`);
    setStatus(v.status);
    const t = (x) => (x ? new Date(x).toLocaleTimeString() : "-");
    const took = v.started_at && v.finished_at ? ` · ran ${((new Date(v.finished_at) - new Date(v.started_at)) / 1000).toFixed(2)} s` : "";
    const usage = v.usage ? ` · ${v.usage.model_calls} model calls, ${v.usage.prompt_tokens}+${v.usage.completion_tokens} tokens` : "";
    $("timings").textContent = `created ${t(v.created_at)} · started ${t(v.started_at)} · finished ${t(v.finished_at)}${took}${usage}`;
    if (v.error) $("run-error").textContent = v.error;
    showApproval(v.pending_approval);
    showTree(v);
  } catch (e) { $("run-error").textContent = e.message; }
}

// A run's place in its tree (sub-agents): its parent, and its children with
// their statuses, each a link that watches that run.
function showTree(v) {
  const items = [];
  const link = (label, id) => {
    const li = document.createElement("li");
    const b = document.createElement("button");
    b.className = "link";
    b.textContent = label;
    b.onclick = () => { setHash(null, id); watch(id); };
    li.append(b);
    items.push(li);
  };
  if (v.parent_run_id) link(`↑ parent ${v.parent_run_id}`, v.parent_run_id);
  for (const c of v.children || []) link(`↳ ${c.plugin} ${c.run_id} · ${c.status}`, c.run_id);
  $("tree").replaceChildren(...items);
  $("tree").hidden = items.length === 0;
}

// A waiting run's pending call, with its arguments, to approve or reject.
function showApproval(pending) {
  run.pending = pending || null;
  $("approval").hidden = !pending;
  $("approval-error").textContent = "";
  if (!pending) return;
  $("approval-call").textContent = pending.call_id;
  $("approval-tool").textContent = pending.tool;
  $("approval-args").textContent = JSON.stringify(pending.args, null, 2);
}

async function decide(decision) {
  if (!run.pending) return;
  const body = { decision };
  const reason = $("approval-reason").value.trim();
  if (decision === "reject" && reason) body.reason = reason;
  try {
    await api("POST", path`/v1/runs/${run.id}/approvals/${run.pending.call_id}`, body);
    showApproval(null);
  } catch (e) { $("approval-error").textContent = e.message; }
}

function watch(id) {
  if ((source || run.opening) && run.id === id) return;
  if (source) source.close();
  source = null;
  Object.assign(run, { id, text: "", events: 0, lastSeq: 0, started: Date.now(), lastAt: null, pending: null });
  // The previous run's text must not linger on the page as this one's.
  renderRun();
  showApproval(null);
  $("run").hidden = false;
  $("run-id").textContent = id;
  $("run-error").textContent = "";
  $("steer-info").textContent = "";
  $("timeline").replaceChildren();
  setStatus("…");
  showTimings(id);
  openStream(id);
  clearInterval(ticker);
  ticker = setInterval(renderRun, 500);
}

// The stream's URL holds no token: a short-lived ticket for this run alone,
// minted with the token (sent in a header). EventSource rejoins by itself
// while the ticket lasts; once the host refuses it (expired), the stream is
// closed and a new ticket reopens it from the last seq seen.
async function openStream(id) {
  let ticket;
  run.opening = true;
  try {
    ticket = await api("POST", path`/v1/runs/${id}/stream-ticket`);
  } catch (e) { $("run-error").textContent = e.message; return; } finally { run.opening = false; }
  if (run.id !== id) return;
  if (source) source.close();
  const es = new EventSource(path`/v1/runs/${id}/events` + `?from=${Number(run.lastSeq)}&ticket=${encodeURIComponent(ticket.ticket)}`);
  source = es;
  for (const kind of KINDS) es.addEventListener(kind, (e) => onEvent(kind, JSON.parse(e.data)));
  es.onerror = () => {
    if (es.readyState === EventSource.CLOSED && source === es && run.id === id) {
      setTimeout(() => { if (source === es) openStream(id); }, 1000);
    }
  };
}

function onEvent(kind, data) {
  if (data.seq <= run.lastSeq) return; // never twice, whatever the network does
  run.lastSeq = data.seq;
  run.events += 1;
  run.lastAt = Date.now();
  const li = document.createElement("li");
  const extra = kind === "content_delta" ? `${data.delta.length} chars`
    : kind === "complete" ? data.status + (data.error ? ": " + data.error : "")
    : kind.startsWith("tool_call") ? `${data.name} #${data.call_index}${data.outcome ? " " + data.outcome : ""}`
    : kind === "run_resumed" ? `attempt ${data.attempt} on ${data.worker_id}, ${data.replayed_calls} calls replayed`
    : kind === "content_rollback" ? `text cut to ${data.keep_chars} chars`
    : kind === "approval_requested" ? `${data.tool} #${data.call_id} waits for approval`
    : kind === "approval_decided" ? `#${data.call_id} ${data.decision}${data.reason ? ": " + data.reason : ""}`
    : kind === "wait_started" ? `until ${new Date(data.until).toLocaleTimeString()}`
    : kind === "steer_received" ? `"${data.content}"`
    : kind === "steer_taken" ? `${data.instructions.length} taken at call ${data.position}`
    : kind === "agent_started" ? `${data.plugin} ${data.run_id}`
    : kind === "agent_finished" ? `${data.plugin} ${data.run_id} ${data.status}`
    : "";
  li.textContent = `${data.seq} ${kind} ${extra} · ${new Date().toLocaleTimeString()}`;
  $("timeline").append(li);
  if (kind === "content_delta") run.text += data.delta;
  // A model call in flight when the run lost its worker is asked again:
  // what it had streamed is withdrawn (counted in Unicode scalar values).
  if (kind === "content_rollback") run.text = Array.from(run.text).slice(0, data.keep_chars).join("");
  if (kind === "run_started" || kind === "run_resumed") setStatus("running");
  if (kind === "run_queued" || kind === "approval_decided" || kind === "wait_elapsed" || kind === "agents_joined") setStatus("queued");
  if (kind === "agent_started" || kind === "agent_finished") showTimings(run.id);
  if (kind === "approval_requested") {
    setStatus("waiting");
    showApproval({ call_id: data.call_id, tool: data.tool, args: data.args });
  }
  if (kind === "wait_started") setStatus("waiting");
  if (kind === "approval_decided") showApproval(null);
  if (kind === "complete") {
    setStatus(data.status);
    if (data.error) $("run-error").textContent = data.error;
    if (source) source.close();
    source = null;
    clearInterval(ticker);
    showTimings(run.id);
    loadConversations();
    loadTranscript(hashState().c);
    loadUsage();
  }
  renderRun();
}

$("composer").addEventListener("submit", async (e) => {
  e.preventDefault();
  $("composer-error").textContent = "";
  const body = { content: $("message").value, plugin: $("plugin").value };
  if ($("config").value.trim()) {
    try { body.config = JSON.parse($("config").value); }
    catch (err) { $("composer-error").textContent = "config is not JSON: " + err.message; return; }
  }
  const c = hashState().c;
  if (c) body.conversation_id = c;
  try {
    const r = await api("POST", "/v1/runs", body);
    $("message").value = "";
    setHash(r.conversation_id, r.run_id);
    await loadConversations();
    await loadTranscript(r.conversation_id);
    watch(r.run_id);
  } catch (err) { $("composer-error").textContent = err.message; }
});
$("stop").onclick = async () => {
  try { await api("POST", path`/v1/runs/${run.id}/cancel`); } catch (e) { $("run-error").textContent = e.message; }
};
// Steering: an instruction for the running turn, which its agent takes at
// its next step (the timeline shows steer_received, then steer_taken).
$("steer").onclick = async () => {
  const content = $("steer-text").value;
  try {
    const s = await api("POST", path`/v1/runs/${run.id}/steer`, { content });
    $("steer-text").value = "";
    $("steer-info").textContent = `instruction ${s.id} queued`;
  } catch (e) { $("steer-info").textContent = e.message; }
};
// A fork: this turn again in a new conversation, with another message (from
// the start) or from a tool call on (the calls before it replayed).
$("fork").onclick = async () => {
  const at = $("fork-at").value.trim();
  const body = at ? { after_tool_call: Number(at) } : { after_call: 0, content: $("fork-content").value };
  try {
    const r = await api("POST", path`/v1/runs/${run.id}/fork`, body);
    $("fork-content").value = "";
    $("fork-at").value = "";
    setHash(r.conversation_id, r.run_id);
    await loadConversations();
    await loadTranscript(r.conversation_id);
    watch(r.run_id);
  } catch (e) { $("steer-info").textContent = e.message; }
};
$("approve").onclick = () => decide("approve");
$("reject").onclick = () => decide("reject");
$("new-conversation").onclick = () => { setHash(null, null); showState(); };
$("signin-button").onclick = signIn;
$("signout").onclick = () => { localStorage.removeItem("agent-host-token"); location.hash = ""; location.reload(); };
if (token) signIn();
