// the page kvblend serve shows at / (see web_page.h): one HTML file, its script
// and its style, served from the binary. The script never builds HTML from
// text: documents, answers and errors go in through textContent.
#include "server/web_page.h"

#include <cstring>

namespace kvblend {

namespace {

const char * k_html = R"KVB(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kvblend</title>
<link rel="stylesheet" href="/kvblend-ui.css">
<script src="/kvblend-ui.js" defer></script>
</head>
<body>
<header>
  <h1>kvblend</h1>
  <span id="model" class="muted">connecting…</span>
  <label class="key">API key <input id="api-key" type="password" autocomplete="off" placeholder="if the server asks for one"></label>
</header>
<div id="error" class="error" role="alert" hidden></div>
<main>
  <section id="documents-panel">
    <h2>Documents</h2>
    <textarea id="doc-text" rows="6" placeholder="Paste a document, or pick text files below"></textarea>
    <div class="row">
      <input id="doc-files" type="file" accept=".txt,.md,text/plain" multiple>
      <button id="add-doc">Add to the store</button>
    </div>
    <p class="muted">Each document is collected once and kept in the server's store; pick the ones a question is asked over.</p>
    <ul id="doc-list"></ul>
  </section>
  <section id="ask-panel">
    <h2>Ask</h2>
    <textarea id="question" rows="3" placeholder="A question over the picked documents"></textarea>
    <div class="row">
      <label>recomputed <input id="ratio" type="range" min="0" max="1" step="0.01" value="0.08"> <output id="ratio-value">0.08</output></label>
      <label><input id="compare" type="checkbox"> compare with a full prefill</label>
      <button id="ask">Ask</button>
    </div>
    <div id="calibration" hidden>
      <h3>Calibration <span id="cal-note" class="muted"></span></h3>
      <svg id="cal-plot" viewBox="0 0 460 190" width="460" height="190" role="img"
           aria-label="top-1 agreement and KL against the recomputed share"></svg>
    </div>
    <div class="answers">
      <div class="answer-box">
        <h3>Fused</h3>
        <pre id="answer" class="answer"></pre>
        <table id="stats" class="stats"></table>
      </div>
      <div class="answer-box" id="full-box" hidden>
        <h3>Full prefill</h3>
        <pre id="full-answer" class="answer"></pre>
        <table id="full-stats" class="stats"></table>
      </div>
    </div>
    <h3>The prompt's documents <span class="muted">(recomputed tokens <mark>marked</mark>)</span></h3>
    <ul id="spans" class="spans"></ul>
  </section>
</main>
</body>
</html>
)KVB";

const char * k_css =
    R"KVB(body { font: 15px/1.45 system-ui, sans-serif; margin: 0; color: #1d1d1f; background: #fafafa; }
header { display: flex; gap: 1em; align-items: baseline; padding: .6em 1.2em; background: #20303f; color: #fff; }
header h1 { font-size: 1.2em; margin: 0; }
header .key { margin-left: auto; font-size: .9em; }
.muted { color: #7a8590; font-size: .9em; }
header .muted { color: #b8c4cf; }
main { display: grid; grid-template-columns: minmax(18em, 1fr) 2fr; gap: 1.2em; padding: 1.2em; }
section { background: #fff; border: 1px solid #dde2e6; border-radius: 6px; padding: .8em 1em; }
h2 { font-size: 1.05em; margin: 0 0 .5em; }
h3 { font-size: .95em; margin: .8em 0 .3em; }
textarea { width: 100%; box-sizing: border-box; font: inherit; }
.row { display: flex; flex-wrap: wrap; gap: .8em; align-items: center; margin: .5em 0; }
button { font: inherit; padding: .3em .9em; }
#doc-list { list-style: none; padding: 0; margin: 0; }
#doc-list li { display: flex; gap: .5em; align-items: baseline; padding: .25em 0; border-top: 1px solid #eef0f2; }
#doc-list .title { flex: 1; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.answers { display: flex; gap: 1em; flex-wrap: wrap; }
.answer-box { flex: 1; min-width: 16em; }
.answer { white-space: pre-wrap; background: #f4f6f8; padding: .6em; min-height: 3em; margin: 0; font: inherit; }
.stats td { padding: .1em .8em .1em 0; font-size: .9em; }
.stats td:first-child { color: #5b6770; }
.spans li { margin: .2em 0; }
.doc-text { white-space: pre-wrap; background: #f4f6f8; padding: .4em .6em; margin: .2em 0 .6em; font-size: .9em; max-height: 14em; overflow: auto; }
mark { background: #ffe08a; }
#cal-plot text { font-size: 11px; }
#cal-plot .axis { fill: #5b6770; }
.hit { color: #1a7f37; }
.miss { color: #b35900; }
.error { margin: .8em 1.2em 0; padding: .6em 1em; background: #fdecec; border: 1px solid #e5a0a0; border-radius: 6px; color: #8a1c1c; }
)KVB";

const char * k_js = R"KVB("use strict";
// kvblend's page: documents into the store, a question over some of them,
// streamed, with what the fusion did. Text only ever goes in through textContent.
const $ = (id) => document.getElementById(id);
const state = { docs: JSON.parse(localStorage.getItem("kvblend.docs") || "[]"), busy: false };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function showError(message) {
  const e = $("error");
  e.textContent = message;
  e.hidden = !message;
}

// a request's error as a sentence: the server's message, or why there is none
async function failure(res) {
  try {
    const body = await res.json();
    const m = body.error && (body.error.message || body.error);
    if (m) return res.status + ": " + m;
  } catch (_) { /* not JSON */ }
  return "the server answered " + res.status;
}

async function call(path, body) {
  let res;
  try {
    res = await fetch(path, body === undefined ? { headers: headers() }
                                               : { method: "POST", headers: headers(), body: JSON.stringify(body) });
  } catch (e) {
    throw new Error("the server cannot be reached (" + e.message + ")");
  }
  if (!res.ok) throw new Error(await failure(res));
  return res;
}

function saveDocs() { localStorage.setItem("kvblend.docs", JSON.stringify(state.docs)); }

function row(table, name, value) {
  const tr = table.insertRow();
  tr.insertCell().textContent = name;
  tr.insertCell().textContent = value;
}

function renderDocs() {
  const list = $("doc-list");
  list.replaceChildren();
  for (const d of state.docs) {
    const li = document.createElement("li");
    const pick = document.createElement("input");
    pick.type = "checkbox";
    pick.checked = d.picked !== false;
    pick.addEventListener("change", () => { d.picked = pick.checked; saveDocs(); });
    const title = document.createElement("span");
    title.className = "title";
    title.textContent = d.title;
    title.title = d.text;
    const info = document.createElement("span");
    info.className = "muted";
    info.textContent = d.n_tokens + " tokens";
    const drop = document.createElement("button");
    drop.textContent = "×";
    drop.title = "forget it here (the store keeps it)";
    drop.addEventListener("click", () => { state.docs = state.docs.filter((x) => x !== d); saveDocs(); renderDocs(); });
    li.append(pick, title, info, drop);
    list.append(li);
  }
}

async function addDocuments() {
  const texts = [];
  const pasted = $("doc-text").value;
  if (pasted.trim()) texts.push(pasted);
  for (const f of $("doc-files").files) texts.push(await f.text());
  if (!texts.length) return showError("paste a document or pick a file first");
  showError("");
  $("add-doc").disabled = true;
  try {
    const res = await call("/v1/documents", { documents: texts.map((text) => ({ text })) });
    const body = await res.json();
    body.data.forEach((d, i) => {
      if (state.docs.some((x) => x.id === d.id)) return;
      const text = texts[i];
      state.docs.push({ id: d.id, n_tokens: d.n_tokens, text, title: text.trim().slice(0, 80), picked: true });
    });
    saveDocs();
    renderDocs();
    $("doc-text").value = "";
    $("doc-files").value = "";
  } catch (e) {
    showError(e.message);
  } finally {
    $("add-doc").disabled = false;
  }
}

// a streamed chat: its text into out as it comes, the last chunk's kvblend object back
async function streamChat(body, out, started) {
  const res = await call("/v1/chat/completions", body);
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", stats = null, usage = null, ttft = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the stream ended with an error");
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          if (ttft === null) ttft = performance.now() - started;
          out.textContent += delta.content;
        }
        if (chunk.kvblend) stats = chunk.kvblend;
        if (chunk.usage) usage = chunk.usage;
      }
    }
  }
  return { stats, usage, ttft };
}

function showStats(table, r) {
  table.replaceChildren();
  if (r.ttft !== null) row(table, "time to first token", r.ttft.toFixed(0) + " ms (in this browser)");
  const k = r.stats;
  if (!k) return;
  row(table, "prompt tokens", k.n_prompt);
  row(table, "fused / recomputed", k.n_fused + " / " + k.n_recomputed);
  row(table, "store hits", k.store_hits + " of " + (k.store_hits + k.store_misses));
  row(table, "prefill", k.prefill_ms.toFixed(1) + " ms");
  const c = k.compare_full;
  if (c) {
    row(table, "KL to the full prefill", c.kl.toExponential(2) + " nats");
    row(table, "same first token", c.top1_agree ? "yes" : "no: " + JSON.stringify(c.top_fused.text) + " vs " +
        JSON.stringify(c.top_full.text));
    row(table, "full prefill", c.full_prefill_ms.toFixed(1) + " ms");
  }
}

// a document's text as the server cut it, its recomputed tokens marked (text nodes only)
function docText(segments) {
  const box = document.createElement("div");
  box.className = "doc-text";
  for (const s of segments) {
    const part = s.recomputed ? document.createElement("mark") : document.createElement("span");
    part.textContent = s.text;
    box.append(part);
  }
  return box;
}

// the documents of the prompt: each fused one, or (a plain prompt) those found in its text
function showSpans(k, docs) {
  const list = $("spans");
  list.replaceChildren();
  if (!k) return;
  if (!k.spans || !k.spans.length) {
    for (const d of docs) {
      const li = document.createElement("li");
      li.textContent = d.title + " (" + d.n_tokens + " tokens, fused)";
      const cut = (k.recomputed || []).find((x) => x.id === d.id);
      if (cut) li.append(docText(cut.segments));
      list.append(li);
    }
    return;
  }
  for (const s of k.spans) {
    const d = docs.find((x) => x.id === s.id);
    const li = document.createElement("li");
    const tag = document.createElement("span");
    tag.className = s.store_hit ? "hit" : "miss";
    tag.textContent = s.store_hit ? "from the store" : "collected";
    const what = document.createElement("span");
    what.textContent = " tokens " + s.begin + "–" + s.end + ": " + (d ? d.title : s.id);
    li.append(tag, what);
    list.append(li);
  }
}

async function ask() {
  if (state.busy) return;
  const question = $("question").value.trim();
  if (!question) return showError("write a question first");
  const docs = state.docs.filter((d) => d.picked !== false);
  const ratio = parseFloat($("ratio").value);
  const compare = $("compare").checked;
  const body = (r, withCompare) => {
    const b = { messages: [{ role: "user", content: question }], stream: true,
                stream_options: { include_usage: true }, temperature: 0, max_tokens: 256, recomp_ratio: r,
                show_recomputed: true };
    if (docs.length) b.documents = docs.map((d) => ({ id: d.id }));
    if (withCompare) b.compare_full = true;
    return b;
  };
  showError("");
  state.busy = true;
  $("ask").disabled = true;
  $("answer").textContent = "";
  $("full-answer").textContent = "";
  $("full-box").hidden = !compare;
  try {
    const t0 = performance.now();
    const fused = await streamChat(body(ratio, compare && state.compareAllowed), $("answer"), t0);
    showStats($("stats"), fused);
    showSpans(fused.stats, docs);
    if (compare) {  // every document token recomputed: the full prefill's answer, beside the fused one
      const t1 = performance.now();
      const full = await streamChat(body(1, false), $("full-answer"), t1);
      showStats($("full-stats"), full);
    }
  } catch (e) {
    showError(e.message);
  } finally {
    state.busy = false;
    $("ask").disabled = false;
  }
}

// the model's calibration (kvblend calibrate): top-1 agreement and KL against the
// ratio, the pick and the slider's ratio as vertical lines. SVG built from nodes
const SVG = "http://www.w3.org/2000/svg";
function svg(parent, tag, attrs, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  parent.append(el);
  return el;
}

function drawCalibration(c) {
  const plot = $("cal-plot");
  plot.replaceChildren();
  const rows = (c.rows || []).slice().sort((a, b) => a.ratio - b.ratio);
  if (!rows.length) return;
  const left = 40, right = 410, top = 12, bottom = 160;
  const xMax = Math.max(rows[rows.length - 1].ratio, 1e-6);
  const klMax = Math.max(...rows.map((r) => r.kl), 1e-9);
  const x = (r) => left + (right - left) * r / xMax;
  const yAgree = (a) => bottom - (bottom - top) * a;
  const yKl = (k) => bottom - (bottom - top) * k / klMax;
  svg(plot, "line", { x1: left, y1: bottom, x2: right, y2: bottom, stroke: "#99a3ad" });
  svg(plot, "line", { x1: left, y1: top, x2: left, y2: bottom, stroke: "#99a3ad" });
  const axis = (attrs, text) => svg(plot, "text", Object.assign({ class: "axis" }, attrs), text);
  axis({ x: left - 6, y: top + 4, "text-anchor": "end" }, "1");
  axis({ x: left - 6, y: bottom, "text-anchor": "end" }, "0");
  axis({ x: right + 4, y: top + 4 }, klMax.toPrecision(2));
  axis({ x: (left + right) / 2, y: bottom + 28, "text-anchor": "middle" }, "share of document tokens recomputed");
  for (const r of rows) axis({ x: x(r.ratio), y: bottom + 14, "text-anchor": "middle" }, String(r.ratio));
  const series = [["top-1 agreement", "#1f6fb2", (r) => yAgree(r.agree)], ["KL (right scale)", "#c2410c", (r) => yKl(r.kl)]];
  series.forEach(([name, color, y], i) => {
    svg(plot, "polyline", { points: rows.map((r) => x(r.ratio) + "," + y(r)).join(" "), fill: "none", stroke: color, "stroke-width": 2 });
    for (const r of rows) {
      const dot = svg(plot, "circle", { cx: x(r.ratio), cy: y(r), r: 3, fill: color, class: "cal-point" });
      svg(dot, "title", {}, "ratio " + r.ratio + ": agreement " + r.agree.toFixed(3) + ", KL " + r.kl.toPrecision(3) +
          ", TTFT " + r.ttft_ms.toFixed(1) + " ms");
    }
    svg(plot, "text", { x: right - 8, y: top + 50 + 14 * i, fill: color, "text-anchor": "end" }, name);
  });
  svg(plot, "line", { x1: x(c.recomp_ratio), y1: top, x2: x(c.recomp_ratio), y2: bottom, stroke: "#1a7f37", "stroke-dasharray": "4 3" });
  state.slider = svg(plot, "line", { x1: 0, y1: top, x2: 0, y2: bottom, stroke: "#20303f", "stroke-width": 1 });
  state.calX = x;
  state.calMax = xMax;
  moveCalibrationMark();
  $("cal-note").textContent = "(" + c.n_prompts + " prompts; the pick " + c.recomp_ratio + " in green" +
                              (c.met ? "" : ", no ratio met the targets") + "; the slider in black)";
  $("calibration").hidden = false;
}

function moveCalibrationMark() {
  if (!state.slider) return;
  const r = Math.min(parseFloat($("ratio").value), state.calMax);
  state.slider.setAttribute("x1", state.calX(r));
  state.slider.setAttribute("x2", state.calX(r));
}

async function connect() {
  try {
    const props = await (await call("/props")).json();
    $("model").textContent = props.model_alias + " · " + props.total_slots + " slot(s) · " +
                             (props.store ? "store " + props.store : "no store");
    const k = props.kvblend || {};
    if (typeof k.recomp_ratio === "number") {
      $("ratio").value = k.recomp_ratio;
      $("ratio-value").textContent = k.recomp_ratio.toFixed(2);
    }
    state.compareAllowed = !!k.compare_full;
    if (k.calibration) drawCalibration(k.calibration);
    $("compare").title = state.compareAllowed ? "" : "the first-token KL needs serve --compare-full; the full answer is shown anyway";
    showError("");
  } catch (e) {
    $("model").textContent = "not connected";
    showError(e.message);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = sessionStorage.getItem("kvblend.key") || "";
  $("api-key").addEventListener("change", () => { sessionStorage.setItem("kvblend.key", $("api-key").value); connect(); });
  $("ratio").addEventListener("input", () => {
    $("ratio-value").textContent = parseFloat($("ratio").value).toFixed(2);
    moveCalibrationMark();
  });
  $("add-doc").addEventListener("click", addDocuments);
  $("ask").addEventListener("click", ask);
  renderDocs();
  connect();
});
)KVB";

}  // namespace

const web_asset * web_asset_for(const std::string & path) {
    static const web_asset assets[] = {
        {"/", "text/html; charset=utf-8", k_html, std::strlen(k_html)},
        {"/kvblend-ui.js", "text/javascript; charset=utf-8", k_js, std::strlen(k_js)},
        {"/kvblend-ui.css", "text/css; charset=utf-8", k_css, std::strlen(k_css)},
    };
    for (const web_asset & a : assets)
        if (path == a.path) return &a;
    return nullptr;
}

const char * web_page_csp() {
    return "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'";
}

}  // namespace kvblend
