// Live metrics: /metrics (Prometheus text) sampled every second, rates over the last interval,
// charts drawn on plain canvases.

import { getText } from "./api.js";

const $ = (id) => document.getElementById(id);
const HISTORY = 120; // samples kept per series

// {name: total over every label set} for "deepinfer:..." samples (histograms: _sum / _count).
export function parsePrometheus(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/);
    if (!m) continue;
    const value = parseFloat(m[3]);
    if (Number.isNaN(value)) continue;
    const name = m[1].replace(/^deepinfer:/, "").replace(/_total$/, "");
    out[name] = (out[name] || 0) + value;
  }
  return out;
}

const SERIES = [
  // key, card label, format, chart
  ["running", "Requests running", (v) => v.toFixed(0), "Requests"],
  ["waiting", "Requests waiting", (v) => v.toFixed(0), "Requests"],
  ["gen_tps", "Generated tok/s", (v) => v.toFixed(1), "Tokens per second"],
  ["prompt_tps", "Prompt tok/s", (v) => v.toFixed(1), "Tokens per second"],
  ["ttft_ms", "TTFT (ms, last interval)", (v) => v.toFixed(0), "Latency (ms)"],
  ["itl_ms", "Inter-token latency (ms)", (v) => v.toFixed(1), "Latency (ms)"],
  ["kv_pct", "KV cache use %", (v) => v.toFixed(1), "Percent"],
  ["hit_pct", "Prefix hit rate %", (v) => v.toFixed(1), "Percent"],
  ["spec_pct", "Spec-decode acceptance %", (v) => v.toFixed(1), "Percent"],
  ["generated", "Tokens generated", (v) => v.toFixed(0), null],
  ["finished", "Requests finished", (v) => v.toFixed(0), null],
  ["rejected", "Rejected (429)", (v) => v.toFixed(0), null],
  ["preempted", "Preemptions", (v) => v.toFixed(0), null],
];
const COLORS = ["#1f4e79", "#c62828", "#2e7d32", "#f9a825"];

function delta(now, before, key) {
  return before && key in now && key in before ? now[key] - before[key] : 0;
}

// The derived figures of one sample, given the previous one.
export function derive(now, before, seconds) {
  const rate = (key) => (seconds > 0 ? delta(now, before, key) / seconds : 0);
  const mean = (name) => {
    const n = delta(now, before, `${name}_count`);
    return n > 0 ? (delta(now, before, `${name}_sum`) / n) * 1000 : null;
  };
  const queries = delta(now, before, "prefix_cache_queries");
  const out = {
    running: now.num_requests_running || 0,
    waiting: now.num_requests_waiting || 0,
    gen_tps: rate("generation_tokens"),
    prompt_tps: rate("prompt_tokens"),
    ttft_ms: mean("time_to_first_token_seconds"),
    itl_ms: mean("inter_token_latency_seconds"),
    kv_pct: 100 * (now.kv_cache_usage_perc || 0),
    hit_pct: queries > 0 ? (100 * delta(now, before, "prefix_cache_hits")) / queries
      : now.prefix_cache_queries ? (100 * (now.prefix_cache_hits || 0)) / now.prefix_cache_queries : 0,
    generated: now.generation_tokens || 0,
    finished: now.request_success || 0,
    rejected: now.requests_rejected || 0,
    preempted: now.num_preemptions || 0,
  };
  const accepted = Object.keys(now).find((k) => /spec_decode.*accepted/.test(k));
  const drafted = Object.keys(now).find((k) => /spec_decode.*draft/.test(k) && !/accepted/.test(k));
  if (accepted && drafted) {
    const d = delta(now, before, drafted);
    out.spec_pct = d > 0 ? (100 * delta(now, before, accepted)) / d : (100 * now[accepted]) / (now[drafted] || 1);
  }
  return out;
}

