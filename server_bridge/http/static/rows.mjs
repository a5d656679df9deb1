// A transcript's rows and a table's rows as DOM, from the reducer's rows (a live
// snapshot's objects) or from the API's JSON rows (a conversation's window): the same
// fields, empty ones left out in JSON. Each view keeps what it last drew and changes
// only what changed: a streaming answer grows by appending its new text to one text
// node, so a long answer costs the page its deltas, not its whole text again and again.

import { argumentsView, formatted, h, jsonText } from "./dom.mjs";

const LABELS = {
  user: "You",
  assistant: "Assistant",
  tool_call: "Tool call",
  tool_result: "Tool result",
  output: "Output",
  missing: "Missing events",
};

const STATUS_WORDS = {
  streaming: "streaming",
  running: "running",
  pending: "waits for an answer",
  approval: "waits for approval",
  denied: "denied",
  failed: "failed",
  done: "done",
  building: "building",
  final: "final",
};

// How a person's answer is getting to the board, where it is worth saying.
const DELIVERY = { submitting: "answer sending", failed: "answer not sent", cancelled: "answer cancelled" };

// What a row shows, to tell whether it changed since it was drawn: strings by length
// (they only grow), values by identity (the reducer replaces them).
function signature(row) {
  return [
    row.status, (row.text || "").length, (row.reasoning || "").length, row.output,
    row.failed, row.delivery, row.finish, row.name, row.format, row.input,
  ];
}

function same(a, b) {
  if (a === null || a.length !== b.length) return false;
  for (let k = 0; k < a.length; k++) if (a[k] !== b[k]) return false;
  return true;
}

function badge(status) {
  if (!status) return null;
  return h("span", { class: `badge st-${status}` }, STATUS_WORDS[status] || status);
}

/** One transcript row; `update(row)` redraws it when what it shows changed. */
export class RowView {
  constructor(row, tools = () => null) {
    this.tools = tools;
    this.sig = null;
    this.el = h("li", { class: `row k-${row.kind}` });
    this.text = null; // the text node a streaming message grows in
    this.reasoning = null;
    this.update(row);
  }

  update(row) {
    const sig = signature(row);
    if (same(this.sig, sig)) return false;
    const was = this.sig;
    this.sig = sig;
    if ((row.kind === "assistant" || row.kind === "user") && this.text !== null && was) {
      this.grow(row);
    } else {
      this.draw(row);
    }
    // A model turn that only called tools said nothing: its row would be an empty box.
    this.el.hidden = row.kind === "assistant" && !row.text && !row.reasoning && row.status !== "streaming";
    return true;
  }

  // A message that only grew: append the new text; redraw the head (status) alone.
  grow(row) {
    const text = row.text || "";
    if (text.startsWith(this.text.data)) this.text.appendData(text.slice(this.text.data.length));
    else this.text.data = text;
    const reasoning = row.reasoning || "";
    if (reasoning && this.reasoning === null) {
      this.draw(row);
      return;
    }
    if (this.reasoning !== null && reasoning !== this.reasoning.data) {
      if (reasoning.startsWith(this.reasoning.data)) {
        this.reasoning.appendData(reasoning.slice(this.reasoning.data.length));
      } else this.reasoning.data = reasoning;
    }
    this.el.firstChild.replaceWith(this.head(row));
    this.el.setAttribute("aria-busy", row.status === "streaming" ? "true" : "false");
  }

  head(row) {
    const label = LABELS[row.kind] || row.kind;
    const name = row.kind === "output" || row.kind === "tool_call" || row.kind === "tool_result"
      ? row.name : null;
    const where = row.node ? h("span", { class: "where" }, `${row.node}#${row.act}`) : null;
    return h("div", { class: "head" },
      h("span", { class: "who" }, label),
      name ? h("code", { class: "name" }, name) : null,
      row.kind !== "user" && row.kind !== "missing" ? badge(row.status) : null,
      DELIVERY[row.delivery] ? h("span", { class: "delivery" }, DELIVERY[row.delivery]) : null,
      where);
  }

  draw(row) {
    const body = [];
    this.text = null;
    this.reasoning = null;
    switch (row.kind) {
      case "user":
      case "assistant": {
        if (row.reasoning) {
          this.reasoning = document.createTextNode(row.reasoning);
          body.push(h("details", { class: "reasoning" },
            h("summary", null, "Reasoning"), h("p", { class: "text" }, this.reasoning)));
        }
        this.text = document.createTextNode(row.text || "");
        body.push(h("p", { class: "text" }, this.text));
        if (row.finish === "length") {
          body.push(h("p", { class: "note" }, "The answer was cut short by its token limit."));
        }
        break;
      }
      case "tool_call": {
        const tool = this.tools(row.name);
        body.push(argumentsView(row.input, tool ? tool.args : null));
        if (row.client) body.push(h("p", { class: "muted" }, "Answered by the host."));
        if (row.text) body.push(h("p", { class: "muted" }, row.text));
        break;
      }
      case "tool_result":
        body.push(h("pre", { class: row.failed ? "out failed" : "out" }, jsonText(row.output ?? "")));
        break;
      case "output":
        body.push(row.output === null || row.output === undefined
          ? h("p", { class: "muted" }, "…")
          : formatted(row.output, row.format));
        break;
      case "missing":
        this.el.setAttribute("role", "note");
        body.push(h("p", { class: "text" }, row.text || "Some events are missing here."));
        break;
      default:
        body.push(h("pre", { class: "json" }, JSON.stringify(row)));
    }
    this.el.replaceChildren(this.head(row), ...body);
    this.el.setAttribute("aria-busy", row.status === "streaming" ? "true" : "false");
  }
}

