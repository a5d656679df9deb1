// Following a run's events: SSE read with fetch, resumed with Last-Event-ID.
//
// Why not EventSource: the bridge names each frame by its event type (`event:
// msg.delta`), and EventSource hands a named frame only to a listener registered for
// that name, so a type this page does not list would vanish without a trace and leave
// a hole the reducer waits on forever; it cannot tell a 401 or a 404 from a network
// error (it just stops, or retries, saying nothing); and it puts the token in the URL,
// where server and proxy logs keep it. With fetch the token goes in the Authorization
// header, every frame is read whatever its name, and the page keeps the last id itself
// and sends it as Last-Event-ID when it reconnects (after a drop, a `too_slow` cut, or
// a bridge restart: the bridge resumes from its window and event log, so nothing is
// repeated or missed, and ids it no longer holds come as one `gap` frame).

import { raw, refusal, api } from "./api.mjs";

// Reconnect waits: doubling from the first to the last, then the last again.
const BACKOFF_MS = [250, 500, 1000, 2000, 4000];
// A stream silent this long is taken for dead (the bridge beats every 15 s).
const SILENCE_MS = 45000;

/** Parses SSE text as it comes, frame by frame ({id, event, data}); LF or CRLF. */
export class SseParser {
  constructor() {
    this.buf = "";
    this.frame = { id: null, event: null, data: [] };
  }

  /** Feeds text; returns the frames it completed. */
  push(text) {
    this.buf += text;
    const out = [];
    let nl = this.buf.indexOf("\n");
    while (nl >= 0) {
      let line = this.buf.slice(0, nl);
      this.buf = this.buf.slice(nl + 1);
      if (line.endsWith("\r")) line = line.slice(0, -1);
      if (line === "") {
        const f = this.frame;
        if (f.data.length) out.push({ id: f.id, event: f.event || "message", data: f.data.join("\n") });
        this.frame = { id: null, event: null, data: [] };
      } else if (!line.startsWith(":")) {
        const colon = line.indexOf(":");
        const name = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (name === "data") this.frame.data.push(value);
        else if (name === "id") this.frame.id = value;
        else if (name === "event") this.frame.event = value;
      }
      nl = this.buf.indexOf("\n");
    }
    return out;
  }
}

/**
 * Follows one SSE stream of the API until `stop()` or until `handlers.frame` returns
 * "end" (the run's terminal event).
 *   url(): the path to (re)connect to; lastId: the Last-Event-ID to resume after.
 *   handlers.frame({id, event, data, arrived}) for each frame (data parsed);
 *   handlers.batch() after the frames of one read (render once per read);
 *   handlers.state(state, detail): "connecting", "live", "reconnecting" (detail: the
 *     error and when it began), "refused" (an ApiError: the stream will not come),
 *     "ended".
 */
export class Follower {
  constructor(url, handlers, lastId = "") {
    this.url = url;
    this.handlers = handlers;
    this.lastId = lastId;
    this.ctrl = null;
    this.stopped = false;
    this.failures = 0;
    this.downSince = 0;
  }

  start() {
    this.loop();
    return this;
  }

  stop() {
    this.stopped = true;
    if (this.ctrl) this.ctrl.abort();
  }

  async loop() {
    const { handlers } = this;
    handlers.state("connecting");
    while (!this.stopped) {
      let ended = false;
      try {
        ended = await this.once();
      } catch (e) {
        if (this.stopped) return;
        if (e && e.fatal) {
          handlers.state("refused", e);
          return;
        }
        if (!this.downSince) this.downSince = Date.now();
        handlers.state("reconnecting", { error: e, since: this.downSince });
      }
      if (this.stopped) return;
      if (ended) {
        handlers.state("ended");
        return;
      }
      const wait = BACKOFF_MS[Math.min(this.failures, BACKOFF_MS.length - 1)];
      this.failures += 1;
      await new Promise((r) => setTimeout(r, wait));
    }
  }

  // One connection: true when the stream ended with the run.
  async once() {
    const ctrl = new AbortController();
    this.ctrl = ctrl;
    let silence = setTimeout(() => ctrl.abort(), SILENCE_MS);
    try {
      const headers = { Accept: "text/event-stream" };
      if (this.lastId) headers["Last-Event-ID"] = this.lastId;
      const res = await raw(this.url(), { headers, signal: ctrl.signal });
      if (!res.ok) {
        const err = await refusal(res);
        // A refusal that waiting will not change: stop; others (busy, 5xx): retry.
        err.fatal = [400, 401, 403, 404].includes(res.status);
        if (res.status === 401) api.onUnauthorized();
        throw err;
      }
      this.failures = 0;
      this.downSince = 0;
      this.handlers.state("live");
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      const parser = new SseParser();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return false; // the bridge closed it: go on from the last id
        clearTimeout(silence);
        silence = setTimeout(() => ctrl.abort(), SILENCE_MS);
        const arrived = performance.now();
        let end = false;
        for (const f of parser.push(decoder.decode(value, { stream: true }))) {
          let data;
          try {
            data = JSON.parse(f.data);
          } catch {
            continue; // not the API's frame
          }
          if (f.id) this.lastId = f.id;
          if (this.handlers.frame({ id: f.id, event: f.event, data, arrived }) === "end") end = true;
          if (this.stopped) return true;
        }
        this.handlers.batch();
        if (end) {
          ctrl.abort();
          return true;
        }
      }
    } finally {
      clearTimeout(silence);
    }
  }
}
