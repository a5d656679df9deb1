// The dashboard's entry: sign-in, the bridge's presence, and the views by the URL's
// fragment (#/ the fleet, #/device/D, #/run/D/R, #/req/D/REQ, #/conversations,
// #/conv/C). Plain ES modules served by the bridge: nothing is fetched from elsewhere
// and nothing is built.
//
// The session token lives in sessionStorage (this tab only, gone when it closes). It
// comes from the sign-in form or from the fragment `#token=...` of a link `wren token`
// prints: a fragment is never sent to a server, so the token stays out of access logs;
// the page takes it and drops it from the address bar at once.

import { api, bridge, session } from "./api.mjs";
import { ConversationsView, ConversationView } from "./conversations.mjs";
import { clock, fill, h } from "./dom.mjs";
import { DeviceView, FleetStore, FleetView } from "./fleet.mjs";
import { RunView } from "./run.mjs";

const HEALTH_MS = 5000;

const $ = (id) => document.getElementById(id);
const fleet = new FleetStore();
let view = null;
let firstRoute = true;

function announce(text) {
  const box = $("announce");
  box.textContent = "";
  // A change the screen reader notices even when the words repeat.
  setTimeout(() => { box.textContent = text; }, 50);
}

function go(hash, replace = false) {
  if (replace) history.replaceState(null, "", hash);
  else location.hash = hash;
}

const ctx = { fleet, announce, go };

function takeFragmentToken() {
  const m = /^#token=([^&]+)/.exec(location.hash);
  if (!m) return;
  session.token = decodeURIComponent(m[1]);
  history.replaceState(null, "", `${location.pathname}#/`);
}

function drawBridge() {
  const box = $("bridge");
  if (bridge.state === "online") fill(box, h("span", { class: "badge pr-online" }, "bridge online"));
  else if (bridge.state === "connecting") {
    fill(box, h("span", { class: "badge pr-offline" }, "bridge reconnecting to its broker"), " since ", clock(bridge.since, true));
  } else fill(box, h("span", { class: "badge pr-offline" }, "bridge offline"), " since ", clock(bridge.since, true));
}

function showLogin(message = "") {
  if (view) view.destroy();
  view = null;
  fleet.stop();
  $("login").hidden = false;
  $("nav").hidden = true;
  $("signout").hidden = true;
  fill($("who"));
  $("login-error").textContent = message;
  document.title = "Sign in — Wren";
  $("token").focus();
}

function signOut(message = "") {
  session.token = "";
  showLogin(message);
}

function showApp() {
  $("login").hidden = true;
  $("nav").hidden = false;
  $("signout").hidden = false;
  const c = session.claims();
  fill($("who"), "Signed in as ", h("strong", null, c.usr || "?"),
    c.ten ? [" of ", h("strong", null, c.ten)] : null, c.role === "watch" ? " (watcher)" : "");
  fleet.start();
  route();
}

function route() {
  if (!session.token) return showLogin();
  const hash = location.hash || "#/";
  if (!hash.startsWith("#/")) return; // an in-page link (skip to content)
  const parts = hash.slice(2).split("/").map((p) => decodeURIComponent(p));
  if (view) view.destroy();
  view = null;
  const [what, a, b] = parts;
  if (what === "device" && a) view = new DeviceView(ctx, a);
  else if (what === "run" && a && b) view = new RunView(ctx, { device: a, run: b }).start();
  else if (what === "req" && a && b) view = new RunView(ctx, { device: a, req: b }).start();
  else if (what === "conversations") view = new ConversationsView(ctx);
  else if (what === "conv" && a) view = new ConversationView(ctx, a);
  else view = new FleetView(ctx);
  if (!(view instanceof RunView)) document.title = "Wren";
  fill($("view"), view.el);
  for (const link of document.querySelectorAll("#nav a")) {
    const here = (link.getAttribute("href") === "#/" && (what === "" || what === undefined)) ||
      link.getAttribute("href") === `#/${what}`;
    if (here) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  // Where the keyboard and a screen reader go after a move: the new view's heading.
  if (!firstRoute) view.el.querySelector("h2")?.focus();
  firstRoute = false;
}

async function signIn(e) {
  e.preventDefault();
  const token = $("token").value.trim();
  if (!token) return;
  session.token = token;
  try {
    await api.devices();
  } catch (err) {
    session.token = "";
    $("login-error").textContent = err.status === 401
      ? "That token is not valid (or has expired)."
      : `The bridge could not check it: ${err.message}`;
    return;
  }
  $("token").value = "";
  showApp();
}

function main() {
  takeFragmentToken();
  api.onUnauthorized = () => signOut("Your session has ended, or the token is not valid: sign in again.");
  $("login-form").addEventListener("submit", signIn);
  $("signout").addEventListener("click", () => signOut());
  window.addEventListener("hashchange", () => {
    takeFragmentToken();
    if (session.token) route();
  });
  bridge.watch(drawBridge);
  drawBridge();
  api.health();
  setInterval(() => api.health(), HEALTH_MS);
  if (session.token) showApp();
  else showLogin();
}

main();
