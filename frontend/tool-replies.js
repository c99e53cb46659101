// Under the last answer, when it called tools: a box per call for the person to type the
// call's result. "Send results" stores them as tool messages (each with its call's id) and
// asks the model again (Chat.replyToTools); a call left empty has no result, and typing the
// next message instead goes on without any.
//
// The form is rebuilt only when the calls waiting for a result change, so text typed into
// it survives the repaints of the message list.

import { callsOf } from "./wire-messages.js";

/** The calls of `msg` that wait for a result: it is the last answer (only results after it),
 * it ended by itself, and no result names them yet. */
export function waitingCalls(conv, msg) {
  if (msg.role !== "assistant" || msg.status !== "done") return [];
  const k = conv.messages.indexOf(msg);
  const after = conv.messages.slice(k + 1);
  if (k < 0 || after.some((m) => m.role !== "tool")) return [];
  const answered = new Set(after.map((m) => m.toolCallId));
  return callsOf(msg).filter((c) => !answered.has(c.id));
}

/** Draw the form of `msg` into `box` (empty it when no call waits). `send(results)` gets
 * [{callId, text}] and says whether they went. */
export function renderToolReplies(box, conv, msg, send) {
  const calls = waitingCalls(conv, msg);
  const key = calls.map((c) => c.id).join(" ");
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.hidden = !calls.length;
  if (!calls.length) {
    box.replaceChildren();
    return;
  }
  const form = document.createElement("form");
  form.className = "tool-reply";
  form.setAttribute("aria-label", "Results of the tool calls");
  const boxes = calls.map((c, j) => {
    const id = `reply-${msg.id}-${j}`;
    const label = document.createElement("label");
    label.htmlFor = id;
    label.append("Result of ");
    const name = document.createElement("code");
    name.textContent = c.name;
    label.append(name);
    const area = document.createElement("textarea");
    area.id = id;
    area.rows = 2;
    area.spellcheck = false;
    area.placeholder = "What the function returned, e.g. JSON";
    area.dataset.callId = c.id;
    area.addEventListener("keydown", (ev) => ev.key === "Escape" && ev.stopPropagation());
    form.append(label, area);
    return area;
  });
  const row = document.createElement("div");
  row.className = "tool-reply-row";
  const submit = document.createElement("button");
  submit.type = "submit";
  submit.className = "btn primary";
  submit.textContent = calls.length === 1 ? "Send result" : "Send results";
  const hint = document.createElement("span");
  hint.className = "muted";
  hint.textContent = "or leave it and type your next message";
  row.append(submit, hint);
  form.append(row);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const results = boxes.map((a) => ({ callId: a.dataset.callId, text: a.value }));
    if (!results.some((r) => r.text.trim())) boxes[0].focus();
    else send(results);
  });
  box.replaceChildren(form);
}

/** A tool message's body: which call it answers, then the result as typed (plain text). */
export function renderToolResult(body, msg) {
  const key = `${msg.name}\u0000${msg.toolCallId}\u0000${msg.content}`;
  if (body.dataset.key === key) return;
  body.dataset.key = key;
  const head = document.createElement("div");
  head.className = "tool-result-head";
  const name = document.createElement("code");
  name.className = "tool-call-name";
  name.textContent = String(msg.name || "?");
  const id = document.createElement("span");
  id.className = "tool-call-id";
  id.textContent = String(msg.toolCallId || "");
  head.append("Result of ", name, " ", id);
  const text = document.createElement("div");
  text.className = "tool-result-text";
  text.textContent = msg.content;
  body.replaceChildren(head, text);
}
