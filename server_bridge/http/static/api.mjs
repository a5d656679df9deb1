// The bridge's HTTP API as the dashboard calls it (docs/PROTOCOL.md "HTTP"): the session
// token from sessionStorage as `Authorization: Bearer`, refusals as ApiError with the
// API's kind, and what the page knows of the bridge's own presence (every call that
// reaches it, or fails to, says so).

const TOKEN_KEY = "wren.token";

/** A refusal by the API (`kind` its error kind, `status` the HTTP status), or the
 * bridge out of reach (`kind` "offline", status 0). */
export class ApiError extends Error {
  constructor(status, kind, message) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.kind = kind;
  }
}

export const session = {
  get token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  },
  set token(value) {
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
  },
  /** The token's claims (`ten`, `usr`, `exp`, `role`), read without checking them:
   * only to say who is signed in; the bridge checks the token at every call. */
  claims() {
    const part = this.token.split(".")[0] || "";
    try {
      const bin = atob(part.replace(/-/g, "+").replace(/_/g, "/"));
      return claimsOf(Uint8Array.from(bin, (c) => c.charCodeAt(0)));
    } catch {
      return {};
    }
  },
};

// The claims are a small msgpack map of strings and ints (server_bridge/tokens.py):
// just enough of msgpack to read one.
function claimsOf(b) {
  let at = 0;
  const text = (n) => {
    const s = new TextDecoder().decode(b.subarray(at, at + n));
    at += n;
    return s;
  };
  const uint = (n) => {
    let v = 0;
    for (let k = 0; k < n; k++) v = v * 256 + b[at++];
    return v;
  };
  const value = () => {
    const x = b[at++];
    if (x <= 0x7f) return x;
    if (x >= 0xa0 && x <= 0xbf) return text(x & 0x1f);
    if (x === 0xd9) return text(uint(1));
    if (x === 0xda) return text(uint(2));
    if (x >= 0xcc && x <= 0xcf) return uint(1 << (x - 0xcc));
    if (x >= 0xe0) return x - 256;
    if (x === 0xc2 || x === 0xc3) return x === 0xc3;
    throw new Error("not a claim");
  };
  const head = b[at++];
  if ((head & 0xf0) !== 0x80) return {};
  const out = {};
  for (let k = 0; k < (head & 0x0f); k++) {
    const key = value();
    out[key] = value();
  }
  return out;
}

/** The bridge's presence as this page sees it: "online", "offline" (unreachable) or
 * "connecting" (reached, but it has lost its broker), with since when (ms). */
export const bridge = {
  state: "online",
  since: Date.now(),
  listeners: new Set(),
  set(state) {
    if (state === this.state) return;
    this.state = state;
    this.since = Date.now();
    for (const f of this.listeners) f(this);
  },
  watch(f) {
    this.listeners.add(f);
    return () => this.listeners.delete(f);
  },
};

/** fetch with the token; network failure -> ApiError("offline"). */
export async function raw(path, { method = "GET", body, headers = {}, signal } = {}) {
  const h = { ...headers };
  if (session.token) h.Authorization = `Bearer ${session.token}`;
  if (body !== undefined) h["Content-Type"] = "application/json";
  let res;
  try {
    res = await fetch(path, {
      method, headers: h, signal, cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (e) {
    if (signal?.aborted) throw e;
    bridge.set("offline");
    throw new ApiError(0, "offline", "the bridge cannot be reached");
  }
  if (bridge.state === "offline") bridge.set("online");
  return res;
}

async function refusal(res) {
  let kind = "internal";
  let message = `HTTP ${res.status}`;
  try {
    const obj = await res.json();
    kind = obj.error || kind;
    message = obj.message || message;
  } catch {
    // not the API's JSON: keep the status
  }
  return new ApiError(res.status, kind, message);
}

/** A JSON call; throws ApiError for a refusal. A 401 also tells the page (onUnauthorized). */
export async function call(path, options = {}) {
  const res = await raw(path, options);
  if (!res.ok) {
    const err = await refusal(res);
    if (res.status === 401) api.onUnauthorized();
    throw err;
  }
  return res.json();
}

export { refusal };

const enc = encodeURIComponent;

export const api = {
  onUnauthorized() {},
  devices: () => call("/v1/devices"),
  start: (device, input, conv) => call(`/v1/devices/${enc(device)}/requests`, {
    method: "POST", body: conv ? { input, conv } : { input },
  }),
  answer: (device, run, call_, output, failed = false) =>
    call(`/v1/devices/${enc(device)}/runs/${enc(run)}/tool`, {
      method: "POST", body: { call: call_, output, failed },
    }),
  approve: (device, run, call_, ok) =>
    call(`/v1/devices/${enc(device)}/runs/${enc(run)}/approve`, {
      method: "POST", body: { call: call_, ok },
    }),
  cancel: (device, run) => call(`/v1/devices/${enc(device)}/runs/${enc(run)}/cancel`, {
    method: "POST", body: { reason: "cancelled from the dashboard" },
  }),
  conversations: (q = {}) => call(`/v1/conversations?${new URLSearchParams(q)}`),
  conversation: (conv, q = {}) => call(`/v1/conversations/${enc(conv)}?${new URLSearchParams(q)}`),
  runEventsUrl: (device, run) => `/v1/devices/${enc(device)}/runs/${enc(run)}/events`,
  requestEventsUrl: (device, req) => `/v1/devices/${enc(device)}/requests/${enc(req)}/events`,
  async health() {
    try {
      const res = await fetch("/v1/health", { cache: "no-store" });
      const obj = await res.json();
      bridge.set(obj.bridge === "online" ? "online" : "connecting");
    } catch {
      bridge.set("offline");
    }
  },
};
