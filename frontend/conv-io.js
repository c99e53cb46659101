// Conversations to and from files: export one or all as JSON (to import again) or as
// Markdown (to read), and import a JSON export.
//
// An export holds each conversation as stored, every field included (also fields this
// version does not know), less the secrets of a streaming answer (`resumeToken`,
// `requestId`, `lastSeq`). An import is checked whole before anything is written: a
// file that is not JSON, or not conversations, or has one bad conversation, gets a
// message and changes nothing. It never overwrites: a conversation already stored (same
// id, same content) is skipped, and one whose id is taken by a different conversation
// comes in as a copy with a new id. A message's images travel whole (their data: URLs, or the
// thumbnail of one that was not kept); an image's `url` and `thumb` must be data: URLs of an
// image (images.js), so an imported conversation can make the page fetch nothing.

import { MAX_FILES, messageText } from "./attachments.js";
import { imagesOf, isImageDataUrl } from "./images.js";
import { uid } from "./store.js";
import { toolsShapeProblem } from "./tools.js";
import { callsOf } from "./wire-messages.js";

export const FORMAT = "wsllm-conversations";
export const VERSION = 1;
export const MAX_FILE_BYTES = 20 * 1024 * 1024;
const MAX_ID = 128;
const LIVE = new Set(["waiting", "queued", "streaming"]);
const MAX_IMAGES = 64; // a message's: the most the server's wire takes (MAX_WIRE_IMAGES)
const SECRETS = ["requestId", "lastSeq", "resumeToken"]; // a streaming answer's, to resume it

export class ImportError extends Error {}

const isObj = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

/** A copy of a conversation fit for a file: no resume secrets. */
function exportable(conv) {
  const c = JSON.parse(JSON.stringify(conv));
  for (const m of c.messages) for (const k of SECRETS) delete m[k];
  return c;
}

export function toJson(convs, now = new Date()) {
  const body = { format: FORMAT, version: VERSION, exportedAt: now.toISOString(), conversations: convs.map(exportable) };
  return `${JSON.stringify(body, null, 2)}\n`;
}

function when(ms) {
  const d = new Date(Number(ms) || 0);
  return Number.isFinite(d.getTime()) && ms ? d.toISOString().slice(0, 16).replace("T", " ") : "";
}

/** A message's part of the Markdown: questions as typed with their files as fenced blocks,
 * answers (Markdown already) with their tool calls, results as typed. */
function messageMarkdown(m) {
  if (m.role === "tool") return [`## Tool result (${m.name || "?"}, ${m.toolCallId})`, "", m.content || "*(no text)*", ""];
  const who = m.role === "user" ? "You" : `Assistant${m.model ? ` (${m.model})` : ""}`;
  const text = m.role === "user" ? messageText(m) : m.content;
  const calls = m.role === "assistant" ? callsOf(m) : [];
  const lines = [`## ${who}`, ""];
  for (const im of m.role === "user" ? imagesOf(m) : []) {
    lines.push(`*Image “${im.name}”${im.width ? ` (${im.width}×${im.height})` : ""}: in the JSON export*`, "");
  }
  if (text || !calls.length) lines.push(text || "*(no text)*", "");
  for (const c of calls) lines.push(`**Tool call** \`${c.name}\` (${c.id}):`, "", "```json", String(c.arguments ?? ""), "```", "");
  return lines;
}

/** One conversation as Markdown: its title, model and system prompt, then each message
 * under "You", "Assistant" or "Tool result". */
export function conversationMarkdown(conv) {
  const lines = [`# ${conv.title || "Untitled"}`, ""];
  const meta = [when(conv.createdAt) && `Started ${when(conv.createdAt)} UTC`, conv.model && `model: ${conv.model}`];
  if (meta.some(Boolean)) lines.push(`*${meta.filter(Boolean).join(" · ")}*`, "");
  if (conv.system?.trim()) lines.push("**System prompt:**", "", ...conv.system.split("\n").map((l) => `> ${l}`), "");
  for (const m of conv.messages) {
    lines.push(...messageMarkdown(m));
    if (m.error?.message) lines.push(`> **Error:** ${m.error.message}`, "");
  }
  return lines.join("\n");
}

