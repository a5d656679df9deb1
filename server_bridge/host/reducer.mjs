// The snapshot reducer in plain JavaScript: an ES module with no dependencies and no build
// step, for the dashboard. It folds a run's events by the rules of
// server_bridge/host/reducer.py (its module docstring says them; read it first) and
// `snapshotJson` writes what server_bridge/http/views.py `snapshot_json` writes: the
// same JSON, byte for byte once canonical (sorted keys), for every stream in
// tests/fixtures/streams/ (tests/test_reducer_fixtures.py holds both to them).
//
//   import { Reducer, snapshotJson, windowRows } from "./reducer.mjs";
//   const reducer = new Reducer("thermo1");
//   const snap = reducer.apply(JSON.parse(frame.data));  // an SSE `data:` line
//   render(snapshotJson(snap));
//
// An event is what the bridge forwards, as JSON: `{r, i, t, ts, n?, a?, k?, d}`. An
// envelope the Python reducer refuses (server_bridge/wire.py check_envelope, any type
// accepted) throws BadEnvelope here. Strings are measured and cut in code points, as
// Python does. One difference is JSON's, not this module's: JSON has one kind of
// number, so an integral float (`2.0`) reads here as the int Python would refuse; the
// bridge's events carry ints where the contract says int.

// The contract's bounds and the reducer's, the same numbers as reducer.py's
// (tests/test_reducer_fixtures.py checks that they are).
export const LIMITS = Object.freeze({
  MAX_ID: 64, // edge_runtime/events.py: a run id's characters
  MAX_ERRORS: 100,
  MAX_HELD: 1024,
  STREAM_SEEN: 1024,
  MAX_NODES: 256,
  MAX_ACTS: 1024,
  MAX_TABLE_ROWS: 1000,
  MAX_CITATIONS: 32,
  MAX_ERROR_MSG: 500,
});
const L = LIMITS;

export const DEVICE_RUN = "_";
export const BRIDGE_RUN = "_b";
export const STREAMS = new Set([DEVICE_RUN, BRIDGE_RUN]);
export const FAILURE_KINDS = new Set([
  "llm", "tool", "condition", "internal", "link", "device", "timeout", "budget", "kb",
]);
// server_bridge/models/base.py CAUSES: why a model call failed.
export const MODEL_CAUSES = new Set([
  "auth", "not_found", "rate_limited", "overloaded", "timeout", "stalled", "bad_response",
  "bad_endpoint", "unavailable", "model_not_allowed", "run_limit",
]);
export const SUBAGENT_KINDS = new Set(["agent", "subagent"]);
export const DELIVERY_STATES = ["pending", "submitting", "submitted", "failed", "cancelled"];
const TERMINAL_STATUSES = new Set(["done", "failed", "cancelled"]);
const NODE_STATUSES = new Set(["completed", "failed", "cancelled"]);
const BUDGET_LEVELS = new Set(["warn", "exceeded"]);
const END_OF_RUN = { done: "completed", failed: "failed", cancelled: "cancelled" };
const UNKNOWN = "?";
const UNDELIVERED = new Set(["pending", "submitting"]);
const WAITING = new Set(["pending", "approval"]);
const ROLLUP = {
  streaming: "running", building: "running", pending: "running", running: "running",
  approval: "running", done: "done", final: "done", failed: "failed", denied: "failed",
};

/** An envelope refused: `kind` is the contract's error kind, as wire.py's BadEnvelope. */
export class BadEnvelope extends Error {
  constructor(message) {
    super(message);
    this.name = "BadEnvelope";
    this.kind = "bad_envelope";
  }
}

// --- values, read as reducer.py reads them ---------------------------------------------

const isMap = (v) => typeof v === "object" && v !== null && !Array.isArray(v);
const isInt = (v) => Number.isInteger(v);
const str = (v) => (typeof v === "string" ? v : null);
const int = (v) => (isInt(v) ? v : 0);
const num = (v) => (typeof v === "number" ? v : null);
const has = (o, k) => Object.prototype.hasOwnProperty.call(o, k);

// Message and call ids may be ints or strings on the wire; rows are keyed by their text.
function key(v) {
  if (typeof v === "string") return v;
  if (isInt(v)) return String(v);
  return null;
}

function cpLength(s) {
  let n = 0;
  for (const _ of s) n++;
  return n;
}

// The first n code points of s (Python's s[:n]).
function cut(s, n) {
  if (s.length <= n) return s;
  const points = Array.from(s);
  return points.length <= n ? s : points.slice(0, n).join("");
}

/** Compares strings by code point, as Python sorts them (UTF-16 order differs above
 * U+FFFF). */
