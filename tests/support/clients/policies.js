// The tube policies seen by an unchanged Node client (fivebeans), for
// tests/procs/test_policies.py: node policies.js FIVEBEANS_DIR PORT.
// Prints one JSON object of what the client saw.
"use strict";
const fivebeans = require(process.argv[2]);
const port = Number(process.argv[3]);

function connect() {
  return new Promise((resolve, reject) => {
    const c = new fivebeans.client("127.0.0.1", port);
    c.on("connect", () => resolve(c)).on("error", reject);
    c.connect();
  });
}

// A fivebeans call as a promise: its results, or {err} (TIMED_OUT is an error there).
function call(c, method, ...args) {
  return new Promise((resolve) => {
    c[method](...args, (err, ...results) => resolve(err ? { err: String(err) } :
      results.map((x) => (Buffer.isBuffer(x) ? x.toString() : x))));
  });
}

async function watching(tube) {
  const c = await connect();
  await call(c, "use", tube);
  await call(c, "watch", tube);
  await call(c, "ignore", "default");
  return c;
}

(async () => {
  const out = {};
  // Attempt limit: the TTR runs out twice, then the job is buried.
  const a = await watching("flaky-node");
  const [id] = await call(a, "put", 0, 0, 1, "node job");
  out.first = await call(a, "reserve_with_timeout", 5);
  const b = await watching("flaky-node");
  out.second = await call(b, "reserve_with_timeout", 10);
  const c = await watching("flaky-node");
  out.third = await call(c, "reserve_with_timeout", 4);
  [out.stats] = await call(a, "stats_job", id);
  // Concurrency: two reserved at once, a third worker waits until one is deleted.
  const p = await watching("narrow-node");
  for (let i = 0; i < 4; i++) await call(p, "put", 0, 0, 60, "n" + i);
  const w = [await watching("narrow-node"), await watching("narrow-node"),
             await watching("narrow-node")];
  out.held = [await call(w[0], "reserve_with_timeout", 1), await call(w[1], "reserve_with_timeout", 1)];
  out.refused = await call(w[2], "reserve_with_timeout", 1);
  const t0 = Date.now();
  const waiting = call(w[2], "reserve_with_timeout", 20);
  setTimeout(() => call(w[0], "destroy", out.held[0][0]), 500);
  out.woken = await waiting;
  out.waited_ms = Date.now() - t0;
  console.log(JSON.stringify(out));
  process.exit(0);
})().catch((e) => { console.error(e); process.exit(1); });
