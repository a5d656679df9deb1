// The fleet: every device of the token's tenant with its presence (GET /v1/devices,
// polled), filtered and sorted on the page; and one device's page, where a person
// starts a run.

import { api } from "./api.mjs";
import { bytes, clock, fill, h, nextId } from "./dom.mjs";

// The devices are read again this often; a page with nothing new to show draws nothing.
const POLL_MS = 5000;
// Rows drawn at once: a fleet of thousands is filtered and sorted whole, and shown a
// page at a time, so the page stays quick to draw and to read.
const PAGE = 100;

/** The tenant's devices as last read, and who wants to know when they change. */
export class FleetStore {
  constructor() {
    this.devices = [];
    this.byId = new Map();
    this.text = "";
    this.error = null;
    this.listeners = new Set();
    this.timer = null;
    this.loaded = false;
  }

  start() {
    if (this.timer === null) {
      this.refresh();
      this.timer = setInterval(() => this.refresh(), POLL_MS);
    }
  }

  stop() {
    clearInterval(this.timer);
    this.timer = null;
    this.devices = [];
    this.byId = new Map();
    this.text = "";
    this.loaded = false;
  }

  async refresh() {
    let obj;
    try {
      obj = await api.devices();
      this.error = null;
    } catch (e) {
      this.error = e;
      this.notify();
      return;
    }
    const text = JSON.stringify(obj.devices);
    this.loaded = true;
    if (text === this.text) return;
    this.text = text;
    this.devices = obj.devices;
    this.byId = new Map(obj.devices.map((d) => [d.device, d]));
    this.notify();
  }

  notify() {
    for (const f of this.listeners) f(this);
  }

  watch(f) {
    this.listeners.add(f);
    return () => this.listeners.delete(f);
  }

  get(device) {
    return this.byId.get(device) || null;
  }

  /** A tool of a device's agent as its hello announced it ({name, description, args,
   * client, approval}), or null. */
  tool(device, name) {
    const d = this.byId.get(device);
    return (d && (d.tools || []).find((t) => t.name === name)) || null;
  }
}

// Ids are ASCII: code-unit order is theirs, and many times quicker than localeCompare.
const order = (a, b) => (a < b ? -1 : a > b ? 1 : 0);

function presenceWord(d) {
  const p = d.presence;
  return p ? p.st : "unseen";
}

const COLUMNS = [
  { key: "device", label: "Device", value: (d) => d.device },
  { key: "presence", label: "Presence", value: (d) => `${presenceWord(d)}:${d.presence?.since ?? 0}` },
  { key: "boot", label: "Boot", value: (d) => d.presence?.boot || "" },
  { key: "heap", label: "Free heap", value: (d) => d.presence?.heap ?? -1 },
  { key: "seen", label: "Last seen", value: (d) => d.presence?.seen ?? 0 },
  { key: "agent", label: "Agent", value: (d) => `${d.presence?.agent || d.agent} ${d.presence?.ver || ""}` },
  { key: "runs", label: "Runs in flight", value: (d) => (d.runs || []).length },
];

export class FleetView {
  constructor(ctx) {
    this.ctx = ctx;
    this.sort = { key: "device", dir: 1 };
    this.filter = "";
    this.presence = "all";
    this.limit = PAGE;
    const filterId = nextId("filter");
    const presenceId = nextId("presence");
    this.summary = h("p", { class: "muted", role: "status" });
    this.head = h("tr");
    this.body = h("tbody");
    this.more = h("button", { type: "button", onclick: () => { this.limit += PAGE; this.draw(); } }, "Show more");
    const filter = h("input", { id: filterId, type: "search", placeholder: "device, agent, boot…", autocomplete: "off" });
    filter.addEventListener("input", () => {
      this.filter = filter.value.trim().toLowerCase();
      this.limit = PAGE;
      this.draw();
    });
    const presence = h("select", { id: presenceId },
      ["all", "online", "offline", "unseen"].map((v) => h("option", { value: v }, v)));
    presence.addEventListener("change", () => {
      this.presence = presence.value;
      this.limit = PAGE;
      this.draw();
    });
    this.el = h("section", { class: "fleet", "aria-labelledby": "fleet-title" },
      h("h2", { id: "fleet-title", tabindex: "-1" }, "Fleet"),
      h("div", { class: "filters" },
        h("div", { class: "field" }, h("label", { for: filterId }, "Filter"), filter),
        h("div", { class: "field" }, h("label", { for: presenceId }, "Presence"), presence)),
      this.summary,
      h("div", { class: "scroll", tabindex: "0", role: "region", "aria-label": "Devices" },
        h("table", { class: "fleet-table" }, h("thead", null, this.head), this.body)),
      this.more);
    this.unwatch = ctx.fleet.watch(() => this.draw());
    this.draw();
  }

