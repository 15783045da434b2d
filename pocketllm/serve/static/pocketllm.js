// pocketllm's web page: a streamed completion from /v1/completions (stream, logprobs=5), each token
// shaded by its probability with its top alternatives on hover, the response's system_fingerprint,
// and a panel polling /metrics (Prometheus' text format). Plain JavaScript, no build step, no
// network beyond this server. Paths are relative, so the page works behind a path prefix.
"use strict";

const TOP_LOGPROBS = 5;
const METRICS_EVERY_MS = Number(new URLSearchParams(location.search).get("metrics_ms")) || 1000;
const $ = (id) => document.getElementById(id);

// -- the API key: asked for only once the server answers 401 ------------------------------------

const KEY_STORE = "pocketllm.apiKey";

function apiKey() {
  return $("api-key").value.trim();
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

function askForKey(message) {
  $("key-row").hidden = false;
  $("api-key").focus();
  showStatus(message, true);
}

// -- model name ---------------------------------------------------------------------------------

let modelName = null;

async function loadModel() {
  const response = await fetch("v1/models", { headers: headers() });
  if (response.status === 401) {
    $("model").textContent = "(API key needed)";
    askForKey(`${await errorMessage(response)} — this server needs its API key: enter it above.`);
    return false;
  }
  if (!response.ok) throw new Error(await errorMessage(response));
  modelName = (await response.json()).data[0].id;
  $("model").textContent = modelName;
  return true;
}

// -- status and errors ---------------------------------------------------------------------------

function showStatus(text, isError = false) {
  const status = $("status");
  status.textContent = text;
  status.classList.toggle("error", isError);
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

// -- tokens ----------------------------------------------------------------------------------------

// A token's text made visible: whitespace and control characters as escapes.
function visible(text) {
  return JSON.stringify(text).slice(1, -1) || "∅";
}

function percent(logprob) {
  const p = Math.exp(logprob);
  return p >= 0.995 ? "100%" : p < 0.0005 ? "<0.1%" : `${(100 * p).toFixed(1)}%`;
}

// Renders one choice's chunks as spans. A span is a piece of text and the positions (token, its
// logprob, its alternatives) that produced it: one per token where the tokens spell the chunk's
// text, else the chunk's positions together (a token inside a multibyte character has no text of
// its own; its position waits for the chunk whose text completes the character).
class TokenView {
  constructor(container) {
    this.container = container;
    this.pending = [];
    this.count = 0;
  }

  add(text, logprobs) {
    const positions = [];
    if (logprobs) {
      logprobs.tokens.forEach((token, i) => positions.push({
        token, logprob: logprobs.token_logprobs[i], top: logprobs.top_logprobs[i] || {},
      }));
    }
    this.count += positions.length;
    if (!this.pending.length && positions.length && positions.map((p) => p.token).join("") === text) {
      positions.forEach((position) => this.span(position.token, [position]));
      return;
    }
    this.pending.push(...positions);
    if (text) {
      this.span(text, this.pending);
      this.pending = [];
    }
  }

  // Positions that never got text (an end-of-text token, a character cut short): a marker span.
  finish() {
    if (this.pending.length) this.span("", this.pending).classList.add("textless");
    this.pending = [];
  }

  span(text, positions) {
    const span = document.createElement("span");
    span.className = "tok";
    span.textContent = text;
    span.tabIndex = 0;
    const logprob = positions.reduce((sum, p) => sum + (p.logprob ?? 0), 0);
    span.style.setProperty("--p", Math.exp(logprob).toFixed(4));
    span.dataset.logprobs = positions.map((p) => String(p.logprob)).join(" ");
    span.positions = positions;
    this.container.appendChild(span);
    return span;
  }
}

function showTooltip(span) {
  const tooltip = $("tooltip");
  tooltip.replaceChildren();
  for (const position of span.positions) {
    const table = document.createElement("table");
    const caption = table.createCaption();
    const logprob = position.logprob ?? NaN;
    caption.textContent = `${visible(position.token)}  ${percent(logprob)}  (logprob ${logprob.toFixed(4)})`;
    const alternatives = Object.entries(position.top).sort((a, b) => b[1] - a[1]);
    for (const [token, logprob] of alternatives) {
      const row = table.insertRow();
      row.className = token === position.token ? "alt chosen" : "alt";
      row.insertCell().textContent = visible(token);
      row.insertCell().textContent = percent(logprob);
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.width = `${(100 * Math.exp(logprob)).toFixed(1)}%`;
      row.insertCell().appendChild(bar);
    }
    tooltip.appendChild(table);
  }
  tooltip.hidden = false;
  const box = span.getBoundingClientRect();
  const left = Math.min(box.left + window.scrollX, window.scrollX + document.documentElement.clientWidth
    - tooltip.offsetWidth - 8);
  tooltip.style.left = `${Math.max(window.scrollX + 4, left)}px`;
  tooltip.style.top = `${box.bottom + window.scrollY + 4}px`;
}

function hideTooltip() {
  $("tooltip").hidden = true;
}

// -- the completion, streamed -------------------------------------------------------------------

let running = null; // the AbortController of the request in flight

// Server-sent events from a fetch response: each `data:` payload, parsed ([DONE] ends them).
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (!data.length) continue;
      if (data.join("\n") === "[DONE]") return;
      yield JSON.parse(data.join("\n"));
    }
  }
}

