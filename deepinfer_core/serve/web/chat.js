// The chat view: streaming replies through /v1/chat/completions, thinking apart from the answer,
// tool calls, stop / regenerate / edit and resend, settings, conversations in IndexedDB.

import { postStream } from "./api.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

export class Chat {
  constructor(modelName) {
    this.model = modelName;
    this.conversation = store.newConversation();
    this.controller = null; // the AbortController of the stream in flight
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); this.send(); }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("regenerate").addEventListener("click", () => this.regenerate());
    $("new-chat").addEventListener("click", () => this.open(store.newConversation()));
    $("export-chats").addEventListener("click", () => this.exportAll());
    $("import-chats").addEventListener("change", (e) => this.importFile(e.target.files[0]));
    this.refreshList();
    this.render();
  }

  // -- conversations ------------------------------------------------------------------------
  async refreshList() {
    const list = $("conversation-list");
    let items = [];
    try { items = await store.listConversations(); } catch (e) { this.showError(`browser storage: ${e.message}`); }
    list.replaceChildren(...items.map((c) => el("li", {},
      el("button", { class: "open", "aria-current": String(c.id === this.conversation.id), onclick: () => this.open(c) }, c.title),
      el("button", { "aria-label": `Delete conversation ${c.title}`, title: "Delete", onclick: () => this.remove(c) }, "✕"))));
  }

  open(conversation) {
    if (this.controller) this.stop();
    this.conversation = conversation;
    this.hideError();
    this.render();
    this.refreshList();
    $("prompt").focus();
  }

  async remove(conversation) {
    await store.deleteConversation(conversation.id);
    if (conversation.id === this.conversation.id) this.conversation = store.newConversation();
    this.render();
    this.refreshList();
  }

  async persist() {
    const c = this.conversation;
    if (!c.messages.length) return;
    const first = c.messages.find((m) => m.role === "user");
    if (first && !c.imported) c.title = first.content.slice(0, 40) || "Chat"; // follows an edited first turn
    try { await store.saveConversation(c); } catch (e) { this.showError(`browser storage: ${e.message}`); }
    this.refreshList();
  }

  async exportAll() {
    await this.persist();
    const blob = new Blob([await store.exportJSON()], { type: "application/json" });
    const link = el("a", { href: URL.createObjectURL(blob), download: "deepinfer-conversations.json" });
    document.body.append(link);
    link.click();
    link.remove();
  }

  async importFile(file) {
    if (!file) return;
    try {
      const n = await store.importJSON(await file.text());
      this.hideError();
      await this.refreshList();
      $("chat-error").hidden = true;
      $("messages").setAttribute("data-imported", String(n));
    } catch (e) {
      this.showError(`import: ${e.message}`);
    }
    $("import-chats").value = "";
  }

  // -- the request ----------------------------------------------------------------------------
  settings() {
    const body = { model: this.model, stream_options: { include_usage: true } };
    const number = (id, key, parse = parseFloat) => {
      const raw = $(id).value.trim();
      if (raw !== "") body[key] = parse(raw);
    };
    number("temperature", "temperature");
    number("top-p", "top_p");
    number("max-tokens", "max_tokens", (v) => parseInt(v, 10));
    number("seed", "seed", (v) => parseInt(v, 10));
    if ($("thinking").checked) body.thinking = { type: "enabled" };
    if ($("use-schema").checked) {
      let schema;
      try { schema = JSON.parse($("json-schema").value); } catch (e) { throw new Error(`the JSON schema box is not valid JSON: ${e.message}`); }
      body.response_format = { type: "json_schema", json_schema: { name: "reply", schema } };
    }
    const tools = $("tools").value.trim();
    if (tools) {
      try { body.tools = JSON.parse(tools); } catch (e) { throw new Error(`the tools box is not valid JSON: ${e.message}`); }
      body.tool_choice = $("tool-choice").value;
    }
    return body;
  }

  apiMessages() {
    const out = [];
    const system = $("system-prompt").value.trim();
    if (system) out.push({ role: "system", content: system });
    for (const m of this.conversation.messages) {
      if (m.role === "assistant") {
        const msg = { role: "assistant", content: m.content || "" };
        if (m.tool_calls && m.tool_calls.length) msg.tool_calls = m.tool_calls;
        out.push(msg);
      } else {
        out.push({ role: m.role, content: m.content });
      }
    }
    return out;
  }

  async send() {
    const text = $("prompt").value;
    if (!text.trim() || this.controller) return;
    $("prompt").value = "";
    this.conversation.messages.push({ role: "user", content: text });
    await this.complete();
  }

  async regenerate() {
    const msgs = this.conversation.messages;
    while (msgs.length && msgs[msgs.length - 1].role === "assistant") msgs.pop();
    if (msgs.length) await this.complete();
  }

  edit(index) {
    const msg = this.conversation.messages[index];
    $("prompt").value = msg.content;
    this.conversation.messages.splice(index); // resending replaces this turn and what followed
    this.render();
    $("prompt").focus();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  async complete() {
    this.hideError();
    let body;
    try { body = { ...this.settings(), messages: this.apiMessages() }; } catch (e) {
      this.showError(e.message);
      this.render();
      return;
    }
    const reply = { role: "assistant", content: "", reasoning: "", tool_calls: [], streaming: true };
    this.conversation.messages.push(reply);
    this.controller = new AbortController();
    this.setBusy(true);
    this.render();
    const started = performance.now();
    try {
      await postStream("v1/chat/completions", body, (event) => {
        if (event.usage) reply.usage = event.usage;
        const choice = event.choices && event.choices[0];
        if (!choice) return;
        const delta = choice.delta || {};
        if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
        if (delta.content) reply.content += delta.content;
        for (const call of delta.tool_calls || []) {
          const slot = (reply.tool_calls[call.index] ||= { id: call.id, type: "function", function: { name: "", arguments: "" } });
          if (call.id) slot.id = call.id;
          if (call.function && call.function.name) slot.function.name = call.function.name;
          if (call.function && call.function.arguments) slot.function.arguments += call.function.arguments;
        }
        if (choice.finish_reason) reply.finish_reason = choice.finish_reason;
        this.renderLast();
      }, this.controller.signal);
    } catch (e) {
      if (e.name === "AbortError") reply.finish_reason = "stopped";
      else {
        this.showError(e.message);
        if (!reply.content && !reply.reasoning && !reply.tool_calls.length) this.conversation.messages.pop();
      }
    } finally {
      reply.streaming = false;
      reply.seconds = (performance.now() - started) / 1000;
      this.controller = null;
      this.setBusy(false);
      this.render();
      await this.persist();
    }
  }

  setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("regenerate").disabled = busy || !this.conversation.messages.some((m) => m.role === "user");
    if (!busy) $("prompt").focus();
  }

  // -- rendering --------------------------------------------------------------------------------
  showError(message) {
    const box = $("chat-error");
    box.textContent = message;
    box.hidden = false;
  }

  hideError() {
    $("chat-error").hidden = true;
  }

  messageNode(m, index) {
    const node = el("article", { class: `msg ${m.role}`, "aria-label": `${m.role} message` });
    node.append(el("div", { class: "role" }, m.role));
    if (m.reasoning) {
      node.append(el("details", { class: "thinking", ...(m.streaming && !m.content ? { open: "" } : {}) },
        el("summary", {}, m.streaming && !m.content ? "Thinking…" : "Thinking"),
        el("div", { class: "reasoning" }, m.reasoning)));
    }
    node.append(el("div", { class: "content" }, m.content || ""));
    for (const call of m.tool_calls || []) {
      node.append(el("div", { class: "tool-call", "aria-label": "tool call" }, `${call.function.name}(${call.function.arguments})`));
    }
    const meta = [];
    if (m.finish_reason) meta.push(m.finish_reason);
    if (m.usage) meta.push(`${m.usage.completion_tokens} tokens, ${m.usage.prompt_tokens} prompt (${(m.usage.prompt_tokens_details || {}).cached_tokens || 0} cached)`);
    if (m.seconds) meta.push(`${m.seconds.toFixed(1)} s`);
    if (meta.length) node.append(el("div", { class: "meta" }, meta.join(" · ")));
    if (m.role === "user" && !this.controller) {
      node.append(el("div", { class: "actions" },
        el("button", { "aria-label": "Edit and resend this message", onclick: () => this.edit(index) }, "Edit")));
    }
    return node;
  }

  render() {
    const box = $("messages");
    box.replaceChildren(...this.conversation.messages.map((m, i) => this.messageNode(m, i)));
    box.scrollTop = box.scrollHeight;
    $("regenerate").disabled = !!this.controller || !this.conversation.messages.some((m) => m.role === "user");
  }

  renderLast() {
    const box = $("messages");
    const msgs = this.conversation.messages;
    if (box.lastElementChild) box.lastElementChild.replaceWith(this.messageNode(msgs[msgs.length - 1], msgs.length - 1));
    box.scrollTop = box.scrollHeight;
  }
}
