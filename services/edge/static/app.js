// infermesh playground and console: plain browser JavaScript, no build step, no third-party code.
// Keys typed into the page live in this tab's sessionStorage only (gone when the tab closes).
"use strict";

const $ = (id) => document.getElementById(id);
const store = window.sessionStorage;
const HISTORY = 300;                 // console chart points: 5 minutes at one a second

function authHeaders(which) {
  const key = store.getItem(which) || "";
  return key ? { "Authorization": "Bearer " + key } : {};
}

function text(tag, content, cls) {
  const el = document.createElement(tag);
  if (content !== undefined) el.textContent = content;
  if (cls) el.className = cls;
  return el;
}

async function errorOf(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

// ---- keys and tabs ---------------------------------------------------------------------
function setupKeys() {
  for (const [id, name] of [["api-key", "apiKey"], ["admin-key", "adminKey"]]) {
    const input = $(id);
    input.value = store.getItem(name) || "";
    input.addEventListener("change", () => {
      store.setItem(name, input.value.trim());
      if (name === "apiKey") loadModels();
    });
  }
}

function show(view) {
  for (const name of ["playground", "console"]) {
    $(name).classList.toggle("hidden", name !== view);
    $("tab-" + name).classList.toggle("active", name === view);
  }
  if (view === "console") startConsole(); else stopConsole();
}

// ---- playground ------------------------------------------------------------------------
let sessionId = "";
let models = [];

function newChat() {
  sessionId = "web-" + crypto.randomUUID();
  $("session-id").textContent = sessionId;
  $("transcript").replaceChildren();
  $("playground-status").textContent = "";
}

async function loadModels() {
  const response = await fetch("/v1/models", { headers: authHeaders("apiKey") });
  if (!response.ok) {
    $("playground-status").textContent = "models: " + await errorOf(response);
    return;
  }
  models = (await response.json()).data;
  const select = $("model");
  const chosen = select.value;
  select.replaceChildren(...models.map((m) => text("option", m.id)));
  if (models.some((m) => m.id === chosen)) select.value = chosen;
  $("playground-status").textContent = "";
  fillVersions();
}

function fillVersions() {
  const card = models.find((m) => m.id === $("model").value);
  const select = $("version");
  const options = [text("option", "default" + (card ? " (" + card.version + ")" : ""))];
  options[0].value = "";
  for (const v of (card && card.versions) || []) options.push(text("option", v));
  select.replaceChildren(...options);
}

function metaLine(meta, usage, ttftMs, tokensPerS) {
  const parts = [];
  if (meta) {
    parts.push("replica " + meta.replica, "version " + meta.model_version, "region " + (meta.region || "-"),
               "degraded " + (meta.degraded ? "yes (" + (meta.degraded_by || "") + ")" : "no"),
               "confidence " + meta.confidence);
    if (meta.cached) parts.push("answered from the response cache");
  }
  if (usage) {
    const details = usage.prompt_tokens_details || {};
    parts.push("cached tokens " + (details.cached_tokens || 0) + "/" + usage.prompt_tokens);
  }
  parts.push("TTFT " + (ttftMs === null ? "-" : Math.round(ttftMs) + " ms"));
  parts.push(tokensPerS === null ? "- tok/s" : tokensPerS.toFixed(1) + " tok/s");
  return parts.join(" · ");
}

async function send(event) {
  event.preventDefault();
  const content = $("message").value.trim();
  if (!content) return;
  $("message").value = "";
  $("send").disabled = true;
  $("playground-status").textContent = "";
  $("transcript").append(text("div", content, "turn user"));
  const turn = text("div", undefined, "turn assistant");
  const answer = text("div", "", "text");
  const meta = text("div", "", "meta");
  turn.append(answer, meta);
  $("transcript").append(turn);
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push({ role: "user", content });
  const headers = { "Content-Type": "application/json", "x-session-id": sessionId, ...authHeaders("apiKey") };
  if ($("version").value) headers["x-infermesh-model-version"] = $("version").value;
  const body = { model: $("model").value, messages, temperature: Number($("temperature").value),
                 max_tokens: Number($("max-tokens").value), stream: true, stream_options: { include_usage: true } };
  const started = performance.now();
  let first = null, served = null, usage = null;
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(body) });
    if (!response.ok) throw new Error(await errorOf(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.infermesh) served = chunk.infermesh;
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const piece = (choice.delta && choice.delta.content) || "";
          if (piece && first === null) first = performance.now();
          answer.textContent += piece;
          if (choice.finish_reason === "content_filter") answer.textContent += " [cut by the content policy]";
        }
        turn.scrollIntoView({ block: "end" });
      }
    }
    const end = performance.now();
    const generated = usage ? usage.completion_tokens : 0;
    const rate = first !== null && generated > 1 && end > first ? (generated - 1) / ((end - first) / 1000) : null;
    meta.textContent = metaLine(served, usage, first === null ? null : first - started, rate);
  } catch (err) {
    turn.classList.add("error");
    answer.textContent += (answer.textContent ? "\n" : "") + "Error: " + err.message;
  } finally {
    $("send").disabled = false;
  }
}