export function compareCodePoints(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) {
    let x = a.charCodeAt(i);
    let y = b.charCodeAt(i);
    if (x === y) continue;
    // A surrogate stands for a code point past U+FFFF: it sorts after U+E000..U+FFFF.
    x = x >= 0xe000 ? x - 0x800 : x >= 0xd800 ? x + 0x2000 : x;
    y = y >= 0xe000 ? y - 0x800 : y >= 0xd800 ? y + 0x2000 : y;
    return x - y;
  }
  return a.length - b.length;
}

/** server_bridge/wire.py check_envelope with any event type accepted: returns the
 * envelope or throws BadEnvelope. */
export function checkEnvelope(env) {
  if (!isMap(env)) throw new BadEnvelope("event envelope must be a map");
  const { r, i, t, ts, d } = env;
  if (typeof r !== "string" || r.length === 0 || cpLength(r) > L.MAX_ID) {
    throw new BadEnvelope(`event needs a run id r: a str of 1..${L.MAX_ID} chars`);
  }
  if (!isInt(i) || i < 1) throw new BadEnvelope("event needs an id i: an int >= 1");
  if (typeof t !== "string") throw new BadEnvelope("event needs a type t: a str");
  if (!isInt(ts)) throw new BadEnvelope("event needs a board clock ts: an int");
  if (!isMap(d)) throw new BadEnvelope("event needs its fields d: a map");
  if (env.n != null && typeof env.n !== "string") {
    throw new BadEnvelope("event key 'n' must be a str");
  }
  for (const k of ["a", "k"]) {
    if (env[k] != null && !isInt(env[k])) throw new BadEnvelope(`event key '${k}' must be an int`);
  }
  if (t === "error" && d.kind === "gap") {
    if (!isInt(d.from) || !isInt(d.to) || !(d.from >= 1 && d.from <= d.to)) {
      throw new BadEnvelope("a gap error needs ints from and to with 1 <= from <= to");
    }
  }
  return env;
}

/** The customer-safe part of a run.failed `err` (reducer.py safe_error). */
export function safeError(err) {
  if (!isMap(err)) return { kind: "internal", msg: "the run failed" };
  const kind = str(err.kind);
  const out = {
    kind: FAILURE_KINDS.has(kind) ? kind : "internal",
    msg: cut(str(err.msg) || "the run failed", L.MAX_ERROR_MSG),
  };
  const cause = str(err.cause);
  if (MODEL_CAUSES.has(cause)) out.cause = cause;
  return out;
}

// --- the snapshot ----------------------------------------------------------------------

// A row's fields, as reducer.py's Row (the same names and empty values).
function newRow(kind, fields = {}) {
  return {
    kind, text: "", name: null, input: null, output: null, call: null, failed: false,
    status: null, key: null, reasoning: "", client: false, format: null, finish: null,
    links: [], ver: null, stored: false, error: null, order: 0, delivery: null, node: null,
    act: null, ...fields,
  };
}

const newUsage = () => ({ tokens_in: 0, tokens_out: 0, tokens_reason: 0 });

function addUsage(usage, d) {
  usage.tokens_in += int(d.in);
  usage.tokens_out += int(d.out);
  usage.tokens_reason += int(d.reason);
}

/** What a UI renders for one run (reducer.py RunSnapshot; read it as snapshotJson). */
export class RunSnapshot {
  constructor(run, device = null) {
    this.run = run;
    this.device = device;
    this.req = null;
    this.conv = null;
    this.agent = null;
    this.version = null;
    this.status = "running";
    this.error = null;
    this.retryable = false;
    this.reason = null;
    this.usage = newUsage();
    this.rows = [];
    this.pending = new Map();
    this.lastId = 0;
    this.gaps = [];
    this.errors = [];
    this.citations = [];
    this.dropped = 0;
    this.rowsDropped = 0;
    this.nodes = new Map(); // path -> node state, in the order first started
    this.edges = new Map(); // JSON [from, port, to] -> {from, port, to, taken}
    this.budgets = new Map();
    this.nodesDropped = 0;
    this.tables = new Map(); // field -> row key -> table row
    this.messages = new Map();
    this.calls = new Map();
    this.outputs = new Map();
    this.tableEvents = 0;
    this.acts = new Map(); // "<path>#<a>" -> {path, a, k, kind, parent}, in start order
    this.actStatus = new Map();
    this.open = []; // the activation keys open now, innermost last
    this.held = new Map(); // id -> event that came above a hole
    this.lost = []; // [lo, hi] declared lost ahead of lastId: sorted, merged
    this.seen = new Map(); // a stream's recently seen events
  }

