// kvmosaic web demo: plain JS against the JSON API (POST /ask, /documents, /admin/*).
"use strict";

const $ = (id) => document.getElementById(id);
const COMPARE_MODES = ["full", "cacheblend", "cachecraft"];
let modes = [];

// -- helpers -------------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

function showError(box, message) {
  box.textContent = message || "";
  box.hidden = !message;
}

async function api(path, options = {}) {
  const response = await fetch(path, options);
  const body = response.status === 204 ? null : await response.json().catch(() => null);
  if (!response.ok) {
    const message = body && body.error ? body.error.message : `HTTP ${response.status}`;
    throw new Error(response.status === 503 ? `${message} (server busy)` : message);
  }
  return body;
}

const ms = (value) => (value < 10 ? value.toFixed(1) : Math.round(value)) + " ms";

// -- tabs ----------------------------------------------------------------------------------

function showTab(name) {
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.dataset.tab === name);
  for (const tab of document.querySelectorAll(".tab")) tab.hidden = tab.id !== `tab-${name}`;
  if (name === "documents") loadDocuments();
}

// -- ask -----------------------------------------------------------------------------------

function askBody(question, mode, stream) {
  return {
    question, mode, stream, explain: true,
    top_k: Number($("top-k").value) || undefined,
    max_tokens: Number($("max-tokens").value) || undefined,
    // learned packets are served at fidelity fast only (the server says why otherwise)
    ...($("packets").checked ? { packets: true, fidelity: "fast" } : {}),
    // so are neighbour-conditioned bases
    ...($("conditioned").checked ? { conditioned: true, fidelity: "fast" } : {}),
    // and APE's reading of the chunks
    ...($("ape").checked ? { ape: true, fidelity: "fast" } : {}),
  };
}

function conditionedText(chunks) {
  const read = chunks.filter((c) => c.variant === "conditioned base").length;
  return `${read} of ${chunks.length} chunks read from their conditioned bases`;
}

async function* sseEvents(response) {
  // Parse "event: x\ndata: {...}\n\n" frames from a fetch body.
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message", data = "";
      for (const line of frame.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data += line.slice(5).trim();
      }
      if (data) yield { event, data: JSON.parse(data) };
    }
  }
}

async function ask(event) {
  event.preventDefault();
  const button = $("ask-button"), answer = $("answer");
  showError($("ask-error"), "");
  button.disabled = true;
  answer.textContent = "";
  $("timings").replaceChildren();
  $("chunks-card").hidden = true;
  $("answer-card").hidden = false;
  $("answer-mode").textContent = $("mode").value;
  try {
    const stream = $("stream").checked;
    const body = askBody($("question").value, $("mode").value, stream);
    if (!stream) return renderReport(await api("/ask", jsonPost(body)));
    answer.classList.add("streaming");
    const response = await fetch("/ask", jsonPost(body));
    if (!response.ok) await api("/ask", jsonPost({ ...body, stream: false }));  // surfaces the error
    for await (const { event, data } of sseEvents(response)) {
      if (event === "piece") answer.textContent += data.text;
      else if (event === "report") renderReport(data);
      else if (event === "error") throw new Error(data.error.message);
    }
  } catch (error) {
    showError($("ask-error"), error.message);
    $("answer-card").hidden = !$("answer").textContent;
  } finally {
    answer.classList.remove("streaming");
    button.disabled = false;
  }
}

