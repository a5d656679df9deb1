// The run view: a run's events folded by the shared reducer (reducer.mjs) into what it
// shows — the transcript as it streams, its tables, citations, status and usage, the
// node panel, the raw event log — and what a person does with it: answer a client
// tool, approve or deny a call, cancel the run, ask again.

import { api, ApiError } from "./api.mjs";
import { argumentsView, clock, fill, h, nextId } from "./dom.mjs";
import { Reducer } from "./reducer.mjs";
import { RowList, TableView } from "./rows.mjs";
import { Follower } from "./sse.mjs";
import { stats } from "./stats.mjs";

// The raw event log keeps this many events of a run (the oldest go first): what a
// person scrolls through, not the run's record (the bridge's event log is that).
const LOG_EVENTS = 2000;
// Events drawn into an open log per render, so opening it on a long run is not one
// long task.
const LOG_DRAW = 400;

const STATUS_TEXT = {
  running: "Running",
  paused: "Paused",
  done: "Done",
  failed: "Failed",
  cancelled: "Cancelled",
};

export class RunView {
  /** ctx: {fleet, announce(text), go(hash, replace)}; where: {device, run} or {device, req}. */
  constructor(ctx, where) {
    this.ctx = ctx;
    this.device = where.device;
    this.run = where.run || null;
    this.req = where.req || null;
    this.reducer = new Reducer(this.device, 1);
    this.snap = null;
    this.log = [];
    this.logDropped = 0;
    this.logDrawn = 0;
    this.arrivals = [];
    this.forms = new Map();
    this.tables = new Map();
    this.lastStatus = null;
    this.citationsDrawn = -1;
    this.nodesDirty = true;
    this.connection = "connecting";
    this.downSince = 0;
    this.refusal = null;

    const titleId = nextId("run");
    this.title = h("h2", { id: titleId, tabindex: "-1" });
    this.statusBox = h("div", { class: "status-box" });
    this.connBox = h("p", { class: "conn", role: "status" });
    this.presenceBox = h("p", { class: "presence-note", role: "status" });
    this.steer = h("div", { class: "steer" });
    this.controls = h("div", { class: "controls" });
    this.transcript = h("ol", { class: "transcript", "aria-label": "Transcript" });
    this.empty = h("p", { class: "muted" }, "Waiting for the run's first event…");
    this.tablesBox = h("div", { class: "tables" });
    this.citationsBox = h("div", { class: "citations" });
    this.nodesBox = h("div", { class: "nodes" });
    this.logList = h("ol", { class: "log" });
    this.logNote = h("p", { class: "muted" });
    this.logDetails = h("details", { class: "log-box", ontoggle: () => this.drawLog() },
      h("summary", null, "Raw event log"), this.logNote, this.logList);

    this.rows = new RowList(this.transcript, (name) => ctx.fleet.tool(this.device, name));
    this.el = h("article", { class: "run-view", "aria-labelledby": titleId },
      h("header", { class: "run-head" }, this.title, this.connBox, this.presenceBox),
      h("div", { class: "run-grid" },
        h("section", { class: "main-col", "aria-label": "Conversation" },
          this.steer, this.empty, this.transcript, this.tablesBox),
        h("aside", { class: "side-col", "aria-label": "Run details" },
          h("section", { "aria-label": "Status" }, h("h3", null, "Status"), this.statusBox, this.controls),
          this.citationsBox, this.nodesBox)),
      h("section", { "aria-label": "Event log" }, this.logDetails));
    this.drawTitle();
    this.unwatch = ctx.fleet.watch(() => {
      this.drawPresence();
      this.drawArguments();
    });
    this.drawPresence();
  }

  start() {
    this.follower = new Follower(() => this.url(), {
      frame: (f) => this.frame(f),
      batch: () => this.render(),
      state: (s, detail) => this.state(s, detail),
    }).start();
    return this;
  }

  destroy() {
    if (this.follower) this.follower.stop();
    this.unwatch();
    this.el.remove();
  }

  url() {
    if (this.run) return api.runEventsUrl(this.device, this.run);
    return api.requestEventsUrl(this.device, this.req);
  }

  // --- events ---------------------------------------------------------------------