  get terminal() {
    return TERMINAL_STATUSES.has(this.status);
  }

  /** Terminal, and no id below the terminal event was missing. */
  get complete() {
    return this.terminal && this.gaps.length === 0;
  }

  /** A table's rows, most recent first. */
  table(name) {
    const rows = this.tables.get(name);
    return rows ? [...rows.values()].sort((x, y) => y.order - x.order) : [];
  }
}

function setStatus(snap, status) {
  if (snap.terminal) return; // a terminal status is final
  snap.status = status;
  if (snap.terminal) endOpenNodes(snap);
}

function endOpenNodes(snap) {
  const end = END_OF_RUN[snap.status];
  for (const node of snap.nodes.values()) {
    if (node.open.size) {
      node.open.clear();
      if (node.status === "running") node.status = end;
    }
  }
  for (const [k, status] of snap.actStatus) if (status === "running") snap.actStatus.set(k, end);
  snap.open.length = 0;
  for (const row of snap.calls.values()) {
    if (UNDELIVERED.has(row.delivery)) row.delivery = "cancelled";
  }
}

function addRow(snap, row, at = null) {
  if (at !== null) {
    row.node = at.node;
    row.act = at.act;
  } else if (row.kind !== "missing" && snap.open.length && snap.open.at(-1) !== UNKNOWN) {
    const act = snap.acts.get(snap.open.at(-1));
    row.node = act.path;
    row.act = act.a;
  }
  snap.rows.push(row);
  return row;
}

function messageRow(snap, m, role = null) {
  let row = m !== null ? snap.messages.get(m) : undefined;
  if (row === undefined) {
    const kind = role === "user" ? "user" : "assistant";
    row = addRow(snap, newRow(kind, { status: "streaming", key: m }));
    if (m !== null) snap.messages.set(m, row);
  }
  return row;
}

// --- handlers: one per event type; each gets the snapshot and the event's `d` ----------

function runStarted(snap, d) {
  snap.req = str(d.req) || snap.req;
  snap.conv = str(d.conv) || snap.conv;
  snap.agent = str(d.agent) || snap.agent;
  snap.version = str(d.ver) || snap.version;
  setStatus(snap, "running");
  let text = str(d.input);
  if (text) {
    const whole = int(d.input_len);
    const len = cpLength(text);
    if (whole > len) text += ` [cut: ${whole - len} more characters]`;
    addRow(snap, newRow("user", { text, status: "done" }));
  }
}

function runPaused(snap, d) {
  if (!snap.terminal) snap.reason = str(d.reason);
  setStatus(snap, "paused");
}

function runResumed(snap) {
  if (!snap.terminal) snap.reason = null;
  setStatus(snap, "running");
}

function runDone(snap, d) {
  if (isMap(d.usage)) {
    snap.usage = newUsage();
    addUsage(snap.usage, d.usage);
  }
  setStatus(snap, "done");
}

function runFailed(snap, d) {
  if (snap.terminal) return;
  snap.error = safeError(d.err);
  snap.retryable = d.retryable === true;
  setStatus(snap, "failed");
}

function runCancelled(snap, d) {
  if (snap.terminal) return;
  snap.reason = str(d.reason);
  setStatus(snap, "cancelled");
}

function msgEnd(snap, d) {
  const m = key(d.m);
  const row = m !== null ? snap.messages.get(m) : undefined;
  if (row !== undefined) {
    row.status = "done";
    row.finish = str(d.finish);
  }
}

function toolCall(snap, d) {
  const call = key(d.call);
  const client = d.client === true;
  const known = call !== null ? snap.calls.get(call) : undefined;
  if (known !== undefined) {
    // Announced again (a board that rebooted while paused): the same call.
    if (client && known.status === "pending") snap.pending.set(call, known);
    return;
  }
  const row = addRow(snap, newRow("tool_call", {
    call, name: str(d.name), input: str(d.input) || "{}", client,
    status: client ? "pending" : "running", delivery: client ? "pending" : null,
  }));
  if (call !== null) {
    snap.calls.set(call, row);
    if (client) snap.pending.set(call, row);
  }
}

function toolResult(snap, d) {
  const call = key(d.call);
  const failed = d.failed === true;
  const callRow = (call !== null ? snap.calls.get(call) : undefined) ?? null;
  if (callRow !== null) {
    callRow.status = failed ? "failed" : "done";
    if (UNDELIVERED.has(callRow.delivery) && failed && d.output === "cancelled") {
      // The board's own result for a call its run's cancel ended: no answer got there.
      callRow.delivery = "cancelled";
    } else if (callRow.delivery !== null) {
      callRow.delivery = "submitted";
    }
  }
  if (call !== null) snap.pending.delete(call);
  addRow(snap, newRow("tool_result", {
    call, name: callRow !== null ? callRow.name : null, output: d.output ?? null, failed,
    status: failed ? "failed" : "done",
  }), callRow);
}