  destroy() {
    this.unwatch();
    this.el.remove();
  }

  sortBy(key) {
    this.sort = { key, dir: this.sort.key === key ? -this.sort.dir : 1 };
    this.draw();
  }

  // The column heads, built once (the keyboard stays on the one pressed) and marked
  // with the order in place.
  drawHead() {
    if (!this.head.firstChild) {
      fill(this.head, COLUMNS.map((c) => h("th", { scope: "col" },
        h("button", { type: "button", class: "sort", dataset: { key: c.key }, onclick: () => this.sortBy(c.key) },
          c.label, h("span", { "aria-hidden": "true" })))));
    }
    COLUMNS.forEach((c, k) => {
      const th = this.head.children[k];
      const sorted = this.sort.key === c.key;
      th.setAttribute("aria-sort", sorted ? (this.sort.dir > 0 ? "ascending" : "descending") : "none");
      th.querySelector("span").textContent = sorted ? (this.sort.dir > 0 ? " ▲" : " ▼") : "";
    });
  }

  draw() {
    const t0 = performance.now();
    const store = this.ctx.fleet;
    this.drawHead();
    const q = this.filter;
    const col = COLUMNS.find((c) => c.key === this.sort.key);
    const shown = store.devices.filter((d) => {
      if (this.presence !== "all" && presenceWord(d) !== this.presence) return false;
      if (!q) return true;
      const p = d.presence || {};
      return [d.device, d.agent, p.agent, p.boot, p.ver, p.fw, p.st].some((v) => v && String(v).toLowerCase().includes(q));
    });
    const dir = this.sort.dir;
    shown.sort((a, b) => {
      const x = col.value(a);
      const y = col.value(b);
      const c = typeof x === "number" && typeof y === "number" ? x - y : order(String(x), String(y));
      return c * dir || order(a.device, b.device);
    });
    const page = shown.slice(0, this.limit);
    fill(this.body, page.map((d) => this.row(d)));
    if (!store.loaded && store.error === null) this.summary.textContent = "Loading the devices…";
    else if (store.error) this.summary.textContent = `The devices could not be read: ${store.error.message}`;
    else if (!store.devices.length) this.summary.textContent = "No devices: this tenant has none you may see.";
    else this.summary.textContent = `Showing ${page.length} of ${shown.length} devices` +
      (shown.length !== store.devices.length ? ` (${store.devices.length} in all)` : "") + ".";
    this.more.hidden = page.length >= shown.length;
    this.drawTook = performance.now() - t0;
  }

  row(d) {
    const p = d.presence;
    const st = presenceWord(d);
    const runs = d.runs || [];
    return h("tr", null,
      h("th", { scope: "row" }, h("a", { href: `#/device/${encodeURIComponent(d.device)}` }, d.device)),
      h("td", null, h("span", { class: `badge pr-${st}` }, st === "unseen" ? "never seen" : st),
        p && p.since && st !== "unseen" ? h("span", { class: "muted" }, " since ", clock(p.since)) : null),
      h("td", null, p && p.boot ? h("code", null, p.boot) : "—"),
      h("td", null, p && typeof p.heap === "number" ? bytes(p.heap) : "—"),
      h("td", null, p ? clock(p.seen) : "—"),
      h("td", null, agentOf(d)),
      h("td", null, runs.length ? runLinks(d.device, runs) : "0"));
  }
}

// The agent the device says it runs (its status), with its version; the registry's
// word when the two differ (a board flashed with another app says so first).
function agentOf(d) {
  const p = d.presence || {};
  const runs = p.agent || d.agent;
  return [runs, p.ver ? h("span", { class: "muted" }, ` ${p.ver}`) : null,
    p.agent && p.agent !== d.agent ? h("span", { class: "muted" }, ` (registered: ${d.agent})`) : null];
}

