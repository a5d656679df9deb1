// What the page measures of itself, for bench_dashboard.py and for anyone curious (in
// the console: wrenDashboard.stats.summary()): how long from an SSE frame arriving in
// the page to its row being on it, and how long each render took. Rings of fixed size,
// so a page left open for days holds the same few kilobytes.

const SIZE = 4096;

class Ring {
  constructor() {
    this.values = new Float64Array(SIZE);
    this.count = 0;
  }

  push(v) {
    this.values[this.count % SIZE] = v;
    this.count += 1;
  }

  list() {
    const n = Math.min(this.count, SIZE);
    return Array.from(this.values.subarray(0, n));
  }
}

export const stats = {
  latency: new Ring(),
  render: new Ring(),
  rendered(ms) {
    this.latency.push(ms);
  },
  renderTook(ms) {
    this.render.push(ms);
  },
  reset() {
    this.latency = new Ring();
    this.render = new Ring();
  },
  summary() {
    const pick = (ring) => {
      const v = ring.list().sort((a, b) => a - b);
      const at = (q) => (v.length ? v[Math.min(v.length - 1, Math.floor(q * v.length))] : null);
      return { n: ring.count, p50: at(0.5), p99: at(0.99), max: v.length ? v[v.length - 1] : null };
    };
    return { latency: pick(this.latency), render: pick(this.render) };
  },
};

globalThis.wrenDashboard = { stats };