function approval(snap, d, status) {
  const call = key(d.call);
  const row = call !== null ? snap.calls.get(call) : undefined;
  if (row === undefined || row.status === "done" || row.status === "failed") return;
  row.status = status;
  if (status === "approval") {
    snap.pending.set(call, row);
    if (row.delivery === null) row.delivery = "pending";
  } else {
    snap.pending.delete(call);
    if (row.delivery !== null) row.delivery = "submitted";
    const by = str(d.by);
    if (by !== null) row.text = `${status === "running" ? "approved" : "denied"} by ${by}`;
  }
}

function output(snap, d) {
  const name = str(d.name) || "";
  let row = snap.outputs.get(name);
  if (row === undefined) {
    row = addRow(snap, newRow("output", { name, status: "building" }));
    snap.outputs.set(name, row);
  }
  if (has(d, "value")) row.output = d.value ?? null;
  const delta = str(d.delta);
  if (delta !== null) row.output = (typeof row.output === "string" ? row.output : "") + delta;
  const status = str(d.status);
  if (status !== null) row.status = status;
  const fmt = str(d.format);
  if (fmt !== null) row.format = fmt;
}

function tableRow(snap, d) {
  const name = str(d.field);
  const k = key(d.row);
  if (name === null || k === null) return;
  if (!snap.tables.has(name)) snap.tables.set(name, new Map());
  const table = snap.tables.get(name);
  let row = table.get(k);
  const stored = d.stored === true;
  if (row === undefined) {
    if (table.size >= L.MAX_TABLE_ROWS) {
      snap.rowsDropped += 1;
      return;
    }
    row = newRow("table_row", { name, key: k });
    table.set(k, row);
  }
  snap.tableEvents += 1;
  row.order = stored ? -snap.tableEvents : snap.tableEvents;
  row.stored = stored;
  if (has(d, "value")) row.output = d.value ?? null;
  if (Array.isArray(d.links)) row.links = [...d.links];
  if (isInt(d.ver)) row.ver = d.ver;
  const status = str(d.status);
  if (status !== null) row.status = status;
  row.failed = status === "failed";
  row.error = null;
  if (row.failed) {
    const err = isMap(d.err) ? d.err : {};
    row.error = {
      kind: cut(str(err.kind) || "internal", 32),
      msg: cut(str(err.msg) || "the write failed", L.MAX_ERROR_MSG),
    };
  }
}

function tableDelete(snap, d) {
  const name = str(d.field);
  const k = key(d.row);
  if (name !== null && k !== null) snap.tables.get(name)?.delete(k);
}

function edge(snap, d) {
  const from = str(d.from);
  const to = str(d.to);
  if (from === null || to === null) return;
  const port = str(d.port);
  const k = JSON.stringify([from, port, to]);
  const known = snap.edges.get(k);
  if (known === undefined && snap.edges.size >= L.MAX_NODES) {
    snap.nodesDropped += 1;
    return;
  }
  if (known === undefined) snap.edges.set(k, { from, port, to, taken: 1 });
  else known.taken += 1;
}

function budget(snap, d) {
  const kind = str(d.kind);
  const used = num(d.used);
  const limit = num(d.limit);
  if (kind === null || used === null || limit === null) return;
  const level = str(d.level);
  const k = cut(kind, 32);
  snap.budgets.set(k, { kind: k, used, limit, level: BUDGET_LEVELS.has(level) ? level : "warn" });
}

function gapRange(d) {
  const lo = int(d.from);
  const hi = int(d.to);
  return 1 <= lo && lo <= hi ? [lo, hi] : null;
}

function error(snap, d) {
  const kind = str(d.kind) || "internal";
  const entry = { kind, msg: cut(str(d.msg) || "", L.MAX_ERROR_MSG) };
  const gap = kind === "gap" ? gapRange(d) : null;
  if (gap !== null) [entry.from, entry.to] = gap;
  const req = str(d.req);
  if (req !== null) entry.req = req;
  const run = str(d.r);
  if (run !== null) entry.r = run;
  snap.errors.push(entry);
  if (snap.errors.length > L.MAX_ERRORS) snap.errors.splice(0, snap.errors.length - L.MAX_ERRORS);
}