export function toMarkdown(convs) {
  return `${convs.map(conversationMarkdown).join("\n---\n\n").trimEnd()}\n`;
}

/** "wsllm-<name>-2026-11-25.json": the name made safe for every file system. */
export function fileName(name, ext, now = new Date()) {
  const slug = String(name).toLowerCase().normalize("NFKD").replace(/[^a-z0-9]+/g, "-").replace(/^-+|-+$/g, "").slice(0, 48);
  return `wsllm-${slug || "conversation"}-${now.toISOString().slice(0, 10)}.${ext}`;
}

/** Save text as a file through a[download] (no server round trip). */
export function download(name, text, type) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  a.hidden = true;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

// ---- import -----------------------------------------------------------------------

function fail(where, what) {
  throw new ImportError(`${where}: ${what}`);
}

function checkId(v, where) {
  if (typeof v !== "string" || !v || v.length > MAX_ID) fail(where, `"id" must be a text of 1 to ${MAX_ID} characters`);
}

function checkOptional(obj, where, key, type) {
  if (!(key in obj) || obj[key] === null) return;
  const ok = type === "number" ? Number.isFinite(obj[key]) : type === "object" ? isObj(obj[key]) : typeof obj[key] === type;
  if (!ok) fail(where, `"${key}" must be ${type === "object" ? "an object" : `a ${type}`}`);
}

// A list field of a message: at most `most` objects whose `keys` are texts.
function checkList(m, where, key, most, keys) {
  if (!(key in m) || m[key] === null) return;
  const list = m[key];
  if (!Array.isArray(list) || list.length > most) fail(where, `"${key}" must be a list of at most ${most}`);
  for (const [k, item] of list.entries()) {
    if (!isObj(item) || keys.some((f) => typeof item[f] !== "string")) {
      fail(where, `"${key}" ${k + 1} must be an object whose ${keys.map((f) => `"${f}"`).join(", ")} are texts`);
    }
  }
}

// A message's images: each named, with a data: URL of an image for its file or its thumbnail.
function checkImages(m, where) {
  checkList(m, where, "images", MAX_IMAGES, ["name"]);
  for (const [k, im] of (m.images || []).entries()) {
    const bad = ["url", "thumb"].filter((f) => im[f] != null && !isImageDataUrl(im[f]));
    if (bad.length || !(im.url || im.thumb)) {
      fail(where, `image ${k + 1} needs a "url" or "thumb" that is a data: URL of a PNG, JPEG, WebP or GIF image`);
    }
  }
}

function checkMessage(m, where) {
  if (!isObj(m)) fail(where, "is not an object");
  checkId(m.id, where);
  if (!["user", "assistant", "tool"].includes(m.role)) fail(where, `"role" must be "user", "assistant" or "tool"`);
  if (typeof m.content !== "string") fail(where, `"content" must be a text`);
  const callId = m.toolCallId;
  if (m.role === "tool" && (typeof callId !== "string" || !callId || callId.length > MAX_ID)) {
    fail(where, `a tool result needs "toolCallId", the id of the call it answers (a text of 1 to ${MAX_ID} characters)`);
  }
  checkOptional(m, where, "createdAt", "number");
  for (const key of ["status", "model", "finishReason", "name"]) checkOptional(m, where, key, "string");
  for (const key of ["stats", "usage", "error"]) checkOptional(m, where, key, "object");
  checkList(m, where, "attachments", MAX_FILES, ["name", "text"]);
  checkImages(m, where);
  checkList(m, where, "toolCalls", 128, ["name", "arguments"]);
}

