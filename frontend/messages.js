// The message list of the conversation on screen.
//
// Streaming updates are coalesced: deltas mark a message dirty and one animation frame
// re-renders the dirty messages, so a fast stream costs one render per frame, not per
// token. Markdown is re-rendered from the whole text and patched block by block.

import { iconButton, setIcon } from "./icons.js";
import { renderAnswer } from "./answer-parts.js";
import { renderChips } from "./attachments.js";
import { isLive } from "./chat.js";
import { renderToolReplies, renderToolResult } from "./tool-replies.js";

const NEAR_BOTTOM_PX = 80;
const CONFIRM_MS = 3000;
const WHO = { user: "You said:", assistant: "Assistant said:", tool: "Tool result:" };
const WHAT = { user: "this message and its answer", assistant: "this answer", tool: "this result" };

/** Delete one message: a question goes with its answer (Chat.deleteMessage). */
function deleteButton(msg, confirming) {
  const what = WHAT[msg.role];
  const b = iconButton("trash", confirming ? `Press again to delete ${what}` : `Delete ${what}`, {
    cls: `icon-btn${confirming ? " confirm" : ""}`,
    text: confirming ? "Delete?" : "",
  });
  b.dataset.action = "delete";
  return b;
}

export function formatMs(ms) {
  if (ms < 1000) return `${Math.round(ms)} ms`;
  return `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
}

/** Copy text, with a fallback for pages that are not a secure context. */
export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    const ta = document.createElement("textarea");
    ta.value = text;
    ta.setAttribute("readonly", "");
    ta.className = "offscreen";
    document.body.appendChild(ta);
    ta.select();
    let ok = false;
    try {
      ok = document.execCommand("copy");
    } catch {
      ok = false;
    }
    ta.remove();
    return ok;
  }
}

function flashCopied(button) {
  setIcon(button, "check");
  button.classList.add("copied");
  setTimeout(() => {
    setIcon(button, "copy");
    button.classList.remove("copied");
  }, 1200);
}

export class MessageView {
  /** `actions`: {regenerate(msg), edit(msg, text), deleteMessage(msg), replyTools(msg, results),
   * connected()} */
  constructor(container, actions) {
    this.el = container;
    this.actions = actions;
    this.conv = null;
    this.nodes = new Map(); // message id -> element
    this.dirty = new Set();
    this.editing = null; // id of the user message being edited
    this.confirmDelete = null; // id of the message whose delete button asks "Delete?"
    this._frame = 0;
    this._cost = 0; // milliseconds the last repaint took
    container.addEventListener("click", (ev) => this._onClick(ev));
  }

  /** Draw a conversation from scratch. */
  show(conv) {
    this.conv = conv;
    this.editing = null;
    this.nodes.clear();
    this.dirty.clear();
    this.el.replaceChildren();
    for (const msg of conv ? conv.messages : []) this._append(msg);
    this.el.scrollTop = this.el.scrollHeight;
  }

  /** Messages were added or removed: add/remove nodes, keep the others. */
  sync() {
    if (!this.conv) return;
    const ids = new Set(this.conv.messages.map((m) => m.id));
    for (const [id, node] of this.nodes) {
      if (!ids.has(id)) {
        node.remove();
        this.nodes.delete(id);
      }
    }
    const stick = this._nearBottom();
    for (const msg of this.conv.messages) {
      if (!this.nodes.has(msg.id)) this._append(msg);
      else this.dirty.add(msg.id); // action buttons depend on position
    }
    this._schedule();
    if (stick || this.conv.messages.at(-1)?.role === "assistant") this._scrollToEnd();
  }

  update(msgId) {
    if (!this.nodes.has(msgId)) return;
    this.dirty.add(msgId);
    this._schedule();
  }

  /** Redraw everything visible (connection state changed, etc.). */
  refresh() {
    for (const id of this.nodes.keys()) this.dirty.add(id);
    this._schedule();
  }

  _schedule() {
    if (this._frame) return;
    const run = () => {
      this._frame = 0;
      const t0 = performance.now();
      this._flush();
      this._cost = performance.now() - t0;
    };
    // Hidden tabs get no animation frames; a timer still drains the work. A long
    // answer whose re-render costs more than half a frame is repainted less often,
    // so rendering never takes more than about a third of the time.
    if (document.hidden) this._frame = setTimeout(run, 100);
    else if (this._cost > 8) this._frame = setTimeout(run, Math.min(this._cost * 2, 500));
    else this._frame = requestAnimationFrame(run);
  }

  _flush() {
    if (!this.conv) return;
    const stick = this._nearBottom();
    for (const id of this.dirty) {
      const msg = this.conv.messages.find((m) => m.id === id);
      const node = this.nodes.get(id);
      if (msg && node) this._render(msg, node);
    }
    this.dirty.clear();
    if (stick) this._scrollToEnd();
  }

  _nearBottom() {
    const el = this.el;
    return el.scrollHeight - el.scrollTop - el.clientHeight < NEAR_BOTTOM_PX;
  }

  _scrollToEnd() {
    this.el.scrollTop = this.el.scrollHeight;
  }

  _append(msg) {
    const node = document.createElement("article");
    node.className = `msg ${msg.role}`;
    node.dataset.id = msg.id;
    const who = document.createElement("h3");
    who.className = "visually-hidden";
    who.textContent = WHO[msg.role];
    const body = document.createElement("div");
    body.className = msg.role === "assistant" ? "msg-body markdown" : "msg-body plain";
    // The files of a question (chips), the result boxes under an answer's tool calls.
    const extra = document.createElement("div");
    extra.className = msg.role === "user" ? "msg-files" : "msg-replies";
    extra.hidden = true;
    const status = document.createElement("div");
    status.className = "msg-status";
    const error = document.createElement("div");
    error.className = "msg-error";
    error.setAttribute("role", "alert");
    const foot = document.createElement("div");
    foot.className = "msg-foot";
    node.append(who, body, extra, status, error, foot);
    this.el.appendChild(node);
    this.nodes.set(msg.id, node);
    this._render(msg, node);
  }

  _render(msg, node) {
    const [, body, extra, status, error, foot] = node.children;
    node.dataset.status = msg.status || "done";
    node.setAttribute("aria-busy", String(isLive(msg)));
    if (this.editing === msg.id) {
      if (!body.querySelector("textarea")) this._editor(msg, body);
      body.hidden = false;
    } else if (msg.role === "user") {
      if (body.textContent !== msg.content || body.firstElementChild) body.textContent = msg.content;
      body.hidden = !msg.content; // a message of files only: just its chips
    } else if (msg.role === "tool") {
      renderToolResult(body, msg); // tool-replies.js
    } else {
      // Thinking, the answer, tool calls (answer-parts.js); code left unhighlighted for lack of
      // time in this frame is done in a later one.
      if (renderAnswer(body, msg, isLive(msg))) setTimeout(() => this.update(msg.id), 50);
    }
    if (msg.role === "user") renderChips(extra, msg);
    else if (msg.role === "assistant") renderToolReplies(extra, this.conv, msg, (results) => this.actions.replyTools(msg, results));
    const statusText = this._statusText(msg);
    status.textContent = statusText;
    status.hidden = !statusText;
    status.classList.toggle("busy", !!statusText && isLive(msg));
    error.textContent = msg.error?.message || "";
    error.hidden = !msg.error;
    this._renderFoot(msg, foot);
  }

  _statusText(msg) {
    if (msg.role !== "assistant") return "";
    if (isLive(msg) && msg.reconnecting) return "Connection lost, reconnecting…";
    if (msg.status === "waiting") {
      return this.actions.connected() ? "Waiting for the model…" : "Waiting for the connection…";
    }
    if (msg.status === "queued") return `Queued${msg.queuePosition != null ? ` (position ${msg.queuePosition})` : ""}…`;
    return "";
  }

  _renderFoot(msg, foot) {
    const live = isLive(msg);
    const last = this.conv.messages.at(-1)?.id === msg.id;
    const confirming = this.confirmDelete === msg.id;
    const key = [msg.status, live, last, this.editing === msg.id, JSON.stringify(msg.stats || {}), msg.finishReason, confirming].join("|");
    if (foot.dataset.key === key) return;
    foot.dataset.key = key;
    foot.replaceChildren();
    if (msg.role === "assistant") foot.appendChild(this._figures(msg));
    const actions = document.createElement("div");
    actions.className = "msg-actions";
    if (!live && this.editing !== msg.id) {
      if (msg.content) {
        const copy = iconButton("copy", msg.role === "user" ? "Copy your message" : "Copy answer");
        copy.dataset.action = "copy";
        actions.appendChild(copy);
      }
      if (msg.role === "user") {
        const edit = iconButton("edit", "Edit and resend");
        edit.dataset.action = "edit";
        actions.appendChild(edit);
      } else if (msg.role === "assistant" && last) {
        const regen = iconButton("regenerate", msg.error ? "Try again" : "Regenerate answer");
        regen.dataset.action = "regenerate";
        actions.appendChild(regen);
      }
      actions.appendChild(deleteButton(msg, confirming));
    }
    foot.appendChild(actions);
  }

  _figures(msg) {
    const box = document.createElement("div");
    box.className = "figures";
    const st = msg.stats || {};
    const add = (testid, text, title) => {
      if (!text) return;
      const s = document.createElement("span");
      s.dataset.testid = testid;
      s.textContent = text;
      s.title = title;
      box.appendChild(s);
    };
    add("ttft", st.ttftMs != null ? `TTFT ${formatMs(st.ttftMs)}` : "", "Time to first token");
    add("tps", st.tps != null ? `${st.tps.toFixed(1)} tok/s` : "", "Decode speed, tokens per second");
    add("tokens", st.tokens != null ? `${st.tokens} token${st.tokens === 1 ? "" : "s"}` : "", "Tokens in this answer");
    const reason = { stopped: "stopped", interrupted: "interrupted" }[msg.status] || (msg.finishReason === "length" ? "max tokens" : "");
    add("finish", reason, "Why the answer ended");
    return box;
  }

  _editor(msg, body) {
    body.replaceChildren();
    const label = document.createElement("label");
    label.className = "visually-hidden";
    label.textContent = "Edit your message";
    const ta = document.createElement("textarea");
    ta.className = "edit-box";
    ta.id = `edit-${msg.id}`;
    label.htmlFor = ta.id;
    ta.value = msg.content;
    ta.rows = Math.min(12, Math.max(2, msg.content.split("\n").length));
    const row = document.createElement("div");
    row.className = "edit-actions";
    const save = document.createElement("button");
    save.type = "button";
    save.className = "btn primary";
    save.dataset.action = "edit-save";
    save.textContent = "Save & send";
    const cancel = document.createElement("button");
    cancel.type = "button";
    cancel.className = "btn";
    cancel.dataset.action = "edit-cancel";
    cancel.textContent = "Cancel";
    row.append(save, cancel);
    body.append(label, ta, row);
    ta.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        save.click();
      } else if (ev.key === "Escape") {
        ev.preventDefault();
        ev.stopPropagation();
        cancel.click();
      }
    });
    requestAnimationFrame(() => ta.focus());
  }

  /** Re-render one message now and keep focus on its button of the same action. */
  _flushNow(id, button) {
    const node = this.nodes.get(id);
    const msg = this.conv?.messages.find((m) => m.id === id);
    const action = button.dataset.action;
    if (node && msg) this._render(msg, node);
    node?.querySelector(`.msg-foot [data-action="${action}"]`)?.focus();
  }

  _setEditing(id) {
    const prev = this.editing;
    this.editing = id;
    for (const x of [prev, id]) if (x) this.update(x);
  }

  async _onClick(ev) {
    const button = ev.target.closest("button");
    if (!button || !this.el.contains(button) || !this.conv) return;
    if (button.classList.contains("copy-code")) {
      const code = button.closest(".codeblock")?.querySelector("code");
      if (code && (await copyText(code.textContent))) {
        button.textContent = "Copied";
        setTimeout(() => (button.textContent = "Copy"), 1200);
      }
      return;
    }
    const node = button.closest(".msg");
    const msg = node && this.conv.messages.find((m) => m.id === node.dataset.id);
    if (!msg) return;
    switch (button.dataset.action) {
      case "copy":
        if (await copyText(msg.content)) flashCopied(button);
        break;
      case "edit":
        this._setEditing(msg.id);
        break;
      case "edit-cancel":
        this._setEditing(null);
        node.querySelector('[data-action="edit"]')?.focus();
        break;
      case "edit-save": {
        const text = node.querySelector("textarea.edit-box")?.value ?? "";
        if (!text.trim()) return;
        this.editing = null;
        this.actions.edit(msg, text);
        break;
      }
      case "regenerate":
        this.actions.regenerate(msg);
        break;
      case "delete": // press twice within CONFIRM_MS, as for conversations
        clearTimeout(this._confirmTimer);
        if (this.confirmDelete === msg.id) {
          this.confirmDelete = null;
          this.actions.deleteMessage(msg);
        } else {
          const prev = this.confirmDelete;
          this.confirmDelete = msg.id;
          if (prev) this.update(prev);
          this._confirmTimer = setTimeout(() => {
            this.confirmDelete = null;
            this.update(msg.id);
          }, CONFIRM_MS);
          this._flushNow(msg.id, button);
        }
        break;
      default:
        break;
    }
  }
}