function citation(snap, d) {
  if (snap.citations.length >= L.MAX_CITATIONS) return;
  const entry = {};
  for (const k of ["col", "src", "ver", "h"]) {
    const v = str(d[k]);
    if (v !== null) entry[k] = cut(v, 200);
  }
  for (const k of ["n", "chunk"]) if (isInt(d[k])) entry[k] = d[k];
  if (typeof d.score === "number") entry.score = d.score;
  if (has(entry, "src")) snap.citations.push(entry);
}

/** The one dispatch table, as reducer.py's HANDLERS: other types change nothing shown. */
export const HANDLERS = {
  "run.started": runStarted,
  "run.paused": runPaused,
  "run.resumed": runResumed,
  "run.done": runDone,
  "run.failed": runFailed,
  "run.cancelled": runCancelled,
  "msg.start": (snap, d) => messageRow(snap, key(d.m), str(d.role)),
  "msg.delta": (snap, d) => { messageRow(snap, key(d.m)).text += str(d.text) || ""; },
  "msg.end": msgEnd,
  "reason.delta": (snap, d) => { messageRow(snap, key(d.m)).reasoning += str(d.text) || ""; },
  "tool.call": toolCall,
  "tool.result": toolResult,
  "approval.request": (snap, d) => approval(snap, d, "approval"),
  "approval.granted": (snap, d) => approval(snap, d, "running"),
  "approval.denied": (snap, d) => approval(snap, d, "denied"),
  output,
  row: tableRow,
  "row.delete": tableDelete,
  usage: (snap, d) => addUsage(snap.usage, d),
  edge,
  budget,
  error,
  citation,
};

// --- nodes -----------------------------------------------------------------------------

function onNode(snap, env) {
  const path = env.n;
  const a = env.a ?? null;
  const t = env.t;
  const d = env.d;
  if (t === "node.start") openAct(snap, path, a, env.k ?? null, str(d.kind));
  else if (t === "node.end" && a !== null) closeAct(snap, `${path}#${a}`, str(d.status));
  let node = snap.nodes.get(path);
  if (node === undefined) {
    if (snap.nodes.size >= L.MAX_NODES) {
      snap.nodesDropped += 1;
      return;
    }
    node = {
      path, kind: null, status: "running", port: null, activations: 0, a: null, k: null,
      usage: newUsage(), open: new Set(),
    };
    snap.nodes.set(path, node);
  }
  if (t === "node.start") {
    node.activations += 1;
    node.a = a;
    node.k = env.k ?? null;
    node.status = "running";
    node.port = null;
    node.kind = str(d.kind) || node.kind;
    if (a !== null) node.open.add(a);
  } else if (t === "node.end") {
    if (a !== null) node.open.delete(a);
    if (a === null || a === node.a) {
      const status = str(d.status);
      node.status = NODE_STATUSES.has(status) ? status : "failed";
      node.port = str(d.port);
    }
  } else if (t === "usage") {
    addUsage(node.usage, d);
  }
}

function openAct(snap, path, a, k, kind) {
  const id = `${path}#${a}`;
  if (snap.acts.has(id)) return;
  if (a === null || snap.acts.size >= L.MAX_ACTS) {
    if (a !== null) snap.nodesDropped += 1;
    push(snap, UNKNOWN);
    return;
  }
  snap.acts.set(id, { path, a, k, kind, parent: parentOf(snap, path) });
  snap.actStatus.set(id, "running");
  push(snap, id);
}

// At most MAX_ACTS open at once: past it, what is innermost is not known.
function push(snap, id) {
  if (snap.open.length >= L.MAX_ACTS) snap.open[snap.open.length - 1] = UNKNOWN;
  else snap.open.push(id);
}

// Within the innermost open activation whose path is an ancestor of `path`; unknown when
// what is open past a hole comes first (reducer.py _parent).
function parentOf(snap, path) {
  for (let n = snap.open.length - 1; n >= 0; n--) {
    const id = snap.open[n];
    if (id === UNKNOWN) return UNKNOWN;
    if (path.startsWith(snap.acts.get(id).path + "/")) return id;
  }
  return null;
}

function closeAct(snap, id, status) {
  if (snap.actStatus.has(id)) snap.actStatus.set(id, NODE_STATUSES.has(status) ? status : "failed");
  const n = snap.open.lastIndexOf(id);
  if (n >= 0) snap.open.splice(n, 1);
}

// --- order: holes, held events, lost ranges ----------------------------------------------

function applyOne(snap, env, applied, onApply) {
  snap.lastId = env.i;
  const handler = HANDLERS[env.t];
  if (handler !== undefined && has(HANDLERS, env.t)) handler(snap, env.d);
  if (env.n != null && !snap.terminal) onNode(snap, env);
  applied.push(env);
  if (onApply) onApply(env, snap);
}

