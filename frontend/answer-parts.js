// An assistant message's body: the folded "Thinking" block (msg.reasoning), the answer
// (markdown, or formatted JSON for msg.json), and a card per tool call (msg.toolCalls).
//
//   <div class="msg-body markdown">
//     <details class="thinking"><summary>Thought for 2.1 s</summary><div class="thinking-text">…</div></details>
//     <div class="answer markdown">…</div>
//     <div class="tool-calls"><div class="tool-call">…</div></div>
//   </div>
//
// All of it is built with createElement/textContent, as the markdown renderer is; code blocks
// are highlighted through code-blocks.js's safe path before they are shown. The Thinking block
// and the cards are updated in place, so an open block stays open while text streams into it.

import { highlightBlocks } from "./code-blocks.js";
import { codeBlockElement, patchChildren, renderMarkdown } from "./markdown.js";

const PREVIEW_CHARS = 90; // the tail of the reasoning shown in the folded summary while it streams

/** Draw `msg` into `body`. `live`: the answer is still streaming. Returns true when some code
 * blocks are still to be highlighted (render again soon). */
export function renderAnswer(body, msg, live) {
  const thinking = part(body, "details", "thinking", 0, !!msg.reasoning);
  if (thinking) renderThinking(thinking, msg, live);
  const answer = part(body, "div", "answer markdown", 1, true);
  const frag = msg.json ? jsonFragment(msg.content, live) : renderMarkdown(msg.content);
  let pending = highlightBlocks(frag, { live });
  patchChildren(answer, frag);
  const calls = Array.isArray(msg.toolCalls) ? msg.toolCalls.filter((c) => c && typeof c === "object") : [];
  const tools = part(body, "div", "tool-calls", 2, calls.length > 0);
  if (tools) pending = renderToolCalls(tools, calls, live) || pending;
  return pending;
}

// The body's child of class `cls` (created, or removed when `wanted` is false), kept in the
// order of `rank`.
function part(body, tag, cls, rank, wanted) {
  const first = cls.split(" ")[0];
  let node = [...body.children].find((c) => c.classList.contains(first));
  if (!wanted) {
    node?.remove();
    return null;
  }
  if (!node) {
    node = document.createElement(tag);
    node.className = cls;
    node.dataset.rank = String(rank);
    const after = [...body.children].find((c) => Number(c.dataset.rank) > rank);
    body.insertBefore(node, after || null);
  }
  return node;
}

function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

function renderThinking(details, msg, live) {
  if (!details.firstChild) {
    const summary = document.createElement("summary");
    const title = document.createElement("span");
    title.className = "thinking-title";
    const preview = document.createElement("span");
    preview.className = "thinking-preview";
    preview.setAttribute("aria-hidden", "true"); // a moving tail of the text below: not announced
    summary.append(title, preview);
    const text = document.createElement("div");
    text.className = "thinking-text";
    details.append(summary, text);
  }
  const [summary, text] = details.children;
  const [title, preview] = summary.children;
  const thinkingNow = live && !msg.content && !(msg.toolCalls || []).length && msg.thinkingMs == null;
  details.classList.toggle("live", thinkingNow);
  setText(title, thinkingNow ? "Thinking…" : thoughtFor(msg.thinkingMs));
  const reasoning = String(msg.reasoning);
  const tail = reasoning.slice(-PREVIEW_CHARS).replace(/\s+/g, " ").trim();
  setText(preview, thinkingNow ? (reasoning.length > PREVIEW_CHARS ? `…${tail}` : tail) : "");
  setText(text, reasoning.trim());
}

function thoughtFor(ms) {
  if (!Number.isFinite(ms)) return "Thoughts";
  const s = ms / 1000;
  return `Thought for ${s < 10 ? s.toFixed(1) : Math.round(s)} s`;
}

// A JSON answer: formatted once it is complete and parses; as it came while it streams or when
// it does not parse (cut by max tokens).
function jsonFragment(content, live) {
  const frag = document.createDocumentFragment();
  if (!content) return frag;
  let text = content;
  if (!live) {
    try {
      text = JSON.stringify(JSON.parse(content), null, 2);
    } catch {
      text = content;
    }
  }
  frag.appendChild(codeBlockElement(text, "json"));
  return frag;
}

/** A call's arguments, indented when they are JSON. */
export function prettyArguments(args) {
  const s = String(args ?? "");
  try {
    return JSON.stringify(JSON.parse(s), null, 2);
  } catch {
    return s;
  }
}

function renderToolCalls(box, calls, live) {
  const frag = document.createDocumentFragment();
  calls.forEach((call) => {
    const card = document.createElement("div");
    card.className = "tool-call";
    const head = document.createElement("div");
    head.className = "tool-call-head";
    const label = document.createElement("span");
    label.className = "tool-call-label";
    label.textContent = "Tool call";
    const name = document.createElement("code");
    name.className = "tool-call-name";
    name.textContent = String(call.name || "?");
    head.append(label, name);
    if (call.id) {
      const id = document.createElement("span");
      id.className = "tool-call-id";
      id.textContent = String(call.id);
      head.appendChild(id);
    }
    card.append(head, codeBlockElement(prettyArguments(call.arguments), "json"));
    frag.appendChild(card);
  });
  const pending = highlightBlocks(frag, { live });
  patchChildren(box, frag);
  return pending;
}