function requestBody() {
  const body = {
    prompt: $("prompt").value, stream: true, logprobs: TOP_LOGPROBS,
    max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if (modelName) body.model = modelName;
  return body;
}

function setRunning(controller) {
  running = controller;
  $("submit").disabled = controller !== null;
  $("stop").disabled = controller === null;
}

async function generate() {
  if (modelName === null && !(await loadModel())) return;
  const output = $("output");
  const view = new TokenView($("completion"));
  $("completion").replaceChildren();
  $("echo").textContent = $("prompt").value;
  for (const id of ["fingerprint", "finish", "count"]) $(id).textContent = "—";
  hideTooltip();
  output.dataset.state = "running";
  showStatus("generating…");
  const controller = new AbortController();
  setRunning(controller);
  try {
    const response = await fetch("v1/completions", {
      method: "POST", body: JSON.stringify(requestBody()), signal: controller.signal,
      headers: headers({ "Content-Type": "application/json" }),
    });
    if (response.status === 401) {
      askForKey(`${await errorMessage(response)} — enter the server's API key above.`);
      output.dataset.state = "error";
      return;
    }
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(`${chunk.error.code}: ${chunk.error.message}`);
      $("fingerprint").textContent = chunk.system_fingerprint;
      for (const choice of chunk.choices) {
        view.add(choice.text, choice.logprobs);
        if (choice.finish_reason) $("finish").textContent = choice.finish_reason;
      }
      $("count").textContent = String(view.count);
    }
    view.finish();
    output.dataset.state = "done";
    showStatus(`done: ${view.count} tokens`);
  } catch (error) {
    view.finish();
    output.dataset.state = controller.signal.aborted ? "stopped" : "error";
    showStatus(controller.signal.aborted ? "stopped" : String(error.message || error), !controller.signal.aborted);
  } finally {
    setRunning(null);
  }
}

// -- metrics ---------------------------------------------------------------------------------------

// Prometheus' text format: `name{labels} value [timestamp]` lines; # HELP/# TYPE lines skipped.
// Returns {"name" or "name{labels}": value}.
function parsePrometheus(text) {
  const samples = {};
  for (const line of text.split("\n")) {
    const match = /^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)/.exec(line.trim());
    if (!match) continue;
    const raw = match[3];
    const value = raw === "+Inf" ? Infinity : raw === "-Inf" ? -Infinity : Number(raw);
    samples[match[1] + (match[2] || "")] = value;
  }
  return samples;
}

let lastGenerated = null; // {count, at}: the counter at the previous scrape

function showNumber(id, value, digits = 0) {
  $(id).textContent = Number.isFinite(value) ? value.toFixed(digits) : "—";
}

async function pollMetrics() {
  if (document.hidden) return;
  try {
    const response = await fetch("metrics", { headers: headers() });
    if (!response.ok) throw new Error(await errorMessage(response));
    const m = parsePrometheus(await response.text());
    const runningNow = m.pocketllm_running;
    showNumber("m-running", runningNow);
    showNumber("m-waiting", m.pocketllm_waiting);
    // A running request holds one slot: the slots are those held and those free.
    const total = runningNow + m.pocketllm_free_slots;
    $("m-slots").textContent = Number.isFinite(total) ? `${runningNow} / ${total}` : "—";
    const generated = m.pocketllm_generated_tokens_total;
    showNumber("m-generated", generated);
    const now = performance.now();
    if (lastGenerated && generated >= lastGenerated.count && now > lastGenerated.at) {
      showNumber("m-rate", (generated - lastGenerated.count) / ((now - lastGenerated.at) / 1000), 1);
    }
    lastGenerated = Number.isFinite(generated) ? { count: generated, at: now } : null;
    $("m-status").textContent = `updated ${new Date().toLocaleTimeString()}`;
    $("m-status").classList.remove("error");
  } catch (error) {
    $("m-status").textContent = `unreachable: ${error.message || error}`;
    $("m-status").classList.add("error");
  }
}

// -- wiring ----------------------------------------------------------------------------------------

function init() {
  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY_STORE) || "";
  if (key.value) $("key-row").hidden = false;
  key.addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORE, apiKey());
    if (modelName === null) loadModel().catch((error) => showStatus(String(error.message || error), true));
  });
  $("form").addEventListener("submit", (event) => {
    event.preventDefault();
    if (!running) generate();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("form").requestSubmit();
  });
  $("stop").addEventListener("click", () => running && running.abort());
  const completion = $("completion");
  for (const [type, show] of [["mouseover", true], ["focusin", true], ["mouseout", false], ["focusout", false]]) {
    completion.addEventListener(type, (event) => {
      const span = event.target.closest && event.target.closest(".tok");
      if (!span) return;
      if (show) showTooltip(span);
      else hideTooltip();
    });
  }
  loadModel().catch((error) => showStatus(String(error.message || error), true));
  pollMetrics();
  setInterval(pollMetrics, METRICS_EVERY_MS);
}

init();
