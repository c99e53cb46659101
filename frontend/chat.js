// Conversations and the requests that answer them: the state the UI draws.
//
// Each conversation has at most one answer in flight; several conversations can stream
// at once over the same socket. Events: "list" (titles, order or streaming marks
// changed), "conversation" {id} (messages added/removed), "message" {convId, msgId}
// (one message's text, status or figures changed), "refused" {id, error, part} (the conversation's
// answer format or tools cannot be sent, e.g. a bad JSON Schema: nothing was sent; `part` is
// "format" or "tools").

import { addReasoning, endReasoning, mergeToolCalls } from "./answer-data.js";
import { describeError } from "./errors.js";
import { isJsonOutput, outputFields, outputProblem } from "./output-format.js";
import { optionalFields } from "./sampling.js";
import { newConversation, newMessage } from "./store.js";
import { toolsFields, toolsProblem } from "./tools.js";
import { callsOf, chatMessages } from "./wire-messages.js";

const LIVE = new Set(["waiting", "queued", "streaming"]);
const TITLE_LEN = 48;

export { describeError }; // the sentences live in errors.js

export function isLive(msg) {
  return msg.role === "assistant" && LIVE.has(msg.status);
}

export class Chat extends EventTarget {
  constructor(store, ws, getSettings) {
    super();
    this.store = store;
    this.ws = ws;
    this.getSettings = getSettings;
    this.convs = new Map();
    for (const c of store.loadConversations()) this.convs.set(c.id, c);
    this._runtime = new Map(); // message id -> {sentAt, firstAt, deltas}
  }

  _emit(type, detail = {}) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  list() {
    return [...this.convs.values()].sort((a, b) => b.updatedAt - a.updatedAt);
  }

  get(id) {
    return this.convs.get(id) || null;
  }

  create() {
    const conv = newConversation();
    conv.model = this.getSettings().model; // the model picked last (models.js)
    this.convs.set(conv.id, conv);
    this.store.saveConversation(conv);
    this._emit("list");
    return conv;
  }

  rename(id, title) {
    const conv = this.get(id);
    const t = String(title).trim().slice(0, 200);
    if (!conv || !t) return;
    conv.title = t;
    conv.renamed = true;
    this._touch(conv);
  }

  remove(id) {
    this.stop(id);
    this.convs.delete(id);
    this.store.deleteConversation(id);
    this._emit("list");
  }

  /** The conversation's model ("" for the server's default). */
  setModel(id, model) {
    const conv = this.get(id);
    if (!conv || conv.model === model) return;
    conv.model = model;
    this.store.saveConversation(conv);
  }

  /** Delete one message. A question goes with its answer (the answers after it, up to
   * the next question): an answer without its question would mislead the model. An
   * answer goes with the tool results typed for its calls; a result goes alone. Not an
   * answer that is still coming, nor its question: false. */
  deleteMessage(id, msgId) {
    const conv = this.get(id);
    const k = conv ? conv.messages.findIndex((m) => m.id === msgId) : -1;
    if (k < 0) return false;
    let end = k + 1;
    const role = conv.messages[k].role;
    if (role === "user") {
      while (end < conv.messages.length && conv.messages[end].role !== "user") end += 1;
    } else if (role === "assistant") {
      while (end < conv.messages.length && conv.messages[end].role === "tool") end += 1;
    }
    if (conv.messages.slice(k, end).some(isLive)) return false;
    conv.messages.splice(k, end - k);
    this._touch(conv);
    this._emit("conversation", { id: conv.id });
    return true;
  }

  /** Conversations read from a file (conv-io.js), already stored. */
  adopt(convs) {
    for (const c of convs) this.convs.set(c.id, c);
    this._emit("list");
  }

  setSystem(id, text) {
    const conv = this.get(id);
    if (!conv) return;
    conv.system = String(text);
    this.store.saveConversation(conv, 300);
  }

  generating(id) {
    const conv = this.get(id);
    return !!conv && conv.messages.some(isLive);
  }

  /** Ask `text` with `attachments` ([{name, size, text}], attachments.js) and `images`
   * (images.js): false when nothing was sent (nothing to send, an answer still coming, or a
   * refusal). */
  send(id, text, attachments = [], images = []) {
    const conv = this.get(id);
    const some = text.trim() || attachments.length || images.length;
    if (!conv || !some || this.generating(id) || this._refused(conv)) return false;
    const msg = newMessage("user", text);
    if (attachments.length) msg.attachments = attachments.map((a) => ({ name: a.name, size: a.size, text: a.text }));
    if (images.length) msg.images = images.map((im) => ({ ...im }));
    conv.messages.push(msg);
    if (!conv.renamed && conv.messages.filter((m) => m.role === "user").length === 1) {
      const t = (text.trim() || [...images, ...attachments].map((a) => a.name).join(", ")).replace(/\s+/g, " ");
      conv.title = t.length > TITLE_LEN ? `${t.slice(0, TITLE_LEN - 1)}…` : t;
    }
    this._answer(conv);
    return true;
  }