function checkConversation(c, k) {
  const named = isObj(c) && typeof c.title === "string" ? ` (“${c.title.slice(0, 40)}”)` : "";
  const where = `Conversation ${k + 1}${named}`;
  if (!isObj(c)) fail(where, "is not an object");
  checkId(c.id, where);
  if (typeof c.title !== "string") fail(where, `"title" must be a text`);
  checkOptional(c, where, "system", "string");
  checkOptional(c, where, "model", "string");
  checkOptional(c, where, "createdAt", "number");
  checkOptional(c, where, "updatedAt", "number");
  if ("tools" in c && c.tools !== null) {
    const problem = toolsShapeProblem(c.tools);
    if (problem) fail(where, problem);
  }
  if (!Array.isArray(c.messages)) fail(where, `"messages" must be a list`);
  const ids = new Set();
  c.messages.forEach((m, j) => {
    checkMessage(m, `${where}, message ${j + 1}`);
    if (ids.has(m.id)) fail(`${where}, message ${j + 1}`, `the id "${m.id}" is used twice`);
    ids.add(m.id);
  });
}

/** The conversations of an exported file's text, checked; throws ImportError with a
 * sentence saying what is wrong. Takes the export's envelope, a bare list of
 * conversations, or one conversation. */
export function parseConversations(text) {
  let data;
  try {
    data = JSON.parse(text);
  } catch (err) {
    throw new ImportError(`This file is not valid JSON (${err.message}).`);
  }
  let list;
  if (Array.isArray(data)) list = data;
  else if (isObj(data) && data.format === FORMAT) {
    if (!Number.isInteger(data.version) || data.version > VERSION) {
      throw new ImportError(`This file was made by a newer version of wsllm (format version ${data.version}).`);
    }
    list = data.conversations;
    if (!Array.isArray(list)) throw new ImportError(`This file has no list of "conversations".`);
  } else if (isObj(data) && "messages" in data) list = [data];
  else throw new ImportError("This is JSON, but not conversations exported from wsllm.");
  if (!list.length) throw new ImportError("This file holds no conversations.");
  list.forEach(checkConversation);
  const ids = new Set();
  for (const [k, c] of list.entries()) {
    if (ids.has(c.id)) fail(`Conversation ${k + 1}`, `the id "${c.id}" is used twice in the file`);
    ids.add(c.id);
  }
  return list.map(settle);
}

/** An answer that was streaming when it was exported cannot go on: it is interrupted. */
function settle(c) {
  for (const m of c.messages) {
    for (const k of SECRETS) delete m[k];
    if (LIVE.has(m.status)) {
      m.status = "interrupted";
      m.reconnecting = false;
    }
  }
  return c;
}

/** JSON with keys sorted: equal content gives equal text. */
function canonical(v) {
  if (Array.isArray(v)) return `[${v.map(canonical).join(",")}]`;
  if (isObj(v)) return `{${Object.keys(v).sort().map((k) => `${JSON.stringify(k)}:${canonical(v[k])}`).join(",")}}`;
  return JSON.stringify(v);
}

/** Which conversations to add (copies get new ids) and how many are already here.
 * `has(id)` gives the stored conversation of that id, or null. */
export function planImport(list, has) {
  const add = [];
  let same = 0;
  let copies = 0;
  for (const c of list) {
    const here = has(c.id);
    if (!here) add.push(c);
    else if (canonical(exportable(here)) === canonical(c)) same += 1;
    else {
      copies += 1;
      add.push({ ...c, id: uid("c") });
    }
  }
  return { add, same, copies };
}

/** What an import did, in a sentence. */
export function importSummary({ add, same, copies }) {
  const n = (k, word) => `${k} ${word}${k === 1 ? "" : "s"}`;
  const parts = [];
  if (add.length) parts.push(`Imported ${n(add.length, "conversation")}.`);
  if (copies) parts.push(`${n(copies, "conversation")} had the id of a different one here and came in as ${copies === 1 ? "a copy" : "copies"}.`);
  if (same) parts.push(`${n(same, "conversation")} ${same === 1 ? "was" : "were"} already here.`);
  return parts.join(" ") || "Nothing to import.";
}
