// minivllm's dashboard: the server's own API, read by this page (no build step, nothing
// fetched from elsewhere). Numbers come from /dashboard/api/engine, which returns the
// snapshot the engine publishes after every step anyway.
"use strict";

const $ = (id) => document.getElementById(id);
const keyField = $("key");
keyField.value = localStorage.getItem("minivllm-key") || "";
keyField.addEventListener("change", () => localStorage.setItem("minivllm-key", keyField.value));

function headers() {
  const h = { "Content-Type": "application/json" };
  if (keyField.value) h["Authorization"] = "Bearer " + keyField.value;
  return h;
}

async function api(path, body) {
  const r = await fetch(path, body === undefined ? { headers: headers() }
    : { method: "POST", headers: headers(), body: JSON.stringify(body) });
  const data = await r.json();
  if (!r.ok) throw new Error(data.error ? data.error.message : r.statusText);
  return data;
}

// ---- tabs ----------------------------------------------------------------------------
for (const b of document.querySelectorAll("nav button")) {
  b.addEventListener("click", () => {
    for (const x of document.querySelectorAll("nav button, section")) x.classList.remove("on");
    b.classList.add("on");
    $(b.dataset.tab).classList.add("on");
  });
}

// ---- playground: a streamed request, its tokens and timings ---------------------------
function tokenSpan(text, logprob) {
  const s = document.createElement("span");
  s.textContent = text;
  if (logprob !== undefined) {
    s.className = "tok";
    s.title = "logprob " + logprob.toFixed(3);
  }
  return s;
}

$("send").addEventListener("click", async () => {
  const chat = $("endpoint").value === "chat";
  const wantLogprobs = $("logprobs").checked;
  const body = { max_tokens: +$("max_tokens").value, temperature: +$("temperature").value,
                 top_p: +$("top_p").value, top_k: +$("top_k").value,
                 repetition_penalty: +$("repetition_penalty").value, stream: true,
                 stream_options: { include_usage: true }, return_metrics: true };
  if ($("seed").value !== "") body.seed = +$("seed").value;
  if (chat) {
    body.messages = [{ role: "user", content: $("prompt").value }];
    if (wantLogprobs) body.logprobs = true;
  } else {
    body.prompt = $("prompt").value;
    if (wantLogprobs) body.logprobs = 0;
  }
  const out = $("answer");
  out.textContent = "";
  $("timings").textContent = "";
  const start = performance.now();
  let first = null, tokens = 0, timings = null;
  const r = await fetch(chat ? "/v1/chat/completions" : "/v1/completions",
                        { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!r.ok) { out.textContent = (await r.json()).error.message; return; }
  const reader = r.body.getReader();
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
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      if (chunk.metrics) timings = chunk.metrics;
      for (const c of chunk.choices || []) {
        const text = chat ? (c.delta && c.delta.content) || "" : c.text || "";
        if (!text) continue;
        if (first === null) first = performance.now();
        const lp = chat ? c.logprobs && c.logprobs.content
                        : c.logprobs && c.logprobs.token_logprobs;
        if (lp && lp.length === 1) {
          out.appendChild(tokenSpan(text, chat ? lp[0].logprob : lp[0]));
        } else {
          out.appendChild(tokenSpan(text));
        }
      }
    }
  }
  const end = performance.now();
  if (first !== null) {
    const rate = tokens > 1 ? ((tokens - 1) / ((end - first) / 1000)).toFixed(1) : "-";
    const queue = timings && timings.queue_s !== null
      ? `queue wait ${(1000 * timings.queue_s).toFixed(1)} ms, ` : "";
    $("timings").textContent = `${queue}time to first token ${(first - start).toFixed(0)} ms, ` +
      `${tokens} tokens, ${rate} tokens/s after the first`;
  }
});

// ---- tokenizer --------------------------------------------------------------------------
$("tokenize").addEventListener("click", async () => {
  const table = $("tok_table");
  table.textContent = "";
  try {
    const text = $("tok_text").value;
    const r = await api("/tokenize", $("tok_chat").checked
      ? { messages: [{ role: "user", content: text }], return_token_strs: true }
      : { prompt: text, return_token_strs: true });
    $("tok_count").textContent = `${r.count} tokens`;
    const head = table.insertRow();
    head.innerHTML = "<th>#</th><th>id</th><th>token</th>";
    r.tokens.forEach((id, i) => {
      const row = table.insertRow();
      row.insertCell().textContent = i;
      row.insertCell().textContent = id;
      row.insertCell().textContent = JSON.stringify(r.token_strs ? r.token_strs[i] : "");
    });
  } catch (e) { $("tok_count").textContent = e.message; }
});

