// Folds each fixture of tests/fixtures/streams/ with server_bridge/host/reducer.mjs, as
// tests/fixtures/streams/build.py `fold` does with reducer.py, and prints one JSON line
// per fixture: {file, out, windows}: `out` the canonical JSON of {runs, refused,
// delivery}, `windows` that of windowRows over each run's snapshot (WINDOWS). Run by
// tests/test_reducer_fixtures.py:
//
//   node tests/js/reduce_fixtures.mjs tests/fixtures/streams/*.json
//   node tests/js/reduce_fixtures.mjs --limits      # the reducer's LIMITS, canonical
//
// Canonical JSON: keys sorted by code point, no spaces, strings as JSON.stringify writes
// them (which is what Python's json.dumps(ensure_ascii=False) writes), numbers as
// JavaScript writes them (the Python side writes its floats the same way).
import { readFileSync } from "node:fs";
import {
  BadEnvelope, LIMITS, Reducer, compareCodePoints, snapshotJson, windowRows,
} from "../../server_bridge/host/reducer.mjs";

// (limit, before) pairs each run's rows are read with; the same in the Python test.
export const WINDOWS = [[2, null], [3, 1], [0, null], [100, 5], [1, 0], [4, 1000]];

export function canonical(value) {
  if (value === null || value === undefined) return "null";
  if (typeof value === "number") {
    if (!Number.isFinite(value)) throw new RangeError("no JSON for " + value);
    return String(value);
  }
  if (typeof value === "boolean" || typeof value === "string") return JSON.stringify(value);
  if (Array.isArray(value)) return "[" + value.map(canonical).join(",") + "]";
  const keys = Object.keys(value).sort(compareCodePoints);
  return "{" + keys.map((k) => JSON.stringify(k) + ":" + canonical(value[k])).join(",") + "}";
}

function fold(fixture) {
  const reducer = new Reducer(fixture.device ?? null);
  const refused = [];
  const delivery = [];
  fixture.steps.forEach((step, n) => {
    if ("event" in step) {
      try {
        reducer.apply(step.event);
      } catch (e) {
        if (!(e instanceof BadEnvelope)) throw e;
        refused.push(n);
      }
    } else if ("markLost" in step) {
      reducer.markLost(...step.markLost);
    } else if ("delivery" in step) {
      delivery.push(reducer.setDelivery(...step.delivery));
    } else {
      throw new Error(`step ${n}: not an event, markLost or delivery`);
    }
  });
  const runs = Object.fromEntries(reducer.runs().map((s) => [s.run, snapshotJson(s)]));
  return { runs, refused, delivery };
}

const args = process.argv.slice(2);
if (args[0] === "--limits") {
  console.log(canonical(LIMITS));
} else {
  for (const file of args) {
    const fixture = JSON.parse(readFileSync(file, "utf8"));
    const got = fold(fixture);
    const windows = Object.fromEntries(Object.entries(got.runs).map(([run, view]) => [
      run, WINDOWS.map(([limit, before]) => windowRows(view, limit, before)),
    ]));
    console.log(JSON.stringify({ file, out: canonical(got), windows: canonical(windows) }));
  }
}