function jsonPost(body) {
  return { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
}

function renderReport(report) {
  $("answer").textContent = report.answer;
  $("answer-mode").textContent = report.mode + (report.fallback_reason ? " (fell back to full)" : "");
  const t = report.timings;
  const facts = [["TTFT", ms(t.ttft_ms)], ["retrieve", ms(t.retrieve_ms)], ["load", ms(t.load_ms)],
                 ["prefill", ms(t.prefill_ms)], ["decode", ms(t.decode_ms)], ["total", ms(t.total_ms)],
                 ["recomputed", `${report.usage.recomputed_tokens} / ${report.usage.context_tokens} tokens`]];
  if (report.guard) facts.push(["fidelity", guardText(report.guard)]);
  if (report.order) facts.push(["order", orderText(report.order)]);
  if (report.packets) facts.push(["packets", "each chunk read between the learned packets"]);
  if (report.conditioned) facts.push(["conditioned", conditionedText(report.chunks)]);
  if (report.ape) facts.push(["APE", "the question and the answer read the chunks by APE's knobs"]);
  $("timings").replaceChildren(...facts.map(([k, v]) => el("div", {}, el("dt", {}, k), el("dd", {}, v))));
  $("chunks").replaceChildren(...report.chunks.map(renderChunk));
  $("chunks-card").hidden = report.chunks.length === 0;
}

// What the fidelity guard estimated and spent (engine/guard.py), in one line.
function guardText(guard) {
  const parts = [guard.fidelity];
  if (guard.estimate) parts.push(guard.estimate);
  else if (guard.margin !== null) parts.push(`first-token margin ${guard.margin.toFixed(2)}`);
  if (guard.escalated) parts.push(`re-ran in full (${ms(guard.spent_ms)})`);
  if (guard.repaired_at !== null && guard.repaired_at !== undefined) {
    parts.push(`from token ${guard.repaired_at} full prefill (${ms(guard.repair_ms)})`);
  }
  return parts.join(" · ");
}

// The chunk order used and how the context tokens were served (docs/chunk-order.md).
function orderText(order) {
  return `${order.rule} · exact ${order.exact_tokens} · blended ${order.blended_tokens} · computed ${order.computed_tokens} tokens`;
}

function renderChunk(chunk) {
  const stopped = chunk.stopped_layer !== null && chunk.stopped_layer !== undefined;
  const header = el("header", {},
    el("strong", {}, chunk.document),
    el("span", {}, `rank ${chunk.rank ?? "-"}`),
    el("span", {}, `score ${chunk.score.toFixed(3)}`),
    el("span", {}, chunk.strategy),
    el("span", {}, `reused ${chunk.reused} · recomputed ${chunk.recomputed}`),
    el("span", {}, `variant ${chunk.variant}`));
  if (stopped) header.append(el("span", { class: "pill stop" }, `stopped at layer ${chunk.stopped_layer}`));
  if (chunk.exact) header.append(el("span", { class: "pill" }, "exact"));
  return el("li", { class: "chunk" + (stopped ? " stopped" : ""), "data-chunk": chunk.chunk_id },
            header, renderTokens(chunk));
}

function renderTokens(chunk) {
  const box = el("div", { class: "text" });
  if (!chunk.token_texts) { box.textContent = chunk.text; return box; }
  const recomputed = new Set(chunk.recomputed_offsets || []);
  chunk.token_texts.forEach((piece, i) => box.append(recomputed.has(i) ? el("mark", { class: "re" }, piece) : piece));
  return box;
}

// -- compare -------------------------------------------------------------------------------

async function compare(event) {
  event.preventDefault();
  const button = $("compare-button"), results = $("compare-results");
  showError($("compare-error"), "");
  button.disabled = true;
  const chosen = [...document.querySelectorAll("#compare-modes input:checked")].map((box) => box.value);
  const cards = Object.fromEntries(chosen.map((mode) => [mode, compareCard(mode)]));
  results.replaceChildren(...Object.values(cards).map((c) => c.root));
  const reports = {};
  try {
    for (const mode of chosen) {  // one after another, so each mode has the machine to itself
      const body = { question: $("compare-question").value, mode, explain: false, stream: false };
      reports[mode] = await api("/ask", jsonPost(body));
      fillCompare(cards, reports);
    }
  } catch (error) {
    showError($("compare-error"), error.message);
  } finally {
    button.disabled = false;
  }
}

function compareCard(mode) {
  const bar = el("div", { class: `bar ${mode}` });  // starts at width 0 (style.css): the CSP refuses style attributes
  const ttft = el("div", { class: "ttft" }, "waiting…");
  const answer = el("p", { class: "answer" });
  const root = el("article", { class: "card", "data-mode": mode }, el("h2", {}, mode), bar, ttft, answer);
  return { root, bar, ttft, answer };
}

function fillCompare(cards, reports) {
  const slowest = Math.max(...Object.values(reports).map((r) => r.timings.ttft_ms));
  const full = reports.full ? reports.full.timings.ttft_ms : null;
  for (const [mode, report] of Object.entries(reports)) {
    const card = cards[mode], t = report.timings.ttft_ms;
    card.bar.style.width = `${Math.max(1, (100 * t) / slowest)}%`;
    const speedup = full && mode !== "full" ? ` · ${(full / t).toFixed(1)}× faster than full` : "";
    card.ttft.textContent = `TTFT ${ms(t)} · recomputed ${(100 * report.usage.recompute_share).toFixed(0)}%${speedup}`;
    card.answer.textContent = report.answer;
  }
}

// -- documents -----------------------------------------------------------------------------

async function loadDocuments() {
  try {
    const list = await api("/documents?limit=200");
    $("doc-count").textContent = list.total;
    $("doc-rows").replaceChildren(...list.documents.map((doc) => {
      const remove = el("button", { class: "link", type: "button" }, "delete");
      remove.addEventListener("click", () => deleteDocument(doc.id));
      return el("tr", {}, el("td", {}, doc.id), el("td", {}, doc.title), el("td", { class: "num" }, doc.num_chunks),
                el("td", {}, doc.source), el("td", {}, remove));
    }));
  } catch (error) {
    $("doc-count").textContent = "?";
  }
}

async function addDocument(event) {
  event.preventDefault();
  const status = $("doc-status"), file = $("doc-file").files[0];
  status.hidden = false;
  status.textContent = "Ingesting (chunking, embedding, computing KV)…";
  try {
    let result;
    if (file) {
      const form = new FormData();
      form.append("file", file);
      if ($("doc-title").value) form.append("title", $("doc-title").value);
      result = await api("/documents", { method: "POST", body: form, headers: writeHeaders() });
    } else {
      const request = jsonPost({ text: $("doc-text").value, title: $("doc-title").value || null });
      result = await api("/documents", { ...request, headers: { ...request.headers, ...writeHeaders() } });
    }
    status.textContent = result.created
      ? `Added “${result.document.title}”: ${result.document.num_chunks} chunks in ${result.seconds.toFixed(1)} s.`
      : `Already present as document ${result.document.id}.`;
    $("doc-form").reset();
    loadDocuments();
  } catch (error) {
    status.textContent = `Not added: ${error.message}`;
  }
}

async function deleteDocument(id) {
  if (!confirm(`Delete document ${id}, its chunks and cached KV?`)) return;
  await api(`/documents/${id}`, { method: "DELETE", headers: writeHeaders() }).catch((error) => alert(error.message));
  loadDocuments();
}

// Document writes: a server with KVMOSAIC_WRITE_TOKEN set wants a bearer token; the admin
// token is accepted too, so the token typed in the Admin tab is sent when there is one.
// Without a write token the server accepts writes from this machine and no header is needed.
function writeHeaders() {
  const token = $("admin-token").value || sessionStorage.getItem("kvmosaic-admin-token") || "";
  return token ? { Authorization: `Bearer ${token}` } : {};
}

// -- admin ---------------------------------------------------------------------------------

function adminHeaders() {
  const token = $("admin-token").value;
  sessionStorage.setItem("kvmosaic-admin-token", token);
  return { Authorization: `Bearer ${token}` };
}

async function loadStats(event) {
  if (event) event.preventDefault();
  showError($("admin-error"), "");
  try {
    const stats = await api("/admin/stats", { headers: adminHeaders() });
    $("tier-rows").replaceChildren(...Object.entries(stats.tiers).map(([tier, s]) => el("tr", {},
      el("td", {}, tier), el("td", { class: "num" }, s.entries), el("td", { class: "num" }, bytes(s.bytes)),
      el("td", { class: "num" }, s.capacity_bytes === null ? "–" : bytes(s.capacity_bytes)),
      el("td", { class: "num" }, s.hit_rate === null ? "–" : `${(100 * s.hit_rate).toFixed(0)}%`))));
    const share = stats.mean_recompute_share;
    const facts = [["documents", stats.documents], ["chunks", stats.chunks], ["variants ready", stats.variants.ready],
                   ["variants missing", stats.variants.missing], ["requests", stats.requests.answered],
                   ["mean recompute", share === null ? "–" : `${(100 * share).toFixed(1)}%`], ["model", stats.model]];
    $("admin-facts").replaceChildren(...facts.map(([k, v]) => el("div", {}, el("dt", {}, k), el("dd", {}, v))));
    $("admin-stats").hidden = false;
  } catch (error) {
    $("admin-stats").hidden = true;
    showError($("admin-error"), error.message);
  }
}

async function clearCache() {
  if (!confirm("Drop every cached KV? Chunks will be recomputed on their next use.")) return;
  try {
    await api("/admin/cache", { method: "DELETE", headers: adminHeaders() });
    loadStats();
  } catch (error) {
    showError($("admin-error"), error.message);
  }
}

const bytes = (n) => (n < 1024 ? `${n} B` : n < 1 << 20 ? `${(n / 1024).toFixed(1)} KiB` : `${(n / (1 << 20)).toFixed(1)} MiB`);

// -- start ---------------------------------------------------------------------------------

async function start() {
  for (const link of document.querySelectorAll("nav a")) {
    link.addEventListener("click", (event) => { event.preventDefault(); showTab(link.dataset.tab); history.replaceState(null, "", `#${link.dataset.tab}`); });
  }
  $("ask-form").addEventListener("submit", ask);
  $("compare-form").addEventListener("submit", compare);
  $("doc-form").addEventListener("submit", addDocument);
  $("admin-form").addEventListener("submit", loadStats);
  $("clear-cache").addEventListener("click", clearCache);
  $("admin-token").value = sessionStorage.getItem("kvmosaic-admin-token") || "";
  const info = await api("/modes");
  modes = info.modes;
  $("mode").replaceChildren(...modes.map((m) => el("option", m === info.default ? { selected: "" } : {}, m)));
  $("top-k").value = info.top_k;
  $("max-tokens").value = info.max_tokens;
  $("packets-option").hidden = !info.packets;  // the server has learned packets
  $("packets-option").title = `modes: ${info.packet_modes.join(", ")}`;
  $("conditioned-option").hidden = !info.conditioned;  // the server conditions bases
  if (info.conditioned) {
    const c = info.conditioned;
    $("conditioned-option").title = `each chunk's KV computed after the first ${c.lead_tokens} ` +
      `tokens of its ${c.neighbours} nearest chunks; modes: ${info.packet_modes.join(", ")}`;
  }
  $("ape-option").title = `APE: logits on the chunks divided by ${info.ape.temperature}, ` +
    `their total attention scaled by ${info.ape.scale}; modes: ${info.packet_modes.join(", ")}`;
  $("compare-modes").replaceChildren(...modes.map((m) => el("label", {},
    el("input", Object.assign({ type: "checkbox", value: m }, COMPARE_MODES.includes(m) ? { checked: "" } : {})), m)));
  document.body.dataset.ready = "1";
  showTab(location.hash.slice(1) || "ask");
}

document.addEventListener("DOMContentLoaded", start);