  frame({ id, event, data, arrived }) {
    if (event === "gap") {
      // Ids the bridge no longer holds: the reducer steps over them, leaving a
      // `missing` row where they were.
      if (this.run && data.r === this.run) {
        this.reducer.markLost(this.run, data.from, data.to, (env) => this.logEvent(env));
        this.pushLog({ note: `events ${data.from}..${data.to} are no longer held by the bridge` });
        this.arrivals.push(arrived);
      }
      return null;
    }
    if (event === "error" && !id) {
      if (data.req && !this.run) {
        // The board (or the bridge) refused the request: no run will come.
        this.refusal = data;
        this.render();
        return "end";
      }
      this.pushLog({ note: `the stream was cut (${data.kind}): resuming` });
      return null;
    }
    if (!this.run) {
      this.run = data.r;
      this.ctx.go(`#/run/${encodeURIComponent(this.device)}/${encodeURIComponent(this.run)}`, true);
      this.drawTitle();
    }
    if (data.r !== this.run) return null;
    const [snap] = this.reducer.fold(data, (env) => this.logEvent(env));
    this.snap = snap;
    this.arrivals.push(arrived);
    return snap.terminal ? "end" : null;
  }

  logEvent(env) {
    if (env.n !== undefined || env.t === "edge" || env.t === "budget" || env.t === "usage") {
      this.nodesDirty = true;
    }
    this.pushLog(env);
  }

  pushLog(entry) {
    this.log.push(entry);
    if (this.log.length > LOG_EVENTS) {
      const cut = this.log.length - LOG_EVENTS;
      this.log.splice(0, cut);
      this.logDropped += cut;
      this.logDrawn = Math.max(0, this.logDrawn - cut);
      const items = this.logList.children;
      for (let k = 0; k < cut && items.length; k++) items[0].remove();
    }
  }

  state(s, detail) {
    this.connection = s;
    if (s === "reconnecting") this.downSince = detail.since;
    if (s === "refused") this.refusal = detail;
    this.drawConnection();
    if (s === "refused") this.render();
  }

  // --- drawing ----------------------------------------------------------------------

  drawTitle() {
    fill(this.title, this.run ? "Run " : "Request ", h("code", null, this.run || this.req),
      " on ", h("a", { href: `#/device/${encodeURIComponent(this.device)}` }, this.device));
    document.title = `${this.run || "Request"} — Wren`;
  }

  drawConnection() {
    const s = this.connection;
    let text;
    if (s === "live") text = "Live.";
    else if (s === "ended") text = "The run has ended; its whole record is shown.";
    else if (s === "connecting") text = "Connecting to the bridge…";
    else if (s === "reconnecting") {
      fill(this.connBox, h("span", { class: "warn" }, "Reconnecting to the bridge"), " (lost since ",
        clock(this.downSince, true), "); the run goes on and will be shown from where it was.");
      return;
    } else text = "";
    fill(this.connBox, text);
  }

  drawPresence() {
    const dev = this.ctx.fleet.get(this.device);
    const p = dev ? dev.presence : null;
    if (p && p.st === "offline") {
      fill(this.presenceBox, h("span", { class: "warn" }, `Device ${this.device} is offline`),
        " since ", clock(p.since), ".");
    } else fill(this.presenceBox);
  }

  render() {
    const t0 = performance.now();
    const snap = this.snap;
    if (this.refusal) {
      const r = this.refusal;
      const words = r instanceof ApiError && r.status === 404
        ? "No such run on this device, or not one you may see."
        : `${r.kind || "refused"}: ${r.message || r.msg || ""}`;
      fill(this.empty, h("span", { class: "error" }, words));
      this.empty.setAttribute("role", "alert");
    }
    if (snap !== null) {
      this.empty.hidden = true;
      this.rows.sync(snap.rows);
      this.drawTables(snap);
      this.drawStatus(snap);
      this.drawSteering(snap);
      if (snap.citations.length !== this.citationsDrawn) this.drawCitations(snap);
      if (this.nodesDirty) this.drawNodes(snap);
      if (this.logDetails.open) this.drawLog();
      else this.logNote.textContent = `${this.log.length + this.logDropped} events.`;
    }
    const done = performance.now();
    for (const a of this.arrivals) stats.rendered(done - a);
    this.arrivals.length = 0;
    stats.renderTook(done - t0);
  }

  drawTables(snap) {
    for (const name of snap.tables.keys()) {
      let view = this.tables.get(name);
      if (view === undefined) {
        view = new TableView(name);
        this.tables.set(name, view);
        this.tablesBox.append(view.el);
      }
      view.sync(snap.table(name));
    }
  }

