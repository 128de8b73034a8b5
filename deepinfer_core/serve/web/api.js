// The server's public HTTP API, by relative URLs (the page's <base href> carries any --root-path).

export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

// The message of an error body in any protocol's shape (OpenAI, Anthropic, FastAPI).
export function errorMessage(body, fallback) {
  if (body && typeof body === "object") {
    const err = body.error;
    if (err && typeof err === "object" && err.message) return err.message;
    if (typeof err === "string") return err;
    if (body.detail) return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    if (body.message) return body.message;
  }
  return fallback;
}

async function failure(response) {
  const text = await response.text();
  let body = null;
  try { body = JSON.parse(text); } catch { /* not JSON */ }
  return new ApiError(errorMessage(body, text || `HTTP ${response.status}`), response.status);
}

export async function getJSON(url) {
  const response = await fetch(url, { headers: { Accept: "application/json" } });
  if (!response.ok) throw await failure(response);
  return response.json();
}

export async function getText(url) {
  const response = await fetch(url);
  if (!response.ok) throw await failure(response);
  return response.text();
}

export async function postJSON(url, body, signal) {
  const response = await fetch(url, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await failure(response);
  return response.json();
}

// POST with stream: true; calls onEvent(parsed JSON) for every server-sent event until [DONE].
export async function postStream(url, body, onEvent, signal) {
  const response = await fetch(url, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
    body: JSON.stringify({ ...body, stream: true }),
    signal,
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const event = JSON.parse(data);
      if (event.error) throw new ApiError(errorMessage(event, "the stream failed"), 500);
      onEvent(event);
    }
  }
}
