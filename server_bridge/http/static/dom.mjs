// Small DOM helpers for the dashboard: elements built from data, never from HTML text.
// Nothing here sets innerHTML: every string a board, a model or a user wrote reaches the
// page as a text node, so no event can inject markup (and the page's CSP forbids inline
// script and style besides).

/** An element: h("a", {href, class: "x", onclick}, "text", child, [more children]).
 * Attributes whose value is null, undefined or false are left out; `on*` functions are
 * listeners; `dataset` a map of data-* values. */
export function h(tag, attrs = null, ...children) {
  const el = document.createElement(tag);
  if (attrs) {
    for (const [k, v] of Object.entries(attrs)) {
      if (v === null || v === undefined || v === false) continue;
      if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
      else if (k === "dataset") Object.assign(el.dataset, v);
      else if (k === "class") el.className = v;
      else if (v === true) el.setAttribute(k, "");
      else el.setAttribute(k, String(v));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else el.append(c instanceof Node ? c : String(c));
  }
}

/** Replaces an element's children. */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

/** A local clock time for Unix seconds (or ms when `ms`), in a <time> element. */
export function clock(t, ms = false) {
  if (typeof t !== "number" || !(t > 0)) return h("span", null, "—");
  const d = new Date(ms ? t : t * 1000);
  const today = new Date().toDateString() === d.toDateString();
  const text = today ? d.toLocaleTimeString() : d.toLocaleString();
  return h("time", { datetime: d.toISOString() }, text);
}

/** Bytes as a person reads them: 23.4 KiB. */
export function bytes(n) {
  if (typeof n !== "number") return "—";
  if (n < 1024) return `${n} B`;
  if (n < 1 << 20) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / (1 << 20)).toFixed(1)} MiB`;
}

/** A value as indented JSON text; a string that holds JSON is parsed first. */
export function jsonText(v) {
  if (typeof v === "string") {
    try {
      return JSON.stringify(JSON.parse(v), null, 2);
    } catch {
      return v;
    }
  }
  return JSON.stringify(v, null, 2);
}

/** A block of JSON. */
export function jsonBlock(v) {
  return h("pre", { class: "json" }, jsonText(v));
}

// --- Markdown ----------------------------------------------------------------------
// A deliberately small subset, rendered as DOM nodes: headings, paragraphs, lists,
// block quotes, fenced code, inline code, strong, emphasis and links (http, https and
// mailto only). What it does not know stays text.

const SAFE_URL = /^(https?:|mailto:)/i;

function inline(text) {
  const out = [];
  // code | **strong** | *em* / _em_ | [text](url)
  const re = /`([^`]+)`|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|_([^_\s][^_]*)_|\[([^\]]+)\]\(([^)\s]+)\)/g;
  let at = 0;
  for (let m = re.exec(text); m !== null; m = re.exec(text)) {
    if (m.index > at) out.push(text.slice(at, m.index));
    if (m[1] !== undefined) out.push(h("code", null, m[1]));
    else if (m[2] !== undefined) out.push(h("strong", null, ...inline(m[2])));
    else if (m[3] !== undefined || m[4] !== undefined) out.push(h("em", null, m[3] ?? m[4]));
    else if (SAFE_URL.test(m[6])) {
      out.push(h("a", { href: m[6], rel: "noopener noreferrer", target: "_blank" }, m[5]));
    } else out.push(m[0]);
    at = re.lastIndex;
  }
  if (at < text.length) out.push(text.slice(at));
  return out;
}

/** Markdown text as a <div class="md"> of DOM nodes. */
export function markdown(text) {
  const root = h("div", { class: "md" });
  const lines = String(text).split("\n");
  let para = [];
  let list = null;
  const flush = () => {
    if (para.length) root.append(h("p", null, ...inline(para.join(" "))));
    para = [];
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = /^```/.exec(line);
    if (fence) {
      flush();
      list = null;
      const code = [];
      for (i++; i < lines.length && !/^```/.test(lines[i]); i++) code.push(lines[i]);
      root.append(h("pre", null, h("code", null, code.join("\n"))));
      continue;
    }
    const head = /^(#{1,6})\s+(.*)$/.exec(line);
    const item = /^\s*([-*]|\d+[.)])\s+(.*)$/.exec(line);
    const quote = /^>\s?(.*)$/.exec(line);
    if (head) {
      flush();
      list = null;
      // Headings inside a row start at h4: the page's own outline holds h1..h3.
      root.append(h(`h${Math.min(6, head[1].length + 3)}`, null, ...inline(head[2])));
    } else if (item) {
      flush();
      const tag = /\d/.test(item[1]) ? "ol" : "ul";
      if (list === null || list.tagName.toLowerCase() !== tag) {
        list = h(tag);
        root.append(list);
      }
      list.append(h("li", null, ...inline(item[2])));
    } else if (quote) {
      flush();
      list = null;
      root.append(h("blockquote", null, ...inline(quote[1])));
    } else if (line.trim() === "") {
      flush();
      list = null;
    } else {
      list = null;
      para.push(line);
    }
  }
  flush();
  return root;
}

/** An output's value by its format: Markdown, JSON, or text. */
export function formatted(value, format) {
  const f = (format || "").toLowerCase();
  if (typeof value !== "string") return jsonBlock(value);
  if (f === "markdown" || f === "md") return markdown(value);
  if (f === "json") return jsonBlock(value);
  return h("p", { class: "text" }, value);
}

// --- tool arguments, read by the tool's JSON schema -------------------------------

/** A tool call's arguments as a labelled list, in the order and with the titles and
 * descriptions its JSON schema gives (what the hello announced); arguments the schema
 * does not name follow; without a schema, the JSON. */
export function argumentsView(input, schema) {
  let args;
  try {
    args = typeof input === "string" ? JSON.parse(input || "{}") : input;
  } catch {
    return h("pre", { class: "json" }, String(input));
  }
  if (args === null || typeof args !== "object" || Array.isArray(args)) return jsonBlock(args);
  const props = schema && typeof schema.properties === "object" ? schema.properties : {};
  const keys = [...Object.keys(props).filter((k) => k in args),
    ...Object.keys(args).filter((k) => !(k in props))];
  if (!keys.length) return h("p", { class: "muted" }, "No arguments.");
  const dl = h("dl", { class: "args" });
  for (const k of keys) {
    const p = props[k] || {};
    const v = args[k];
    dl.append(
      h("dt", null, p.title || k, p.description ? h("span", { class: "hint" }, ` — ${p.description}`) : null),
      h("dd", null, typeof v === "string" ? v : JSON.stringify(v)),
    );
  }
  return dl;
}

let uid = 0;
/** A unique id for label/aria wiring. */
export function nextId(prefix = "w") {
  uid += 1;
  return `${prefix}-${uid}`;
}
