// The page: tabs (keyboard: arrows, Home, End), the model's name, and the five views.

import { getJSON } from "./api.js";
import { Chat } from "./chat.js";
import { Inspector } from "./inspector.js";
import { Metrics } from "./metrics.js";

const $ = (id) => document.getElementById(id);

function renderTable(rows) {
  // a list of objects as a table (the cluster view shows whatever GET /cluster reports)
  const keys = [...new Set(rows.flatMap((r) => Object.keys(r)))];
  const table = document.createElement("table");
  const head = table.createTHead().insertRow();
  for (const k of keys) {
    const th = document.createElement("th");
    th.scope = "col";
    th.textContent = k;
    head.append(th);
  }
  const body = table.createTBody();
  for (const r of rows) {
    const tr = body.insertRow();
    for (const k of keys) {
      const v = r[k];
      tr.insertCell().textContent = v == null ? "" : typeof v === "object" ? JSON.stringify(v) : String(v);
    }
  }
  return table;
}

function renderCluster(data) {
  const parts = [];
  for (const [key, value] of Object.entries(data)) {
    const heading = document.createElement("h2");
    heading.textContent = key.replace(/_/g, " ");
    parts.push(heading);
    if (Array.isArray(value) && value.every((v) => v && typeof v === "object")) parts.push(renderTable(value));
    else {
      const pre = document.createElement("pre");
      pre.textContent = typeof value === "object" ? JSON.stringify(value, null, 1) : String(value);
      parts.push(pre);
    }
  }
  $("cluster-body").replaceChildren(...parts);
}

async function loadPlugins() {
  try {
    const { data } = await getJSON("v1/plugins");
    $("plugin-rows").replaceChildren(...data.map((p) => {
      const tr = document.createElement("tr");
      const usable = p.usable ? "yes" : "no";
      const why = [p.reason, p.note].filter(Boolean).join("; ");
      for (const [text, cls] of [[p.name + (p.builtin ? " (builtin)" : ""), ""], [p.distribution, ""], [p.version || "–", ""],
        [p.hooks.join(", "), ""], [why ? `${usable}: ${why}` : usable, usable]]) {
        const td = tr.insertCell();
        td.textContent = text;
        if (cls) td.className = cls;
      }
      return tr;
    }));
  } catch (e) {
    $("plugins-error").textContent = `plugins: ${e.message}`;
    $("plugins-error").hidden = false;
  }
}

async function loadCluster() {
  try {
    renderCluster(await getJSON("cluster"));
  } catch (e) {
    if (e.status === 404) {
      $("tab-cluster").hidden = true;
      select("tab-chat");
    } else {
      $("cluster-error").textContent = `cluster: ${e.message}`;
      $("cluster-error").hidden = false;
    }
  }
}

let views = {};
let clusterTimer = null;

function select(tabId, focus = false) {
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    const on = tab.id === tabId;
    tab.setAttribute("aria-selected", String(on));
    tab.tabIndex = on ? 0 : -1;
    $(tab.getAttribute("aria-controls")).hidden = !on;
    if (on && focus) tab.focus();
  }
  views.metrics.visible = tabId === "tab-metrics";
  if (tabId === "tab-metrics") views.metrics.draw();
  if (tabId === "tab-inspector") views.inspector.show();
  if (tabId === "tab-plugins") loadPlugins();
  clearInterval(clusterTimer);
  if (tabId === "tab-cluster") {
    loadCluster();
    clusterTimer = setInterval(loadCluster, 2000);
  }
  if (location.hash !== `#${tabId.slice(4)}`) history.replaceState(null, "", `#${tabId.slice(4)}`);
}

function setUpTabs() {
  const tabs = () => [...document.querySelectorAll('[role="tab"]')].filter((t) => !t.hidden);
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    tab.addEventListener("click", () => select(tab.id));
    tab.addEventListener("keydown", (e) => {
      const list = tabs();
      const i = list.indexOf(tab);
      const next = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: list.length - 1 }[e.key];
      if (next === undefined) return;
      e.preventDefault();
      select(list[(next + list.length) % list.length].id, true);
    });
  }
}

async function main() {
  let model = "";
  try {
    const models = await getJSON("v1/models");
    model = models.data[0].id;
    $("model-name").textContent = `${model} · context ${models.data[0].max_model_len}`;
  } catch (e) {
    $("model-name").textContent = `cannot reach the server: ${e.message}`;
  }
  try { // the cluster tab only where the server has GET /cluster (`deepinfer cluster`)
    const spec = await getJSON("openapi.json");
    $("tab-cluster").hidden = !(spec.paths && spec.paths["/cluster"]);
  } catch { /* no schema: keep the tab hidden */ }
  const chat = new Chat(model);
  views = { chat, inspector: new Inspector(chat), metrics: new Metrics() };
  views.metrics.start();
  setUpTabs();
  const wanted = `tab-${location.hash.slice(1)}`;
  select($(wanted) && !$(wanted).hidden ? wanted : "tab-chat");
  document.body.dataset.ready = "true";
}

main();
