// Runs the official AG-UI client (@ag-ui/client's HttpAgent) against the bridge's
// AG-UI endpoint, as tests/test_agui.py asks, and prints one JSON line: the event
// types each run saw, the agent's messages, every warning or error the client logged,
// and how each run ended.
//
//   node agui_client.mjs <endpoint url> <token> <scenario> <text>
//
// scenario: "run" (one run), "interrupt" (a run that ends on a client tool's
// interrupt, then a run that resumes it with an answer), "cancel" (a run cancelled
// over the HTTP API while it streams).
import { HttpAgent } from "@ag-ui/client";

const [url, token, scenario, text] = process.argv.slice(2);
const logged = [];
for (const level of ["warn", "error"]) {
  const original = console[level];
  console[level] = (...args) => {
    logged.push(`${level}: ${args.map(String).join(" ")}`);
    original(...args);
  };
}

const agent = new HttpAgent({
  url,
  headers: { Authorization: `Bearer ${token}` },
  threadId: "js-thread",
  initialMessages: [{ id: "u1", role: "user", content: text }],
});

async function run(parameters, onEvent) {
  const seen = [];
  let failed = null;
  let outcome = null;
  let error = null;
  await agent
    .runAgent(parameters, {
      onEvent({ event }) {
        seen.push(event.type);
        if (event.type === "RUN_FINISHED") outcome = event.outcome ?? null;
        if (event.type === "RUN_ERROR") error = { code: event.code ?? null, message: event.message };
        if (onEvent) onEvent(event);
      },
      onRunFailed({ error }) {
        failed = String(error && error.message ? error.message : error);
      },
    })
    .catch((error) => {
      failed = failed ?? String(error && error.message ? error.message : error);
    });
  return { events: seen, outcome, error, failed };
}

const runs = [];
if (scenario === "run") {
  runs.push(await run({ runId: `${scenario}-1` }));
} else if (scenario === "interrupt") {
  runs.push(await run({ runId: `${scenario}-1` }));
  const resume = agent.pendingInterrupts.map((i) => ({
    interruptId: i.id,
    status: "resolved",
    payload: "yes, vent it",
  }));
  runs.push(await run({ runId: `${scenario}-2`, resume }));
} else if (scenario === "cancel") {
  const base = url.replace(/\/v1\/devices\/.*$/, "");
  const device = url.match(/\/v1\/devices\/([^/]+)\//)[1];
  let cancelled = false;
  runs.push(
    await run({ runId: `${scenario}-1` }, (event) => {
      if (event.type === "TEXT_MESSAGE_CONTENT" && !cancelled) {
        cancelled = true;
        const auth = { Authorization: `Bearer ${token}` };
        fetch(`${base}/v1/devices/${device}/requests/${scenario}-1`, { headers: auth })
          .then((r) => r.json())
          .then((r) =>
            fetch(`${base}/v1/devices/${device}/runs/${r.run}/cancel`, {
              method: "POST",
              headers: { ...auth, "content-type": "application/json" },
              body: JSON.stringify({ reason: "enough" }),
            }),
          );
      }
    }),
  );
} else {
  throw new Error(`unknown scenario ${scenario}`);
}

const messages = agent.messages.map((m) => ({
  role: m.role,
  content: typeof m.content === "string" ? m.content : null,
  toolCalls: (m.toolCalls ?? []).map((c) => ({ id: c.id, name: c.function.name, args: c.function.arguments })),
  toolCallId: m.toolCallId ?? null,
}));
process.stdout.write(JSON.stringify({ runs, messages, logged }) + "\n");