  /** The person's results for the calls of answer `msgId` ([{callId, text}]): stored as tool
   * messages after it (it must be the last answer), then the model answers. False when
   * nothing was sent. */
  replyToTools(id, msgId, results) {
    const conv = this.get(id);
    const k = conv ? conv.messages.findIndex((m) => m.id === msgId) : -1;
    if (k < 0 || this.generating(id) || this._refused(conv)) return false;
    const names = new Map(callsOf(conv.messages[k]).map((c) => [c.id, c.name]));
    const typed = results.filter((r) => names.has(r.callId) && r.text.trim());
    if (!typed.length) return false;
    if (conv.messages.slice(k + 1).some((m) => m.role !== "tool")) return false; // the talk went on
    for (const r of typed) conv.messages.push({ ...newMessage("tool", r.text), toolCallId: r.callId, name: names.get(r.callId) });
    this._answer(conv);
    return true;
  }

  regenerate(id, msgId) {
    const conv = this.get(id);
    if (!conv || this._refused(conv)) return;
    this.stop(id);
    const k = conv.messages.findIndex((m) => m.id === msgId);
    if (k < 0 || conv.messages[k].role !== "assistant") return;
    conv.messages.splice(k);
    this._answer(conv);
  }

  editAndResend(id, msgId, text) {
    const conv = this.get(id);
    if (!conv || !text.trim() || this._refused(conv)) return;
    this.stop(id);
    const k = conv.messages.findIndex((m) => m.id === msgId);
    if (k < 0 || conv.messages[k].role !== "user") return;
    conv.messages[k].content = text;
    conv.messages.splice(k + 1);
    this._answer(conv);
  }

  /** Stop the conversation's answer now; the text so far stays. */
  stop(id) {
    const conv = this.get(id);
    if (!conv) return false;
    let stopped = false;
    for (const msg of conv.messages) {
      if (!isLive(msg)) continue;
      if (msg.requestId) this.ws.cancel(msg.requestId);
      this._finish(conv, msg, "stopped", "abort");
      stopped = true;
    }
    return stopped;
  }

  /** After a page reload: pick up answers that were streaming (if the server can). */
  resumeStored() {
    for (const conv of this.convs.values()) {
      for (const msg of conv.messages) {
        if (!isLive(msg)) continue;
        if (!msg.requestId) {
          this._fail(conv, msg, "unknown_id", "");
          continue;
        }
        const rt = { sentAt: null, firstAt: null, deltas: 0 };
        this._runtime.set(msg.id, rt);
        const after = Number.isInteger(msg.lastSeq) ? msg.lastSeq : -1;
        this.ws.resume(msg.requestId, after, this._handlers(conv, msg, rt), msg.resumeToken);
      }
    }
  }

  // ---- one answer ---------------------------------------------------------------

  /** The conversation's answer format or tools cannot be sent (a bad schema): say why, send nothing. */
  _refused(conv) {
    const format = outputProblem(conv.output);
    const error = format || toolsProblem(conv.tools);
    if (error) this._emit("refused", { id: conv.id, error, part: format ? "format" : "tools" });
    return !!error;
  }

  _payload(conv) {
    const s = this.getSettings(conv); // the conversation's model, the sampling settings
    const p = {
      type: "chat",
      messages: chatMessages(conv), // wire-messages.js
      temperature: s.temperature,
      top_p: s.top_p,
      max_tokens: s.max_tokens,
      ...optionalFields(s), // top_k, min_p, penalties, stop: when set (sampling.js)
    };
    if (s.model) p.model = s.model;
    if (s.seed !== null) p.seed = s.seed;
    Object.assign(p, toolsFields(conv.tools)); // tools and tool_choice (tools.js)
    return Object.assign(p, outputFields(conv.output)); // JSON, a schema or a regex (output-format.js)
  }

  _answer(conv) {
    const payload = this._payload(conv);
    const msg = newMessage("assistant");
    msg.status = "waiting";
    msg.stats = {};
    msg.model = payload.model || this.ws.hello?.model || "";
    if (isJsonOutput(conv.output)) msg.json = true; // shown formatted once complete
    conv.messages.push(msg);
    const rt = { sentAt: performance.now(), firstAt: null, deltas: 0 };
    this._runtime.set(msg.id, rt);
    msg.requestId = this.ws.newId();
    msg.lastSeq = -1;
    this._touch(conv);
    this._emit("conversation", { id: conv.id });
    this.ws.request(payload, this._handlers(conv, msg, rt), msg.requestId);
  }