function applyStream(snap, env, onApply) {
  // A repeat is the same envelope; a stream's ids begin again at 1 after a reboot.
  const seen = `${env.i}\u0000${env.ts}\u0000${env.t}\u0000${JSON.stringify(env.d)}`;
  if (snap.seen.has(seen)) return [];
  snap.seen.set(seen, null);
  while (snap.seen.size > L.STREAM_SEEN) snap.seen.delete(snap.seen.keys().next().value);
  snap.lastId = Math.max(snap.lastId, env.i);
  const handler = HANDLERS[env.t];
  if (handler !== undefined && has(HANDLERS, env.t)) handler(snap, env.d);
  if (onApply) onApply(env, snap);
  return [env];
}

function hold(snap, env) {
  snap.held.set(env.i, env);
  if (snap.held.size > L.MAX_HELD) {
    snap.held.delete(Math.max(...snap.held.keys()));
    snap.dropped += 1;
  }
}

function recordLost(snap, lo, hi) {
  lo = Math.max(lo, snap.lastId + 1);
  if (lo > hi) return;
  const merged = [];
  for (const [a, b] of [...snap.lost, [lo, hi]].sort((x, y) => x[0] - y[0] || x[1] - y[1])) {
    const last = merged.at(-1);
    if (last && a <= last[1] + 1) last[1] = Math.max(last[1], b);
    else merged.push([a, b]);
  }
  merged.length = Math.min(merged.length, L.MAX_HELD);
  snap.lost = merged;
}

function advance(snap, applied, onApply) {
  for (;;) {
    const next = snap.lastId + 1;
    const env = snap.held.get(next);
    if (env !== undefined) {
      snap.held.delete(next);
      applyOne(snap, env, applied, onApply);
      continue;
    }
    while (snap.lost.length && snap.lost[0][1] < next) snap.lost.shift();
    if (!snap.lost.length || snap.lost[0][0] > next) return;
    // To the end of the range, or to the first held id inside it (it came after all).
    let end = snap.lost[0][1];
    for (const i of snap.held.keys()) if (i <= end) end = Math.min(end, i - 1);
    stepOver(snap, next, end);
  }
}

function stepOver(snap, lo, hi) {
  snap.lastId = hi;
  snap.gaps.push([lo, hi]);
  snap.open.splice(0, snap.open.length, UNKNOWN);
  addRow(snap, newRow("missing", { text: `[missing: events ${lo}..${hi}]` }));
  snap.messages.clear();
  snap.outputs.clear();
}

function applyChecked(snap, env, onApply) {
  if (STREAMS.has(snap.run)) return applyStream(snap, env, onApply);
  const i = env.i;
  if (i <= snap.lastId || snap.held.has(i)) return [];
  if (env.t === "error" && env.d.kind === "gap") {
    const gap = gapRange(env.d);
    if (gap !== null) recordLost(snap, ...gap);
  }
  const applied = [];
  if (i === snap.lastId + 1) applyOne(snap, env, applied, onApply);
  else hold(snap, env);
  advance(snap, applied, onApply);
  return applied;
}

/** Folds one event into its run's snapshot; returns the events applied, in id order.
 * Throws BadEnvelope for something that is not an envelope. */
export function applyEvent(snap, event, onApply = null) {
  return applyChecked(snap, checkEnvelope(event), onApply);
}

/** Declares ids lo..hi of the run lost; returns the held events this released. */
export function markLost(snap, lo, hi, onApply = null) {
  const applied = [];
  if (STREAMS.has(snap.run) || lo > hi) return applied;
  recordLost(snap, lo, hi);
  advance(snap, applied, onApply);
  return applied;
}

/** A device's presence from what the bridge sends on `_b` (reducer.py presence_of). */
export function presenceOf(t, d, seen) {
  let st;
  if (t === "presence" && ["online", "offline", "unseen"].includes(d.st)) st = d.st;
  else if (t === "error" && d.kind === "device_offline") st = "offline";
  else return null;
  const since = typeof d.since === "number" && d.since > 0 ? d.since / 1000 : null;
  return { st, since, seen };
}

/** Snapshots of many runs, keyed by run id (reducer.py Reducer): one per device. */
export class Reducer {
  constructor(device = null, maxRuns = 1000) {
    if (!(maxRuns >= 1)) throw new RangeError("maxRuns must be >= 1");
    this.device = device;
    this.maxRuns = maxRuns;
    this.runsById = new Map();
    this.finished = new Map();
    this.presence = null;
  }

  /** Folds one envelope; returns the run's snapshot. Throws BadEnvelope. */
  apply(event) {
    return this.fold(event)[0];
  }