  drawStatus(snap) {
    const items = [
      ["Status", h("span", { class: `badge st-${snap.status}` }, STATUS_TEXT[snap.status] || snap.status)],
    ];
    if (snap.reason) items.push(["Why", snap.reason]);
    if (snap.error) {
      items.push(["Error", `${snap.error.kind}${snap.error.cause ? ` (${snap.error.cause})` : ""}: ${snap.error.msg}`]);
      items.push(["Retryable", snap.retryable ? "yes: asking again may work" : "no"]);
    }
    if (snap.agent) items.push(["Agent", `${snap.agent}${snap.version ? ` ${snap.version}` : ""}`]);
    const u = snap.usage;
    items.push(["Tokens", `${u.tokens_in} in, ${u.tokens_out} out${u.tokens_reason ? `, ${u.tokens_reason} reasoning` : ""}`]);
    if (snap.conv) items.push(["Conversation", h("a", { href: `#/conv/${encodeURIComponent(snap.conv)}` }, snap.conv)]);
    if (snap.gaps.length) items.push(["Missing", snap.gaps.map(([a, b]) => `${a}..${b}`).join(", ")]);
    items.push(["Events", String(snap.lastId)]);
    fill(this.statusBox, h("dl", { class: "facts" }, items.map(([k, v]) => [h("dt", null, k), h("dd", null, v)])));
    if (snap.status !== this.lastStatus) {
      if (this.lastStatus !== null) this.ctx.announce(`Run ${STATUS_TEXT[snap.status] || snap.status}.`);
      this.lastStatus = snap.status;
      this.drawControls(snap);
    }
  }

  drawControls(snap) {
    const out = [];
    if (!snap.terminal) {
      out.push(h("button", { type: "button", class: "danger", onclick: (e) => this.cancel(e.target) }, "Cancel run"));
    } else if (snap.status === "failed" && snap.retryable) {
      out.push(h("button", { type: "button", onclick: (e) => this.again(e.target) }, "Ask again"));
    }
    fill(this.controls, out);
  }

  async cancel(button) {
    button.disabled = true;
    try {
      await api.cancel(this.device, this.run);
      this.ctx.announce("Cancel sent.");
    } catch (e) {
      button.disabled = false;
      this.ctx.announce(`Cancel refused: ${e.message}`);
    }
  }

  async again(button) {
    const first = this.snap.rows.find((r) => r.kind === "user");
    if (!first) return;
    button.disabled = true;
    try {
      const { req } = await api.start(this.device, first.text, this.snap.conv);
      this.ctx.go(`#/req/${encodeURIComponent(this.device)}/${encodeURIComponent(req)}`);
    } catch (e) {
      button.disabled = false;
      this.ctx.announce(`Refused: ${e.message}`);
    }
  }

  // The calls the run waits on, one form each, kept while the call waits (a form is
  // never redrawn under a person typing into it).
  drawSteering(snap) {
    for (const [call, form] of this.forms) {
      if (!snap.pending.has(call) || snap.terminal) {
        form.el.remove();
        this.forms.delete(call);
      }
    }
    if (snap.terminal) return;
    for (const [call, row] of snap.pending) {
      if (this.forms.has(call)) continue;
      const form = this.askForm(call, row);
      this.forms.set(call, form);
      this.steer.append(form.el);
    }
  }

  askForm(call, row) {
    const approval = row.status === "approval";
    const headId = nextId("ask");
    const note = h("p", { class: "delivery-note", role: "status" });
    const send = async (fn, controls) => {
      for (const c of controls) c.disabled = true;
      this.reducer.setDelivery(this.run, call, "submitting");
      note.textContent = "Sending…";
      try {
        await fn();
        this.reducer.setDelivery(this.run, call, "submitted");
        note.textContent = "Sent; waiting for the device.";
      } catch (e) {
        this.reducer.setDelivery(this.run, call, "failed");
        for (const c of controls) c.disabled = false;
        note.textContent = `Not sent: ${e.message}`;
      }
    };
    const about = h("div", { class: "about" });
    const parts = [
      h("h3", { id: headId }, h("code", null, row.name),
        approval ? " waits for your approval" : " waits for your answer"),
      about,
    ];
    let el;
    if (approval) {
      const yes = h("button", { type: "button", class: "primary" }, "Approve");
      const no = h("button", { type: "button", class: "danger" }, "Deny");
      yes.addEventListener("click", () => send(() => api.approve(this.device, this.run, call, true), [yes, no]));
      no.addEventListener("click", () => send(() => api.approve(this.device, this.run, call, false), [yes, no]));
      el = h("section", { class: "ask", "aria-labelledby": headId }, parts, h("div", { class: "actions" }, yes, no), note);
    } else {
      const inputId = nextId("answer");
      const input = h("input", { id: inputId, type: "text", name: "answer", required: true, autocomplete: "off" });
      const submit = h("button", { type: "submit", class: "primary" }, "Send answer");
      const fail = h("button", { type: "button" }, "Refuse (the call fails)");
      const form = h("form", { class: "answer" },
        h("label", { for: inputId }, "Your answer"), input, h("div", { class: "actions" }, submit, fail));
      form.addEventListener("submit", (e) => {
        e.preventDefault();
        send(() => api.answer(this.device, this.run, call, input.value, false), [input, submit, fail]);
      });
      fail.addEventListener("click", () => send(
        () => api.answer(this.device, this.run, call, input.value || "refused from the dashboard", true),
        [input, submit, fail]));
      el = h("section", { class: "ask", "aria-labelledby": headId }, parts, form, note);
    }
    const form = { el, about, row, drawn: null };
    this.drawAbout(form);
    return form;
  }

