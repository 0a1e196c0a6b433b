// The dashboard page: a snapshot of the fleet when it connects, then deltas, over server-sent events
// (/ui/stream). Everything it shows comes from the node (actors/dashboard/view.py folds it); nothing here
// computes a figure. Text goes into the page as text (textContent), never as markup.

const JOURNAL_ROWS = 500;
const RECONNECT_MS = 5000;
const KINDS = ["weights", "kv", "recurrent", "compute", "other"];

const state = { nodes: {}, instances: {}, models: {} };
let source = null;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, String(value));
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

function size(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit === 0 ? value : value.toFixed(1)} ${units[unit]}`;
}

function percent(part, whole) {
  return whole > 0 ? `${Math.max(0, Math.min(100, (100 * part) / whole))}%` : "0%";
}

function clock(seconds) {
  if (typeof seconds !== "number") return "";
  const d = new Date(seconds * 1000);
  return d.toLocaleTimeString(undefined, { hour12: false }) + "." + String(d.getMilliseconds()).padStart(3, "0");
}

// --- nodes and their device bars ---------------------------------------------------------------------------

function deviceBar(node, d) {
  const predicted = d.predicted;
  const stack = el("div", { class: "stack" });
  for (const kind of KINDS) {
    const seg = el("div", { class: `seg ${kind}`, title: `${kind} predicted: ${size(predicted[kind])} (${predicted[kind]} bytes)` });
    seg.style.width = percent(predicted[kind], d.size_bytes);
    stack.append(seg);
  }
  const free = el("div", { class: "available", title: `free for a new reservation: ${size(d.available_bytes)}` });
  free.style.width = percent(d.available_bytes, d.size_bytes);
  const reserved = el("div", { class: "reserved", title: `reserved: ${size(d.reserved_bytes)}` });
  reserved.style.width = percent(d.reserved_bytes, d.size_bytes);
  const observed = el("div", { class: "observed", title: `observed (what the servers allocated): ${size(d.observed_bytes)}` });
  observed.style.left = percent(d.observed_bytes, d.size_bytes);
  const bar = el("div", { class: "bar" }, stack, free, reserved, observed);
  const attrs = {
    class: "device",
    "data-node": node.id,
    "data-device": d.device,
    "data-size": d.size_bytes,
    "data-usable": d.usable_bytes,
    "data-reserved": d.reserved_bytes,
    "data-available": d.available_bytes,
    "data-observed": d.observed_bytes,
  };
  for (const kind of KINDS) attrs[`data-predicted-${kind}`] = predicted[kind];
  const figures = el("div", { class: "figures" });
  const figure = (name, value) => figures.append(el("span", { text: `${name} ` }, el("b", { text: size(value), title: `${value} bytes` })));
  for (const kind of KINDS) figure(kind, predicted[kind]);
  figure("observed", d.observed_bytes);
  figure("reserved", d.reserved_bytes);
  figure("free", d.available_bytes);
  figure("usable", d.usable_bytes);
  figure("size", d.size_bytes);
  return el(
    "div", attrs,
    el("div", { class: "label" }, el("span", { text: `${d.device} · ${d.name}` }),
      el("span", { text: `${size(d.reserved_bytes)} reserved of ${size(d.size_bytes)}` })),
    bar, figures,
  );
}

function renderNodes() {
  const root = document.getElementById("nodes");
  const cards = [];
  for (const id of Object.keys(state.nodes).sort()) {
    const n = state.nodes[id];
    const s = n.settings;
    const settings = s ? `np=${s.slots} ctk=${s.cache_type_k} ctv=${s.cache_type_v} fa=${s.flash_attn} spec=${s.spec_type}` : "serving settings not advertised";
    const l3 = n.l3 ? `L3 ${n.l3.entries} entries, ${size(n.l3.bytes)} of ${size(n.l3.budget_bytes)}` : "L3 –";
    cards.push(el(
      "div", { class: "node", "data-node": id },
      el("h3", { text: id }),
      el("div", { class: "meta", text: `${n.cpus} CPUs · llama-server ${n.llama_server ?? "none"} · ${settings} · ${l3} · ${n.reservations} reservations` }),
      ...n.devices.map((d) => deviceBar(n, d)),
    ));
  }
  root.replaceChildren(...(cards.length ? cards : [el("p", { text: "no live nodes" })]));
}

// --- instances and models ----------------------------------------------------------------------------------

function pair(predicted, observed, kind) {
  const p = predicted[kind];
  const o = observed ? observed[kind] : null;
  return el("td", { class: "num", title: `predicted ${p} bytes; observed ${o ?? "not yet"}`, "data-kind": kind, "data-predicted": p, "data-observed": o },
    `${size(p)} / ${o === null ? "–" : size(o)}`);
}

function emptyRow(columns, text) {
  return el("tr", { class: "empty" }, el("td", { colspan: columns, text }));
}

function renderInstances() {
  const body = document.querySelector("#instances tbody");
  const rows = [];
  for (const id of Object.keys(state.instances).sort()) {
    const i = state.instances[id];
    const s = i.settings;
    rows.push(el(
      "tr", { "data-instance": id, "data-node": i.node },
      el("td", { text: id, title: i.message || null }),
      el("td", { text: i.members.length ? `${i.node} + ${i.members.join(", ")}` : i.node }),
      el("td", { text: i.model, title: i.model_path }),
      el("td", {}, el("span", { class: "state", "data-state": i.state, text: i.state })),
      el("td", { class: "num", text: i.ctx }),
      el("td", { class: "num", text: s.slots }),
      el("td", { text: `${s.cache_type_k}/${s.cache_type_v}` }),
      el("td", { text: s.flash_attn }),
      el("td", { text: s.spec_type === "none" ? "none" : `${s.spec_type} (${s.spec_draft_n_max})` }),
      el("td", { class: "num", text: i.port ?? "–" }),
      el("td", { class: "num", text: i.restarts }),
      ...["weights", "kv", "recurrent", "compute", "total"].map((k) => pair(i.predicted, i.observed, k)),
    ));
  }
  body.replaceChildren(...(rows.length ? rows : [emptyRow(16, "no instances")]));
}

function renderModels() {
  const body = document.querySelector("#models tbody");
  const rows = [];
  for (const id of Object.keys(state.models).sort()) {
    const m = state.models[id];
    rows.push(el(
      "tr", { "data-model": m.name, "data-frontdoor": m.frontdoor },
      el("td", { text: m.frontdoor }),
      el("td", { text: m.name, title: m.path }),
      el("td", {}, el("span", { class: "state", "data-state": m.state, text: m.state })),
      el("td", { class: "num", text: m.max_queue === null ? m.queued : `${m.queued} / ${m.max_queue}` }),
      el("td", { class: "num", text: m.active }),
      el("td", { text: m.instances.join(", ") || "–" }),
      el("td", { class: "num", text: size(m.held_bytes) }),
      el("td", { class: "num", text: m.ctx ?? "–" }),
      el("td", { text: m.pinned ? "yes" : "no" }),
      el("td", { class: "num", text: m.priority }),
      el("td", { class: "num", text: m.idle_ttl_s === null ? "–" : `${m.idle_ttl_s} s` }),
    ));
  }
  body.replaceChildren(...(rows.length ? rows : [emptyRow(11, "no catalog models")]));
}

// --- the journal and a decision's detail -------------------------------------------------------------------

function journalRow(e, fresh) {
  const row = el(
    "tr", {
      "data-event": e.id, "data-type": e.type, title: e.trace ? `trace ${e.trace.split("-")[1] ?? e.trace}` : null,
      class: [e.decision ? "decision" : "", fresh ? "fresh" : ""].join(" ").trim() || null,
    },
    el("td", { text: clock(e.time) }),
    el("td", { text: e.node }),
    el("td", { text: e.actor }),
    el("td", { class: "type", text: e.type }),
    el("td", { class: "summary", text: e.summary }),
  );
  if (e.decision) row.addEventListener("click", () => showDecision(e.id));
  return row;
}

function addEvents(events, fresh) {
  const body = document.querySelector("#journal tbody");
  for (const e of events) body.prepend(journalRow(e, fresh));
  while (body.rows.length > JOURNAL_ROWS) body.deleteRow(body.rows.length - 1);
}

function json(value) {
  return el("pre", { text: JSON.stringify(value, null, 2) });
}

function section(title, value, open = false) {
  const details = el("details", open ? { open: "" } : {}, el("summary", { text: title }), json(value));
  return details;
}

async function showDecision(id) {
  const panel = document.getElementById("detail");
  const body = document.getElementById("detail-body");
  panel.hidden = false;
  body.replaceChildren(el("p", { text: "loading…" }));
  let detail;
  try {
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(), 15000);
    const reply = await fetch(`/ui/events/${encodeURIComponent(id)}`, { signal: controller.signal, credentials: "same-origin" });
    clearTimeout(timer);
    if (!reply.ok) {
      body.replaceChildren(el("p", { text: `not available (${reply.status})` }));
      return;
    }
    detail = await reply.json();
  } catch (err) {
    body.replaceChildren(el("p", { text: `not available (${err})` }));
    return;
  }
  const replay = detail.replay || {};
  let verdict;
  if (replay.error) verdict = el("p", { class: "replay", text: `replay: ${replay.error}` });
  else if (replay.same) verdict = el("p", { class: "replay same", text: "replay: today's core decides the same" });
  else {
    verdict = el("div", { class: "replay differs" }, el("p", { text: "replay: today's core decides differently" }),
      el("ul", {}, ...(replay.differences || []).map((d) => el("li", { text: `${d.path}: ${JSON.stringify(d.recorded)} → ${JSON.stringify(d.now)}` }))));
  }
  body.replaceChildren(
    el("p", { text: `${detail.kind} decision ${detail.event.id} on ${detail.event.node} at ${clock(detail.event.time)}` }),
    verdict,
    section("decision", detail.decision, true),
    section("inputs", detail.inputs),
    ...(detail.record ? [section("side record", detail.record)] : []),
    ...(replay.now ? [section("decided now", replay.now)] : []),
  );
}

// --- the stream --------------------------------------------------------------------------------------------

function counts() {
  const n = Object.keys(state.nodes).length;
  const i = Object.keys(state.instances).length;
  const m = Object.keys(state.models).length;
  document.getElementById("counts").textContent = `${n} nodes · ${i} instances · ${m} catalog models`;
}

function setConnection(text, value) {
  const status = document.getElementById("connection");
  status.textContent = text;
  status.dataset.state = value;
}

function onSnapshot(message) {
  const snapshot = JSON.parse(message.data);
  state.nodes = snapshot.nodes;
  state.instances = snapshot.instances;
  state.models = snapshot.models;
  document.querySelector("#journal tbody").replaceChildren();
  addEvents(snapshot.journal, false);
  renderNodes();
  renderInstances();
  renderModels();
  counts();
  setConnection("live", "live");
}

function onDelta(message) {
  const deltas = JSON.parse(message.data);
  const changed = new Set();
  const events = [];
  for (const d of deltas) {
    if (d.op === "event") {
      events.push(d.value);
      continue;
    }
    const table = { node: state.nodes, instance: state.instances, model: state.models }[d.op];
    if (!table) continue;
    if (d.value === null) delete table[d.id];
    else table[d.id] = d.value;
    changed.add(d.op);
  }
  if (events.length) addEvents(events, true);
  if (changed.has("node")) renderNodes();
  if (changed.has("instance")) renderInstances();
  if (changed.has("model")) renderModels();
  counts();
}

function connect() {
  source = new EventSource("/ui/stream");
  source.addEventListener("snapshot", onSnapshot);
  source.addEventListener("delta", onDelta);
  source.addEventListener("error", () => {
    if (source.readyState === EventSource.CLOSED) {
      // refused (the session ended, too many pages) or the node went: try again a little later
      setConnection("lost: retrying", "lost");
      setTimeout(connect, RECONNECT_MS);
    } else {
      setConnection("reconnecting…", "connecting");
    }
  });
}

document.getElementById("detail-close").addEventListener("click", () => {
  document.getElementById("detail").hidden = true;
});
connect();