  /** Folds one envelope; returns [snapshot, the events this applied]. */
  fold(event, onApply = null) {
    const env = checkEnvelope(event);
    const r = env.r;
    let snap = this.runsById.get(r);
    if (snap === undefined) {
      snap = new RunSnapshot(r, this.device);
      this.runsById.set(r, snap);
      this.evict(r);
    }
    const applied = applyChecked(snap, env, onApply);
    this.note(snap);
    if (r === BRIDGE_RUN && applied.length) {
      const presence = presenceOf(env.t, env.d, Date.now() / 1000);
      if (presence !== null) this.presence = presence;
    } else if (!STREAMS.has(r) && applied.length) {
      this.presence = null;
    }
    return [snap, applied];
  }

  /** Declares ids lo..hi of `run` lost; nothing for a run not held. */
  markLost(run, lo, hi, onApply = null) {
    const snap = this.runsById.get(run);
    if (snap === undefined) return [];
    const applied = markLost(snap, lo, hi, onApply);
    this.note(snap);
    return applied;
  }

  /** How a host's answer to `call` is getting to the board (reducer.py set_delivery):
   * throws RangeError for a state not in DELIVERY_STATES; false for a run or call not
   * held or a call no host answers; a call the board answered, or of an ended run,
   * keeps its delivery. */
  setDelivery(run, call, state) {
    if (!DELIVERY_STATES.includes(state)) {
      throw new RangeError(`a delivery state is one of ${DELIVERY_STATES.join(", ")}`);
    }
    const snap = this.runsById.get(run);
    const row = snap?.calls.get(call);
    if (snap === undefined || row === undefined || row.delivery === null) return false;
    if (!snap.terminal && WAITING.has(row.status)) row.delivery = state;
    return true;
  }

  get(run) {
    return this.runsById.get(run) ?? null;
  }

  runs() {
    return [...this.runsById.values()];
  }

  note(snap) {
    if (snap.terminal && !this.finished.has(snap.run)) this.finished.set(snap.run, null);
  }

  evict(keep) {
    while (this.runsById.size > this.maxRuns) {
      let old;
      if (this.finished.size) {
        old = this.finished.keys().next().value;
        this.finished.delete(old);
      } else {
        old = [...this.runsById.keys()].find((r) => r !== keep);
      }
      this.runsById.delete(old);
    }
  }
}

// --- what a UI reads -------------------------------------------------------------------

// views.py _row: a field left at its empty value is left out.
function rowJson(row) {
  const out = {};
  for (const [k, v] of Object.entries(row)) {
    const empty = v === null || v === undefined || v === "" || v === false || v === 0 ||
      (Array.isArray(v) && v.length === 0);
    if (!empty) out[k] = plain(v);
  }
  out.kind = row.kind;
  return out;
}

// A value of a snapshot as JSON holds it: copied, so a caller cannot change the reducer's.
function plain(v) {
  if (Array.isArray(v)) return v.map(plain);
  if (isMap(v)) return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, plain(x)]));
  return v;
}

/** A run's snapshot as views.py snapshot_json writes it. */
export function snapshotJson(snap) {
  return {
    run: snap.run,
    device: snap.device,
    req: snap.req,
    conv: snap.conv,
    agent: snap.agent,
    version: snap.version,
    status: snap.status,
    error: plain(snap.error),
    retryable: snap.retryable,
    reason: snap.reason,
    usage: { ...snap.usage },
    rows: snap.rows.map(rowJson),
    pending: [...snap.pending.keys()].sort(compareCodePoints),
    tables: Object.fromEntries([...snap.tables.keys()].map((n) => [n, snap.table(n).map(rowJson)])),
    lastId: snap.lastId,
    gaps: snap.gaps.map((g) => [...g]),
    errors: plain(snap.errors),
    citations: plain(snap.citations),
    nodes: Object.fromEntries([...snap.nodes].map(([path, n]) => [path, {
      ...n, usage: { ...n.usage },
      open: [...n.open].sort((x, y) => compareCodePoints(String(x), String(y))),
    }])),
    edges: [...snap.edges.values()].map((e) => ({ ...e })),
    budgets: Object.fromEntries([...snap.budgets].map(([k, b]) => [k, { ...b }])),
    composites: composites(snap),
  };
}

function union(inner, keys) {
  const all = new Set();
  for (const k of keys) for (const i of inner.get(k) ?? []) all.add(i);
  return [...all].sort((x, y) => x - y);
}

function rollupStatus(statuses) {
  const seen = new Set(statuses);
  for (const status of ["running", "failed", "cancelled"]) if (seen.has(status)) return status;
  return "completed";
}

const childPath = (parent, path) =>
  path.startsWith(parent + "/") && !path.slice(parent.length + 1).includes("/");

