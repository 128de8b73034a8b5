// Conversations kept in the browser (IndexedDB), with export to and import from JSON.

const DB_NAME = "deepinfer";
const STORE = "conversations";

function open() {
  return new Promise((resolve, reject) => {
    const request = indexedDB.open(DB_NAME, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(STORE, { keyPath: "id" });
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
}

async function run(mode, work) {
  const db = await open();
  return new Promise((resolve, reject) => {
    const tx = db.transaction(STORE, mode);
    const result = work(tx.objectStore(STORE));
    tx.oncomplete = () => { db.close(); resolve(result && "result" in result ? result.result : undefined); };
    tx.onerror = () => { db.close(); reject(tx.error); };
  });
}

export function newConversation() {
  const now = Date.now();
  return { id: `c${now}-${Math.random().toString(36).slice(2, 8)}`, title: "New chat", created: now, updated: now, messages: [] };
}

export const listConversations = async () =>
  ((await run("readonly", (s) => s.getAll())) || []).sort((a, b) => b.updated - a.updated);
export const saveConversation = (c) => run("readwrite", (s) => s.put({ ...c, updated: Date.now() }));
export const deleteConversation = (id) => run("readwrite", (s) => s.delete(id));

export async function exportJSON() {
  return JSON.stringify({ format: "deepinfer-conversations", version: 1, conversations: await listConversations() }, null, 2);
}

// Returns how many conversations were imported; throws with a readable message on a bad file.
export async function importJSON(text) {
  let data;
  try { data = JSON.parse(text); } catch (e) { throw new Error(`not a JSON file: ${e.message}`); }
  const list = Array.isArray(data) ? data : data && data.conversations;
  if (!Array.isArray(list)) throw new Error("expected {\"conversations\": [...]} as written by Export");
  let n = 0;
  for (const c of list) {
    if (!c || typeof c.id !== "string" || !Array.isArray(c.messages)) throw new Error("a conversation needs an id and messages");
    await saveConversation({ title: "Imported chat", created: Date.now(), ...c, imported: true });
    n += 1;
  }
  return n;
}