// ---- console ---------------------------------------------------------------------------
let timer = null;
const history = { tokens: [], ttft: [] };

function startConsole() {
  if (timer === null) {
    refresh();
    timer = window.setInterval(refresh, 1000);
  }
}

function stopConsole() {
  if (timer !== null) window.clearInterval(timer);
  timer = null;
}

function stateOf(engine) {
  if (!engine.healthy) return "down";
  if (engine.isolation) return "isolated";
  return "up";
}

function cell(content, cls) {
  return text("td", String(content), cls);
}

async function refresh() {
  let state;
  try {
    const response = await fetch("/admin/console", { headers: authHeaders("adminKey") });
    if (!response.ok) {
      $("console-status").textContent = await errorOf(response);
      return;
    }
    state = await response.json();
  } catch (err) {
    $("console-status").textContent = "the edge did not answer: " + err.message;
    return;
  }
  $("console-status").textContent = "";
  $("router-state").textContent = state.ready ? "ready" : "not ready";
  $("entropy").textContent = state.load_entropy.toFixed(3);
  $("ttft").textContent = Math.round(state.ttft_p50_ms) + " / " + Math.round(state.ttft_p95_ms) + " ms";
  const tokens = state.engines.reduce((sum, e) => sum + (e.healthy ? e.tokens_per_s : 0), 0);
  $("tokens").textContent = tokens.toFixed(1);
  $("updated").textContent = new Date().toLocaleTimeString();
  const rows = state.engines.map((e) => {
    const row = document.createElement("tr");
    row.dataset.replica = e.replica;
    const kv = document.createElement("meter");
    kv.min = 0; kv.max = 1; kv.value = e.kv_used; kv.title = Math.round(e.kv_used * 100) + "%";
    const kvCell = document.createElement("td");
    kvCell.append(kv, " " + Math.round(e.kv_used * 100) + "%");
    const s = stateOf(e);
    row.append(cell(e.replica), cell(s + (e.isolation ? ": " + e.isolation : ""), "state " + s),
               cell(e.breaker, "breaker " + e.breaker), cell(e.model), cell(e.model_version), cell(e.region || "-"),
               cell(e.weight, "num"), cell(e.in_flight, "num"), cell(e.running, "num"), cell(e.waiting, "num"),
               kvCell, cell(e.tokens_per_s.toFixed(1), "num"),
               cell((e.tenants || []).map((t) => (t.tenant || "common") + " " + t.running + "+" + t.waiting).join(", ") || "-"),
               cell((e.adapters || []).join(", ") || "-"));
    return row;
  });
  document.querySelector("#replicas tbody").replaceChildren(...rows);
  const events = state.events.slice().reverse().map((ev) => {
    const item = document.createElement("li");
    item.append(text("span", new Date(ev.unix_ms).toLocaleTimeString() + " "), text("span", ev.kind, "kind " + ev.kind),
                text("span", ev.model + (ev.replica ? " on " + ev.replica : "") + ": " + ev.detail));
    return item;
  });
  $("events").replaceChildren(...(events.length ? events : [text("li", "none yet")]));
  push(history.tokens, tokens);
  push(history.ttft, state.ttft_p50_ms);
  chart($("chart-tokens"), history.tokens);
  chart($("chart-ttft"), history.ttft);
}

function push(series, value) {
  series.push(value);
  if (series.length > HISTORY) series.shift();
}

function chart(canvas, series) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 18;
  ctx.clearRect(0, 0, w, h);
  const top = Math.max(1, ...series);
  ctx.strokeStyle = "#d9dee7";
  ctx.beginPath(); ctx.moveTo(pad, h - pad); ctx.lineTo(w, h - pad); ctx.stroke();
  ctx.fillStyle = "#667085";
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText(top.toFixed(top < 10 ? 1 : 0), 2, 12);
  ctx.fillText("0", 2, h - pad);
  if (series.length < 2) return;
  ctx.strokeStyle = "#2f6fed";
  ctx.lineWidth = 2;
  ctx.beginPath();
  series.forEach((v, i) => {
    const x = pad + (w - pad) * i / (series.length - 1);      // the points there are, across the width
    const y = h - pad - (h - 2 * pad) * v / top;
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

// ---- start -----------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  setupKeys();
  $("tab-playground").addEventListener("click", () => show("playground"));
  $("tab-console").addEventListener("click", () => show("console"));
  $("model").addEventListener("change", fillVersions);
  $("new-chat").addEventListener("click", newChat);
  $("composer").addEventListener("submit", send);
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  newChat();
  loadModels();
  if (window.location.hash === "#console") show("console");
});