/** The composite rows of a run (reducer.py composites: the rules are in its docstring). */
export function composites(snap) {
  const acts = snap.acts;
  const status = snap.actStatus;
  if (!acts.size) return [];
  const inner = new Map();
  snap.rows.forEach((row, i) => {
    let k = row.node !== null ? `${row.node}#${row.act}` : null;
    while (k !== null && acts.has(k)) {
      if (!inner.has(k)) inner.set(k, []);
      inner.get(k).push(i);
      k = acts.get(k).parent;
    }
  });
  const order = new Map([...acts.keys()].map((k, n) => [k, n]));
  const found = [];

  const branches = new Map();
  for (const [k, act] of acts) {
    const parent = act.parent;
    if (parent !== null && acts.has(parent) && childPath(acts.get(parent).path, act.path)) {
      if (!branches.has(parent)) branches.set(parent, new Map());
      const paths = branches.get(parent);
      if (!paths.has(act.path)) paths.set(act.path, []);
      paths.get(act.path).push(k);
    }
  }
  for (const [k, paths] of branches) {
    if (paths.size < 2) continue;
    const act = acts.get(k);
    const tracks = [...paths].map(([path, keys]) => ({
      node: path, acts: keys.map((x) => acts.get(x).a), status: status.get(keys.at(-1)),
      rows: union(inner, keys),
    }));
    found.push([order.get(k), 0, {
      key: `fanout:${k}`, type: "fanout", node: act.path, act: act.a, status: status.get(k),
      rows: inner.get(k) ?? [], tracks,
    }]);
  }

  for (const [k, act] of acts) {
    if (!SUBAGENT_KINDS.has(act.kind)) continue;
    const counts = { running: 0, done: 0, failed: 0 };
    for (const i of inner.get(k) ?? []) {
      const row = snap.rows[i];
      const counted = row.kind !== "tool_result" && has(ROLLUP, row.status ?? "");
      let bucket = counted ? ROLLUP[row.status] : null;
      // In a run that has ended, a row left running counts as the run ended.
      if (bucket === "running" && snap.terminal) {
        bucket = snap.status === "done" ? "done" : "failed";
      }
      if (bucket !== null) counts[bucket] += 1;
    }
    found.push([order.get(k), 1, {
      key: `subagent:${k}`, type: "subagent", node: act.path, act: act.a, status: status.get(k),
      rows: inner.get(k) ?? [], counts,
    }]);
  }

  const now = new Map(); // level -> {k, keys}: the iteration open there
  const repeats = new Map(); // key -> {first, head, iterations}
  for (const [k, act] of acts) {
    if (act.k === null || act.parent === UNKNOWN) continue;
    const level = act.parent;
    let it = now.get(level);
    if (it === undefined || it.k !== act.k) {
      const name = level !== null ? `repeat:${level}>${act.path}` : `repeat:${act.path}`;
      if (!repeats.has(name)) {
        repeats.set(name, { first: order.get(k), head: act.path, iterations: [] });
      }
      it = { k: act.k, keys: [] };
      now.set(level, it);
      repeats.get(name).iterations.push(it);
    }
    it.keys.push(k);
  }
  for (const [name, { first, head, iterations }] of repeats) {
    const tracks = iterations.map(({ k, keys }) => ({
      k,
      status: rollupStatus(keys.map((x) => status.get(x))),
      nodes: keys.map((x) => ({
        node: acts.get(x).path, act: acts.get(x).a, status: status.get(x),
      })),
      rows: union(inner, keys),
    }));
    found.push([first, 2, {
      key: name, type: "repeat", node: head, status: rollupStatus(tracks.map((t) => t.status)),
      rows: union(inner, iterations.flatMap((it) => it.keys)), tracks,
    }]);
  }
  found.sort((x, y) => x[0] - y[0] || x[1] - y[1]);
  return found.map((f) => f[2]);
}

/** A window of a snapshot's rows read from the tail (reducer.py window_rows): the last
 * `limit` rows before index `before` (the end when null); {rows, from, hasEarlier}. */
export function windowRows(view, limit, before = null) {
  if (!Number.isInteger(limit) || limit < 0) throw new RangeError("limit must be an int >= 0");
  if (before !== null && before !== undefined && !Number.isInteger(before)) {
    throw new RangeError("before must be an int or null");
  }
  const rows = view.rows ?? [];
  const end = before === null || before === undefined
    ? rows.length
    : Math.min(Math.max(before, 0), rows.length);
  const start = Math.max(0, end - limit);
  return { rows: rows.slice(start, end), from: start, hasEarlier: start > 0 };
}