  // What the call asks, read by its tool's schema once the device's hello is known (a
  // page opened straight on a run may have it only after its first read of the fleet).
  drawAbout(form) {
    const tool = this.ctx.fleet.tool(this.device, form.row.name);
    if (form.drawn !== null && (tool === null || form.drawn === tool)) return;
    form.drawn = tool;
    fill(form.about, tool && tool.description ? h("p", { class: "muted" }, tool.description) : null,
      argumentsView(form.row.input, tool ? tool.args : null));
  }

  drawArguments() {
    for (const form of this.forms.values()) this.drawAbout(form);
  }

  drawCitations(snap) {
    this.citationsDrawn = snap.citations.length;
    if (!snap.citations.length) return fill(this.citationsBox);
    fill(this.citationsBox, h("h3", null, "Sources"), h("ol", { class: "cites" },
      snap.citations.map((c) => h("li", null,
        c.n !== undefined ? h("span", { class: "muted" }, `[${c.n}] `) : null,
        h("strong", null, c.src),
        c.h ? ` — ${c.h}` : "",
        c.col ? h("span", { class: "muted" }, ` in ${c.col}`) : null,
        typeof c.score === "number" ? h("span", { class: "muted" }, ` (score ${c.score.toFixed(3)})`) : null))));
  }

  drawNodes(snap) {
    this.nodesDirty = false;
    if (!snap.nodes.size && !snap.budgets.size) return fill(this.nodesBox);
    const nodes = [...snap.nodes.values()];
    const parts = [h("h3", null, "Nodes")];
    if (nodes.length) {
      parts.push(h("div", { class: "scroll", tabindex: "0", role: "region", "aria-label": "Node runs" },
        h("table", { class: "nodes-table" },
          h("thead", null, h("tr", null, ["Node", "Status", "Runs", "Port", "Tokens"]
            .map((c) => h("th", { scope: "col" }, c)))),
          h("tbody", null, nodes.map((n) => h("tr", null,
            h("th", { scope: "row" }, h("code", null, n.path), n.kind ? h("span", { class: "muted kind" }, n.kind) : null),
            h("td", null, h("span", { class: `badge st-${n.status}` }, n.open.size ? `${n.status} (${n.open.size} open)` : n.status)),
            h("td", null, String(n.activations)),
            h("td", null, n.port || ""),
            h("td", null, `${n.usage.tokens_in}/${n.usage.tokens_out}`)))))));
    }
    if (snap.edges.size) {
      parts.push(h("h4", null, "Edges taken"), h("ul", { class: "edges" },
        [...snap.edges.values()].map((e) => h("li", null, h("code", null, e.from),
          ` —${e.port || ""}→ `, h("code", null, e.to), e.taken > 1 ? ` ×${e.taken}` : ""))));
    }
    if (snap.budgets.size) {
      parts.push(h("h4", null, "Budgets"), h("ul", { class: "budgets" },
        [...snap.budgets.values()].map((b) => h("li", null,
          h("span", { class: b.level === "exceeded" ? "error" : "warn" }, b.level), ` ${b.kind}: ${b.used} of ${b.limit}`))));
    }
    fill(this.nodesBox, parts);
  }

  drawLog() {
    if (!this.logDetails.open) return;
    const run = this.run;
    const end = Math.min(this.log.length, this.logDrawn + LOG_DRAW);
    for (let k = this.logDrawn; k < end; k++) {
      const e = this.log[k];
      this.logList.append(e.note
        ? h("li", { class: "note" }, e.note)
        : h("li", null, h("code", { class: "id" }, `${run}:${e.i}`), " ", h("strong", null, e.t),
          h("pre", { class: "json" }, JSON.stringify(e))));
    }
    this.logDrawn = end;
    const more = this.log.length - end;
    this.logNote.textContent = `${this.log.length + this.logDropped} events` +
      (this.logDropped ? ` (the first ${this.logDropped} no longer kept here)` : "") +
      (more > 0 ? `; ${more} more being drawn.` : ".");
    if (more > 0) setTimeout(() => this.drawLog(), 0);
  }
}