function drawChart(canvas, lines) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (!w || !h) return;
  canvas.width = w * dpr;
  canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  const values = lines.flatMap((l) => l.points.filter((v) => v != null));
  const top = Math.max(1e-9, ...values) * 1.1;
  const left = 44, bottom = h - 16;
  g.strokeStyle = "#ccc";
  g.fillStyle = "#555";
  g.font = "11px sans-serif";
  g.beginPath(); g.moveTo(left, 4); g.lineTo(left, bottom); g.lineTo(w - 4, bottom); g.stroke();
  g.fillText(top.toPrecision(3), 2, 12);
  g.fillText("0", 30, bottom);
  lines.forEach((line, i) => {
    g.strokeStyle = COLORS[i % COLORS.length];
    g.lineWidth = 1.5;
    g.beginPath();
    let started = false;
    line.points.forEach((v, j) => {
      if (v == null) return;
      const x = left + ((w - left - 4) * j) / (HISTORY - 1);
      const y = bottom - ((bottom - 4) * v) / top;
      if (started) g.lineTo(x, y); else { g.moveTo(x, y); started = true; }
    });
    g.stroke();
    g.fillStyle = COLORS[i % COLORS.length];
    g.fillText(line.label, left + 6 + i * 120, h - 3);
  });
}

export class Metrics {
  constructor() {
    this.previous = null;
    this.previousAt = 0;
    this.history = Object.fromEntries(SERIES.map(([key]) => [key, []]));
    this.timer = null;
    this.visible = false;
    this.build();
  }

  build() {
    $("metric-cards").replaceChildren(...SERIES.map(([key, label]) => {
      const card = document.createElement("div");
      card.className = "card";
      card.id = `card-${key}`;
      card.hidden = key === "spec_pct";
      card.innerHTML = `<div class="name"></div><div class="value" data-metric="${key}">–</div>`;
      card.querySelector(".name").textContent = label;
      return card;
    }));
    const charts = {};
    for (const [key, label, , chart] of SERIES) if (chart) (charts[chart] ||= []).push([key, label]);
    this.charts = Object.entries(charts).map(([title, keys]) => {
      const box = document.createElement("figure");
      box.className = "chart";
      const canvas = document.createElement("canvas");
      canvas.setAttribute("role", "img");
      canvas.setAttribute("aria-label", `${title}: ${keys.map((k) => k[1]).join(", ")} over the last two minutes`);
      const heading = document.createElement("h3");
      heading.textContent = title;
      box.append(heading, canvas);
      return { box, canvas, keys };
    });
    $("metric-charts").replaceChildren(...this.charts.map((c) => c.box));
  }

  start() {
    if (!this.timer) {
      this.sample();
      this.timer = setInterval(() => this.sample(), 1000);
    }
  }

  async sample() {
    let now;
    try {
      now = parsePrometheus(await getText("metrics"));
      $("metrics-error").hidden = true;
    } catch (e) {
      $("metrics-error").textContent = `metrics: ${e.message}`;
      $("metrics-error").hidden = false;
      return;
    }
    const at = performance.now();
    const figures = derive(now, this.previous, (at - this.previousAt) / 1000);
    this.previous = now;
    this.previousAt = at;
    for (const [key, , format] of SERIES) {
      const value = figures[key];
      const series = this.history[key];
      series.push(value ?? null);
      if (series.length > HISTORY) series.shift();
      const node = document.querySelector(`[data-metric="${key}"]`);
      if (key === "spec_pct") $("card-spec_pct").hidden = value === undefined;
      if (node) node.textContent = value == null ? "–" : format(value);
    }
    if (this.visible) this.draw();
  }

  draw() {
    for (const chart of this.charts) {
      const lines = chart.keys.filter(([key]) => key !== "spec_pct" || this.history[key].some((v) => v != null))
        .map(([key, label]) => ({ label, points: this.history[key] }));
      drawChart(chart.canvas, lines);
    }
  }
}