  _handlers(conv, msg, rt) {
    const changed = () => {
      this._emit("message", { convId: conv.id, msgId: msg.id });
      this.store.saveConversation(conv, 1000);
    };
    // A delta or a piece of reasoning arrived: figures and the resume position.
    const progress = (seq) => {
      const now = performance.now();
      if (rt.firstAt === null) {
        rt.firstAt = now;
        if (rt.sentAt !== null && msg.stats.ttftMs === undefined) msg.stats.ttftMs = now - rt.sentAt;
      }
      rt.deltas += 1;
      rt.lastAt = now;
      msg.status = "streaming";
      msg.reconnecting = false;
      msg.lastSeq = seq;
      msg.stats.tokens = rt.deltas; // an estimate until `done` brings usage
      msg.stats.tps = rate(rt.deltas, rt.firstAt, now);
      return now;
    };
    return {
      sent: () => {
        rt.sentAt = performance.now();
      },
      started: (token) => {
        msg.resumeToken = token; // only this client may resume the answer (e.g. after a reload)
        this.store.saveConversation(conv);
      },
      queued: (position) => {
        if (!isLive(msg)) return;
        msg.status = "queued";
        msg.queuePosition = position;
        changed();
      },
      interrupted: () => {
        if (!isLive(msg)) return;
        msg.reconnecting = true;
        changed();
      },
      delta: (text, seq, toolCalls) => {
        if (!isLive(msg)) return;
        const now = progress(seq);
        if (text || toolCalls) endReasoning(msg, rt, now);
        msg.content += text;
        if (toolCalls) mergeToolCalls(msg, toolCalls); // answer-data.js
        changed();
      },
      reasoning: (text, seq) => {
        if (!isLive(msg)) return;
        addReasoning(msg, text, rt, progress(seq)); // the Thinking block (answer-data.js)
        changed();
      },
      done: (m) => {
        const tokens = m.usage?.completion_tokens;
        if (m.usage && typeof m.usage === "object") msg.usage = m.usage; // the context meter's figures
        if (isLive(msg)) {
          const status = m.finish_reason === "abort" ? "stopped" : "done";
          this._finish(conv, msg, status, m.finish_reason || "stop", tokens);
        } else if (Number.isInteger(tokens)) {
          msg.stats.tokens = tokens; // the server's count for an answer stopped here
          this._emit("message", { convId: conv.id, msgId: msg.id });
          this.store.saveConversation(conv);
        }
      },
      error: (e) => {
        if (!isLive(msg)) return;
        // Any refusal of a resume (unknown_id, or a server without resume) means the
        // rest of this answer is lost: keep the text so far, marked interrupted.
        if (e.resumed) this._fail(conv, msg, "unknown_id", "", "interrupted");
        else this._fail(conv, msg, e.code, e.message, "error", e.param, e.retryAfterS);
      },
    };
  }

  _finish(conv, msg, status, finishReason, tokens) {
    const rt = this._runtime.get(msg.id);
    this._runtime.delete(msg.id);
    msg.status = status;
    msg.finishReason = finishReason;
    msg.reconnecting = false;
    endReasoning(msg, rt, rt?.lastAt ?? performance.now()); // an answer that was all thinking
    if (Number.isInteger(tokens)) msg.stats.tokens = tokens;
    if (rt && rt.firstAt !== null) {
      // Speed over the time tokens actually arrived (not the wait on a lost socket).
      const n = Number.isInteger(tokens) ? tokens : rt.deltas;
      const end = status === "done" ? performance.now() : rt.lastAt;
      msg.stats.tps = rate(n, rt.firstAt, end);
    }
    delete msg.requestId;
    delete msg.lastSeq;
    delete msg.resumeToken;
    delete msg.queuePosition;
    this._touch(conv);
    this._emit("message", { convId: conv.id, msgId: msg.id });
  }

  _fail(conv, msg, code, message, status = "error", param = null, retryAfterS = null) {
    msg.error = { code, message: describeError(code, message, param, { retryAfterS, model: msg.model }) };
    this._finish(conv, msg, status, status);
    this._emit("failed", { convId: conv.id, msgId: msg.id, code }); // app.js: a model_not_found reloads the list
  }

  _touch(conv) {
    conv.updatedAt = Date.now();
    this.store.saveConversation(conv);
    this._emit("list");
  }
}

/** Decode speed: tokens after the first over the time since the first. */
function rate(tokens, firstAt, now) {
  const secs = (now - firstAt) / 1000;
  if (tokens < 2 || secs <= 0) return null;
  return (tokens - 1) / secs;
}