// ---- engine, live -------------------------------------------------------------------------
const history = [];
const CARDS = [["running", "num_requests_running"], ["waiting", "num_requests_waiting"],
               ["KV cache used", "kv_cache_usage", (v) => (100 * v).toFixed(1) + "%"],
               ["free blocks", "num_free_blocks"], ["preemptions", "num_preemptions"],
               ["prefix cache hits (tokens)", "prefix_cache_hits"],
               ["prompt tokens", "prompt_tokens"], ["generated tokens", "generation_tokens"],
               ["tokens/s", "tokens_per_s", (v) => v.toFixed(0)]];

function drawChart() {
  const svg = $("chart");
  const w = svg.width.baseVal.value, h = svg.height.baseVal.value;
  const peak = Math.max(1, ...history.map((p) => Math.max(p.running, p.waiting)));
  const line = (key, scale, color) => {
    const pts = history.map((p, i) =>
      `${(i / 119) * w},${h - 4 - (p[key] / scale) * (h - 8)}`).join(" ");
    return `<polyline fill="none" stroke="${color}" stroke-width="2" points="${pts}"/>`;
  };
  svg.innerHTML = line("running", peak, "#1f77b4") + line("waiting", peak, "#ff7f0e") +
                  line("kv", 100, "#2ca02c");
}

async function pollEngine() {
  if ($("engine").classList.contains("on")) {
    try {
      const s = await api("/dashboard/api/engine");
      const prev = history.length ? history[history.length - 1] : null;
      const rate = prev ? (s.generation_tokens - prev.gen) / ((s.time - prev.t) || 1) : 0;
      s.tokens_per_s = Math.max(0, rate);
      $("cards").innerHTML = "";
      for (const [label, key, fmt] of CARDS) {
        const v = s[key] === undefined ? 0 : s[key];
        const card = document.createElement("div");
        card.className = "card";
        card.innerHTML = `<span>${label}</span><b data-key="${key}">${fmt ? fmt(v) : v}</b>`;
        $("cards").appendChild(card);
      }
      history.push({ t: s.time, gen: s.generation_tokens, running: s.num_requests_running,
                     waiting: s.num_requests_waiting, kv: 100 * s.kv_cache_usage });
      if (history.length > 120) history.shift();
      drawChart();
      const recent = await api("/dashboard/api/steps");
      const table = $("steps");
      table.innerHTML = "<tr><th>seconds ago</th><th>path</th><th>tokens</th>" +
                        "<th>sequences</th><th>ms</th></tr>";
      for (const [t, path, tokens, seqs, secs] of recent.steps.slice(-15).reverse()) {
        const row = table.insertRow();
        for (const v of [(s.time - t).toFixed(2), path, tokens, seqs, (1000 * secs).toFixed(2)]) {
          row.insertCell().textContent = v;
        }
      }
    } catch (e) { $("cards").textContent = e.message; }
  }
  setTimeout(pollEngine, 500);
}
pollEngine();

// ---- benchmarks: the report's tables and charts, then the results folders --------------------
function renderReport(markdown) {
  // The report's own Markdown: headings, tables, images, paragraphs (what it uses).
  const box = $("report");
  for (const block of markdown.split(/\n\s*\n/)) {
    const lines = block.trim().split("\n");
    if (!lines[0]) continue;
    if (lines[0].startsWith("#")) {
      const h = document.createElement("h3");
      h.textContent = lines[0].replace(/^#+\s*/, "");
      box.appendChild(h);
      lines.shift();
      if (!lines.length) continue;
    }
    if (lines[0].startsWith("|")) {
      const table = document.createElement("table");
      lines.filter((l) => !/^\|[-\s|:]+\|$/.test(l)).forEach((l, i) => {
        const row = table.insertRow();
        for (const cell of l.replace(/^\||\|$/g, "").split("|")) {
          const c = document.createElement(i === 0 ? "th" : "td");
          c.textContent = cell.trim();
          row.appendChild(c);
        }
      });
      box.appendChild(table);
      continue;
    }
    for (const line of lines) {
      const img = line.match(/!\[([^\]]*)\]\(([^)]+\.png)\)/);
      if (img) {
        const el = document.createElement("img");
        el.src = "/dashboard/report/" + img[2].split("/").pop();
        el.alt = img[1];
        el.style.maxWidth = "100%";
        box.appendChild(el);
      } else {
        const p = document.createElement("p");
        p.textContent = line;
        box.appendChild(p);
      }
    }
  }
}

(async () => {
  try {
    const r = await api("/dashboard/api/benchmarks");
    $("bench_note").textContent = r.note;
    if (r.report) renderReport(r.report);
    const table = $("bench_table");
    if (!r.rows.length) return;
    const cols = Object.keys(r.rows[0]);
    table.insertRow().innerHTML = cols.map((c) => `<th>${c}</th>`).join("");
    for (const row of r.rows) {
      const tr = table.insertRow();
      for (const c of cols) tr.insertCell().textContent = row[c];
    }
  } catch (e) { $("bench_note").textContent = e.message; }
})();
