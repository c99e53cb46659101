// Conversations and settings in localStorage.
//
// Layout (documented in docs/ui.md, and seeded that way by the browser tests):
//   wsllm.v1.conv.<id>   one conversation as JSON (see newConversation / newMessage)
//   wsllm.v1.active      the id of the conversation on screen
//   wsllm.v1.settings    the settings panel's values and the theme
// One key per conversation, so a streaming answer rewrites only its own conversation.
// A conversation with images is stored with their files while the storage takes it, else with
// their thumbnails only (images.js, `storedForm`; `onImagesLeftOut(conv)` says so, once).

import { DEFAULT_KB, MAX_KB } from "./attachments.js";
import { storedForm } from "./images.js";
import { normalizeSampling, SAMPLING_DEFAULTS } from "./sampling.js";

const PREFIX = "wsllm.v1.";
const CONV = `${PREFIX}conv.`;

export const DEFAULT_SETTINGS = Object.freeze({
  model: "", // the model picked last: new conversations start with it ("" is the server's default)
  ...SAMPLING_DEFAULTS, // temperature, top_p, max_tokens, top_k, ..., seed, stop (sampling.js)
  theme: "auto", // auto | light | dark
  api_key: "", // only for a server started with --api-key
  attach_kb: DEFAULT_KB, // the largest text file that can be attached, in kB (attachments.js)
});
const ROLES = new Set(["user", "assistant", "tool"]);

export function uid(prefix = "") {
  const rnd = crypto.getRandomValues(new Uint32Array(2));
  return `${prefix}${Date.now().toString(36)}${rnd[0].toString(36)}${rnd[1].toString(36)}`.slice(0, 24);
}

export function newConversation() {
  const now = Date.now();
  return { id: uid("c"), title: "New chat", system: "", messages: [], createdAt: now, updatedAt: now };
}

/** role: "user" | "assistant" | "tool". Assistant messages also carry `status` (streaming, done,
 * stopped, error, interrupted, waiting), `stats` ({ttftMs, tokens, tps}), `error`
 * ({code, message}), and while streaming `requestId`, `lastSeq` and `resumeToken` for resume.
 * User messages may carry `attachments` ([{name, size, text}]) and `images` (images.js); a tool message (a result the
 * person typed for a call) carries `toolCallId` and the function's `name`. */
export function newMessage(role, content = "") {
  return { id: uid("m"), role, content, createdAt: Date.now() };
}

/** Coerce stored or typed values into valid settings, never throwing. */
export function normalizeSettings(raw) {
  const s = { ...DEFAULT_SETTINGS, ...(raw && typeof raw === "object" ? raw : {}) };
  return {
    model: typeof s.model === "string" ? s.model : "",
    ...normalizeSampling(s),
    theme: ["auto", "light", "dark"].includes(s.theme) ? s.theme : "auto",
    api_key: typeof s.api_key === "string" ? s.api_key.trim().slice(0, 512) : "",
    attach_kb: clampKb(s.attach_kb),
  };
}

function clampKb(v) {
  const n = typeof v === "number" || (typeof v === "string" && v.trim()) ? Math.round(Number(v)) : NaN;
  return Number.isFinite(n) ? Math.min(MAX_KB, Math.max(1, n)) : DEFAULT_KB;
}

function isConversation(c) {
  return c && typeof c.id === "string" && Array.isArray(c.messages);
}

export class Store {
  constructor(storage = window.localStorage) {
    this.storage = storage;
    this.onError = () => {};
    this.onImagesLeftOut = () => {};
    this._leftOut = new Set(); // conversations stored without their images' files (said once)
    this._pending = new Map(); // conversation id -> {timer, conv} of a throttled save
  }

  _get(key) {
    try {
      const raw = this.storage.getItem(key);
      return raw === null ? null : JSON.parse(raw);
    } catch {
      return null; // unreadable entries are skipped, never fatal
    }
  }

  _set(key, value, quiet = false) {
    try {
      this.storage.setItem(key, JSON.stringify(value));
      return true;
    } catch (err) {
      if (!quiet) this.onError(err);
      return false;
    }
  }

  /** A conversation whole, or (the storage refused it) without its images' files. */
  _setConv(conv) {
    const light = storedForm(conv);
    if (this._set(CONV + conv.id, conv, light !== null)) {
      this._leftOut.delete(conv.id);
      return;
    }
    if (!this._set(CONV + conv.id, light)) return;
    if (!this._leftOut.has(conv.id)) this.onImagesLeftOut(conv);
    this._leftOut.add(conv.id);
  }

  /** All stored conversations, most recently updated first. */
  loadConversations() {
    const out = [];
    for (let k = 0; k < this.storage.length; k++) {
      const key = this.storage.key(k);
      if (!key || !key.startsWith(CONV)) continue;
      const c = this._get(key);
      if (!isConversation(c)) continue;
      c.title = typeof c.title === "string" && c.title ? c.title : "Untitled";
      c.system = typeof c.system === "string" ? c.system : "";
      c.messages = c.messages.filter((m) => m && ROLES.has(m.role));
      for (const m of c.messages) m.content = typeof m.content === "string" ? m.content : String(m.content ?? "");
      c.updatedAt = Number(c.updatedAt) || 0;
      out.push(c);
    }
    return out.sort((a, b) => b.updatedAt - a.updatedAt);
  }

  /** Save now, or at most every `throttleMs` (used while an answer streams). */
  saveConversation(conv, throttleMs = 0) {
    const pending = this._pending.get(conv.id);
    if (throttleMs > 0) {
      if (pending) return;
      const timer = setTimeout(() => {
        this._pending.delete(conv.id);
        this._setConv(conv);
      }, throttleMs);
      this._pending.set(conv.id, { timer, conv });
      return;
    }
    if (pending) {
      clearTimeout(pending.timer);
      this._pending.delete(conv.id);
    }
    this._setConv(conv);
  }

  // Write every throttled save now: the page is going away (a reload within the
  // throttle would lose what was typed last).
  flush() {
    for (const { conv } of [...this._pending.values()]) this.saveConversation(conv);
  }

  deleteConversation(id) {
    clearTimeout(this._pending.get(id)?.timer);
    this._pending.delete(id);
    this.storage.removeItem(CONV + id);
  }

  get activeId() {
    return this._get(`${PREFIX}active`);
  }

  set activeId(id) {
    this._set(`${PREFIX}active`, id);
  }

  loadSettings() {
    return normalizeSettings(this._get(`${PREFIX}settings`));
  }

  saveSettings(settings) {
    this._set(`${PREFIX}settings`, normalizeSettings(settings));
  }

  /** Write new conversations (ids not stored yet) all or none: if the storage refuses
   * one (full), those already written are removed again. Returns whether all were. */
  addConversations(convs) {
    const written = [];
    try {
      for (const c of convs) {
        if (this.storage.getItem(CONV + c.id) !== null) throw new Error(`conversation ${c.id} exists`);
        this.storage.setItem(CONV + c.id, JSON.stringify(c));
        written.push(c.id);
      }
      return true;
    } catch {
      for (const id of written) this.storage.removeItem(CONV + id);
      return false;
    }
  }
}