function runLinks(device, runs) {
  const shown = runs.slice(0, 3).map((r) => h("a", { href: `#/run/${encodeURIComponent(device)}/${encodeURIComponent(r)}` }, r));
  const out = [`${runs.length}: `];
  shown.forEach((a, k) => out.push(k ? ", " : "", a));
  if (runs.length > 3) out.push(" …");
  return out;
}

/** One device: its presence and tools, the runs in flight, its recent conversations,
 * and the box that starts a run on it. */
export class DeviceView {
  constructor(ctx, device) {
    this.ctx = ctx;
    this.device = device;
    this.info = h("div", { class: "device-info" });
    this.convs = h("div", { class: "device-convs" });
    const inputId = nextId("request");
    this.input = h("textarea", { id: inputId, rows: "3", required: true, name: "input" });
    this.note = h("p", { role: "status", class: "muted" });
    const form = h("form", { class: "request" },
      h("label", { for: inputId }, `Ask ${device}`), this.input,
      h("div", { class: "actions" }, h("button", { type: "submit", class: "primary" }, "Start run")), this.note);
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.start();
    });
    this.el = h("section", { class: "device", "aria-labelledby": "device-title" },
      h("h2", { id: "device-title", tabindex: "-1" }, "Device ", h("code", null, device)),
      this.info, form, this.convs);
    this.unwatch = ctx.fleet.watch(() => this.draw());
    this.draw();
    this.loadConversations();
  }

  destroy() {
    this.unwatch();
    this.el.remove();
  }

  async start() {
    const text = this.input.value.trim();
    if (!text) return;
    this.note.textContent = "Sending…";
    try {
      const conv = `c${crypto.randomUUID().replace(/-/g, "").slice(0, 16)}`;
      const { req } = await api.start(this.device, text, conv);
      this.ctx.go(`#/req/${encodeURIComponent(this.device)}/${encodeURIComponent(req)}`);
    } catch (e) {
      this.note.textContent = `Refused: ${e.message}`;
    }
  }

  draw() {
    const d = this.ctx.fleet.get(this.device);
    if (!d) {
      fill(this.info, h("p", { class: "muted" }, this.ctx.fleet.loaded ? "No such device, or not one you may see." : "Loading…"));
      return;
    }
    const p = d.presence || {};
    const st = presenceWord(d);
    fill(this.info,
      h("dl", { class: "facts" },
        h("dt", null, "Presence"), h("dd", null, h("span", { class: `badge pr-${st}` }, st),
          p.since ? [" since ", clock(p.since)] : null),
        h("dt", null, "Agent"), h("dd", null, agentOf(d)),
        h("dt", null, "Boot"), h("dd", null, p.boot || "—"),
        h("dt", null, "Free heap"), h("dd", null, bytes(p.heap)),
        h("dt", null, "Firmware"), h("dd", null, p.fw || "—"),
        h("dt", null, "Last seen"), h("dd", null, clock(p.seen)),
        h("dt", null, "Runs in flight"), h("dd", null, (d.runs || []).length ? runLinks(d.device, d.runs) : "none")),
      (d.tools || []).length ? [h("h3", null, "Tools"), h("ul", { class: "tools" }, d.tools.map((t) => h("li", null,
        h("code", null, t.name), t.client ? h("span", { class: "badge" }, "answered by a person") : null,
        t.approval ? h("span", { class: "badge" }, "needs approval") : null,
        t.description ? ` — ${t.description}` : "")))] : null);
  }

  async loadConversations() {
    try {
      const { conversations } = await api.conversations({ device: this.device, limit: 20 });
      if (!conversations.length) return;
      fill(this.convs, h("h3", null, "Recent conversations"), h("ul", null, conversations.map((c) =>
        h("li", null, h("a", { href: `#/conv/${encodeURIComponent(c.conv)}` }, c.conv),
          ` — ${c.runs.length} ${c.runs.length === 1 ? "run" : "runs"}, ${c.status || ""}, `, clock(c.updated, true)))));
    } catch {
      // the list is a convenience: the page works without it
    }
  }
}
