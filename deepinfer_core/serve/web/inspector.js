// The prompt inspector: POST /v1/inspect, then the rendered prompt with special tokens marked,
// the token ids, where each KV block is cached and what the output parser extracts.

import { postJSON } from "./api.js";

const $ = (id) => document.getElementById(id);

export class Inspector {
  constructor(chat) {
    this.chat = chat;
    $("inspect-load").addEventListener("click", () => this.loadChat());
    $("inspect-run").addEventListener("click", () => this.run());
    $("show-boundaries").addEventListener("change", () => {
      for (const t of $("inspect-prompt").querySelectorAll(".tok")) t.classList.toggle("boundary", $("show-boundaries").checked);
    });
  }

  // The prompt the last reply was generated from, and that reply's text as output to parse.
  loadChat() {
    const messages = this.chat.apiMessages();
    let output = "";
    if (messages.length && messages[messages.length - 1].role === "assistant") output = messages.pop().content;
    $("inspect-messages").value = JSON.stringify(messages.length ? messages : [{ role: "user", content: "Hello!" }], null, 2);
    $("inspect-output").value = output;
  }

  show() {
    if (!$("inspect-messages").value.trim()) this.loadChat();
  }

  async run() {
    const error = $("inspect-error");
    error.hidden = true;
    let messages;
    try { messages = JSON.parse($("inspect-messages").value); } catch (e) {
      error.textContent = `the messages box is not valid JSON: ${e.message}`;
      error.hidden = false;
      return;
    }
    let settings;
    try { settings = this.chat.settings(); } catch (e) { // the chat's settings apply here too
      error.textContent = e.message;
      error.hidden = false;
      return;
    }
    delete settings.stream_options;
    const body = { request: { ...settings, messages } };
    const output = $("inspect-output").value;
    if (output) body.output = output;
    try {
      this.render(await postJSON("v1/inspect", body));
    } catch (e) {
      error.textContent = e.message;
      error.hidden = false;
    }
  }

  render(r) {
    $("inspect-result").hidden = false;
    const cachedBlocks = r.blocks.filter((b) => b.tier).length;
    $("inspect-summary").textContent =
      `${r.num_tokens} tokens (context ${r.max_model_len}), encoding ${r.encoding}; ` +
      `${r.blocks.length} full blocks of ${r.block_size} tokens, ${cachedBlocks} cached; ` +
      `${r.cached_tokens} prompt tokens would come from the cache` + (r.prefix_caching ? "" : " (prefix caching is off)");
    $("inspect-blocks").replaceChildren(...r.blocks.map((b) => {
      const cell = document.createElement("span");
      cell.className = `tier tier-${b.tier || "none"}`;
      cell.textContent = `${b.start}–${b.end}`;
      cell.title = `block ${b.index}: tokens ${b.start}–${b.end - 1}, ${b.tier || "not cached"}`;
      cell.setAttribute("role", "img");
      cell.setAttribute("aria-label", cell.title);
      return cell;
    }));
    const boundaries = $("show-boundaries").checked;
    $("inspect-prompt").replaceChildren(...r.prompt.tokens.map((t, i) => {
      const span = document.createElement("span");
      span.className = "tok" + (t.special ? " special" : "") + (boundaries ? " boundary" : "");
      span.textContent = t.text ?? `[${t.id}]`;
      span.title = `#${i} id ${t.id}` + (t.special ? " (special token)" : "");
      return span;
    }));
    $("inspect-ids").textContent = r.prompt.tokens.map((t) => t.id).join(" ");
    const parsed = r.parsed;
    const rows = parsed
      ? [["content", parsed.content], ["reasoning", parsed.reasoning || "—"],
         ["tool calls", parsed.tool_calls.length ? parsed.tool_calls.map((c) => `${c.name}(${c.arguments})`).join("\n") : "—"]]
      : [["", "give a model output above to see what the parser extracts"]];
    $("inspect-parsed").replaceChildren(...rows.map(([k, v]) => {
      const tr = document.createElement("tr");
      const th = document.createElement("th");
      th.scope = "row";
      th.textContent = k;
      const td = document.createElement("td");
      td.textContent = v;
      td.style.whiteSpace = "pre-wrap";
      tr.append(th, td);
      return tr;
    }));
    $("inspect-sampling").textContent = JSON.stringify({ ...r.sampling, stop_token_ids: r.stop_token_ids, thinking: r.thinking }, null, 1);
  }
}
