// A user's conversations (GET /v1/conversations) and one conversation reopened: its
// rows read as a window from the tail ("Load earlier" reads the window before), its
// tables as they stand, and a box to go on with it.

import { api } from "./api.mjs";
import { clock, fill, h, nextId } from "./dom.mjs";
import { RowView, TableView } from "./rows.mjs";

// Rows read at a time from a conversation's tail.
const WINDOW = 30;
const LIST_PAGE = 50;

export class ConversationsView {
  constructor(ctx) {
    this.ctx = ctx;
    this.offset = 0;
    this.body = h("tbody");
    this.summary = h("p", { class: "muted", role: "status" }, "Loading…");
    this.pager = h("div", { class: "actions" });
    this.el = h("section", { class: "conversations", "aria-labelledby": "convs-title" },
      h("h2", { id: "convs-title", tabindex: "-1" }, "Conversations"), this.summary,
      h("div", { class: "scroll", tabindex: "0", role: "region", "aria-label": "Conversations" },
        h("table", null, h("thead", null, h("tr", null,
          ["Conversation", "Device", "Runs", "Last status", "Agent", "Last active"].map((c) => h("th", { scope: "col" }, c)))),
        this.body)),
      this.pager);
    this.load();
  }

  destroy() {
    this.el.remove();
  }

  async load() {
    let page;
    try {
      page = await api.conversations({ limit: LIST_PAGE, offset: this.offset });
    } catch (e) {
      this.summary.textContent = `The conversations could not be read: ${e.message}`;
      return;
    }
    const { conversations, total } = page;
    fill(this.body, conversations.map((c) => h("tr", null,
      h("th", { scope: "row" }, h("a", { href: `#/conv/${encodeURIComponent(c.conv)}` }, c.conv)),
      h("td", null, h("a", { href: `#/device/${encodeURIComponent(c.device)}` }, c.device)),
      h("td", null, String(c.runs.length)),
      h("td", null, h("span", { class: `badge st-${c.status}` }, c.status || "—")),
      h("td", null, c.agent || "—"),
      h("td", null, clock(c.updated, true)))));
    this.summary.textContent = total
      ? `Conversations ${this.offset + 1}–${this.offset + conversations.length} of ${total}, the most recently active first.`
      : "No conversations yet.";
    const prev = h("button", { type: "button", disabled: this.offset === 0 }, "Newer");
    const next = h("button", { type: "button", disabled: this.offset + LIST_PAGE >= total }, "Older");
    prev.addEventListener("click", () => { this.offset = Math.max(0, this.offset - LIST_PAGE); this.load(); });
    next.addEventListener("click", () => { this.offset += LIST_PAGE; this.load(); });
    fill(this.pager, prev, next);
  }
}

export class ConversationView {
  constructor(ctx, conv) {
    this.ctx = ctx;
    this.conv = conv;
    this.from = null;
    this.device = null;
    this.list = h("ol", { class: "transcript", "aria-label": "Transcript" });
    this.earlier = h("button", { type: "button", hidden: true, onclick: () => this.loadEarlier() }, "Load earlier");
    this.note = h("p", { class: "muted", role: "status" }, "Loading…");
    this.tablesBox = h("div", { class: "tables" });
    const inputId = nextId("followup");
    this.input = h("textarea", { id: inputId, rows: "2", required: true });
    this.sent = h("p", { class: "muted", role: "status" });
    this.form = h("form", { class: "request", hidden: true },
      h("label", { for: inputId }, "Go on with this conversation"), this.input,
      h("div", { class: "actions" }, h("button", { type: "submit", class: "primary" }, "Send")), this.sent);
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.followUp();
    });
    this.el = h("section", { class: "conversation", "aria-labelledby": "conv-title" },
      h("h2", { id: "conv-title", tabindex: "-1" }, "Conversation ", h("code", null, conv)),
      this.note, this.earlier, this.list, this.tablesBox, this.form);
    this.load();
  }

  destroy() {
    this.el.remove();
  }

  tools() {
    return (name) => (this.device ? this.ctx.fleet.tool(this.device, name) : null);
  }

  // Rows of a window, each run's first row preceded by the run's heading.
  items(rows, runs, prevRun) {
    const out = [];
    let run = prevRun;
    for (const row of rows) {
      if (row.run !== run) {
        run = row.run;
        const about = runs.find((r) => r.run === run) || {};
        out.push(h("li", { class: "run-sep" },
          h("a", { href: `#/run/${encodeURIComponent(about.device || this.device)}/${encodeURIComponent(run)}` }, `Run ${run}`),
          about.status ? h("span", { class: `badge st-${about.status}` }, about.status) : null,
          about.error ? h("span", { class: "error" }, ` ${about.error.kind}: ${about.error.msg}`) : null));
      }
      out.push(new RowView(row, this.tools()).el);
    }
    return out;
  }

  async load() {
    let page;
    try {
      page = await api.conversation(this.conv, { limit: WINDOW });
    } catch (e) {
      this.note.textContent = e.status === 404 ? "No such conversation, or not one you may see." : `Could not be read: ${e.message}`;
      return;
    }
    this.runs = page.runs;
    const last = page.runs[page.runs.length - 1];
    this.device = last ? last.device : null;
    this.firstRun = page.rows.length ? page.rows[0].run : null;
    fill(this.list, this.items(page.rows, page.runs, null));
    this.from = page.from;
    this.earlier.hidden = !page.hasEarlier;
    this.note.textContent = `${page.runs.length} ${page.runs.length === 1 ? "run" : "runs"}` +
      (page.hasEarlier ? `; the last ${page.rows.length} rows shown.` : ".");
    // Its tables as they stand: each table as the latest run that showed it left it.
    const tables = new Map();
    for (const r of page.runs) for (const [name, rows] of Object.entries(r.tables || {})) tables.set(name, rows);
    fill(this.tablesBox);
    for (const [name, rows] of tables) {
      const view = new TableView(name);
      view.sync(rows);
      this.tablesBox.append(view.el);
    }
    this.form.hidden = this.device === null;
  }

  async loadEarlier() {
    let page;
    try {
      page = await api.conversation(this.conv, { limit: WINDOW, before: this.from });
    } catch (e) {
      this.note.textContent = `Could not be read: ${e.message}`;
      return;
    }
    // The window's last run may go on in the rows shown: its heading moves up.
    const sep = this.list.firstChild;
    const lastRun = page.rows.length ? page.rows[page.rows.length - 1].run : null;
    if (sep && sep.classList.contains("run-sep") && lastRun === this.firstRun) sep.remove();
    this.list.prepend(...this.items(page.rows, page.runs, null));
    this.firstRun = page.rows.length ? page.rows[0].run : this.firstRun;
    this.from = page.from;
    this.earlier.hidden = !page.hasEarlier;
    this.note.textContent = page.hasEarlier ? `${this.list.querySelectorAll(".row").length} rows shown.` : "The whole conversation is shown.";
    // The keyboard stays by what was read: the button, or the first row once it is gone.
    if (!this.earlier.hidden) this.earlier.focus();
    else {
      const first = this.list.querySelector(".row");
      first?.setAttribute("tabindex", "-1");
      first?.focus();
    }
  }

  async followUp() {
    const text = this.input.value.trim();
    if (!text || !this.device) return;
    try {
      const { req } = await api.start(this.device, text, this.conv);
      this.ctx.go(`#/req/${encodeURIComponent(this.device)}/${encodeURIComponent(req)}`);
    } catch (e) {
      this.sent.textContent = `Refused: ${e.message}`;
    }
  }
}