/** Keeps an <ol> in step with a list of rows that only grows (a snapshot's rows). */
export class RowList {
  constructor(el, tools) {
    this.el = el;
    this.tools = tools;
    this.views = [];
  }

  sync(rows) {
    let changed = 0;
    for (let i = 0; i < rows.length; i++) {
      const view = this.views[i];
      if (view === undefined) {
        const v = new RowView(rows[i], this.tools);
        this.views.push(v);
        this.el.append(v.el);
        changed += 1;
      } else if (view.update(rows[i])) changed += 1;
    }
    return changed;
  }
}

// --- tables -------------------------------------------------------------------------

function tableSig(row) {
  return [row.status, row.output, row.ver, (row.links || []).length, row.stored, row.error];
}

// A row's forward links (PROTOCOL.md "mem.link": {label, to_field, to_key}), one line
// each: "label → field/key". Backlinks are the other row's, never shown twice.
function linkList(links) {
  if (!Array.isArray(links) || !links.length) return "";
  return h("ul", { class: "plain" }, links.map((l) => h("li", null,
    l && typeof l === "object" && l.to_key !== undefined
      ? `${l.label ?? ""} → ${l.to_field ?? ""}/${l.to_key}` : JSON.stringify(l))));
}

function cellValue(v) {
  if (v === null || v === undefined) return "";
  return typeof v === "string" ? v : JSON.stringify(v);
}

// Rows of a table on the page at once; "Show more" adds as many again. A table holds up
// to 1,000 rows (the reducer's bound): laid out all at once they made a frame of 100 ms.
const TABLE_PAGE = 100;

/** One streamed table (PROTOCOL.md "Tables"), most recent row first, kept in step with
 * its rows by key: a row that changed is redrawn, a new one inserted where it belongs. */
export class TableView {
  constructor(name) {
    this.name = name;
    this.rows = new Map(); // key -> {tr, sig}
    this.limit = TABLE_PAGE;
    this.last = [];
    this.count = h("span", { class: "muted" });
    this.body = h("tbody");
    this.more = h("button", { type: "button", hidden: true, onclick: () => {
      this.limit += TABLE_PAGE;
      this.sync(this.last);
    } }, "Show more rows");
    this.el = h("section", { class: "table", "aria-label": `Table ${name}` },
      h("h3", null, "Table ", h("code", null, name), " ", this.count),
      h("div", { class: "scroll", tabindex: "0", role: "region", "aria-label": `Rows of table ${name}` },
        h("table", null,
          h("thead", null, h("tr", null,
            h("th", { scope: "col" }, "Row"), h("th", { scope: "col" }, "Value"),
            h("th", { scope: "col" }, "Status"), h("th", { scope: "col" }, "Version"),
            h("th", { scope: "col" }, "Links"))),
          this.body)),
      this.more);
  }

  sync(all) {
    this.last = all;
    const rows = all.length > this.limit ? all.slice(0, this.limit) : all;
    const keep = new Set();
    let at = this.body.firstChild;
    for (const row of rows) {
      keep.add(row.key);
      let entry = this.rows.get(row.key);
      const sig = tableSig(row);
      if (entry === undefined) {
        entry = { tr: h("tr"), sig: null };
        this.rows.set(row.key, entry);
      }
      if (!same(entry.sig, sig)) {
        entry.sig = sig;
        const err = row.error ? ` (${row.error.kind}: ${row.error.msg})` : "";
        entry.tr.replaceChildren(
          h("th", { scope: "row" }, h("code", null, row.key)),
          h("td", { class: "value" }, cellValue(row.output)),
          h("td", null, badge(row.status), row.stored ? h("span", { class: "muted" }, " stored") : null, err),
          h("td", null, row.ver ?? ""),
          h("td", { class: "links" }, linkList(row.links)));
      }
      if (at === entry.tr) at = at.nextSibling;
      else this.body.insertBefore(entry.tr, at);
    }
    for (const [key, entry] of this.rows) {
      if (!keep.has(key)) {
        entry.tr.remove();
        this.rows.delete(key);
      }
    }
    const n = all.length;
    this.count.textContent = `${n} ${n === 1 ? "row" : "rows"}` +
      (rows.length < n ? `, the ${rows.length} most recent shown` : "");
    this.more.hidden = rows.length >= n;
  }
}
