// A small markdown renderer that builds DOM nodes directly.
//
// Why no HTML string at any point: model text only ever reaches the page through
// `document.createTextNode` and a fixed set of `createElement` tags, so no tag,
// attribute or handler in the model's output can be interpreted. Raw HTML in the
// markdown shows up as literal text. Links are kept only for http(s) URLs; images are
// never loaded (an image becomes a link). The page's CSP is a second wall behind this.
//
// Supported: paragraphs (soft line breaks kept), ATX headings, fenced code blocks
// (unclosed fences while streaming), indented lists (ordered/unordered, nested),
// blockquotes, horizontal rules, GFM tables, inline code, **strong**, *em*, ~~del~~,
// [links](https://...), <https://autolinks> and bare http(s) URLs.

import { appendInline, h, MAX_DEPTH } from "./markdown-inline.js";

export { safeUrl } from "./markdown-inline.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?\s*#*\s*$/;
const HR = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])(?: +(.*)|$)/;
const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(?:\|\s*:?-+:?\s*)*\|?\s*$/;

/** Render markdown `src` into a DocumentFragment. */
export function renderMarkdown(src) {
  const frag = document.createDocumentFragment();
  const lines = String(src ?? "").replace(/\r\n?/g, "\n").split("\n");
  appendBlocks(frag, lines, 0);
  return frag;
}

/** Replace `el`'s children with `frag`'s, keeping unchanged top-level nodes (no flicker
 * and no lost text selection while an answer streams in). */
export function patchChildren(el, frag) {
  const next = Array.from(frag.childNodes);
  for (let i = 0; i < next.length; i++) {
    const cur = el.childNodes[i];
    if (!cur) el.appendChild(next[i]);
    else if (!cur.isEqualNode(next[i])) el.replaceChild(next[i], cur);
  }
  while (el.childNodes.length > next.length) el.removeChild(el.lastChild);
}

// ---- blocks --------------------------------------------------------------------

function appendBlocks(parent, lines, depth) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i++;
      continue;
    }
    let m;
    if ((m = FENCE.exec(line))) {
      i = codeBlock(parent, lines, i, m);
    } else if ((m = HEADING.exec(line))) {
      const el = h(`h${m[1].length}`);
      appendInline(el, m[2] || "", 0);
      parent.appendChild(el);
      i++;
    } else if (HR.test(line)) {
      parent.appendChild(h("hr"));
      i++;
    } else if (QUOTE.test(line) && depth < MAX_DEPTH) {
      i = blockquote(parent, lines, i, depth);
    } else if (LIST_ITEM.test(line) && depth < MAX_DEPTH) {
      i = list(parent, lines, i, depth);
    } else if (isTableStart(lines, i)) {
      i = table(parent, lines, i);
    } else {
      i = paragraph(parent, lines, i);
    }
  }
}

function startsBlock(lines, i) {
  const line = lines[i];
  return (
    !line.trim() ||
    FENCE.test(line) ||
    HEADING.test(line) ||
    HR.test(line) ||
    QUOTE.test(line) ||
    LIST_ITEM.test(line) ||
    isTableStart(lines, i)
  );
}

function codeBlock(parent, lines, i, m) {
  const fence = m[1];
  const lang = (m[2] || "").replace(/[^\w+#.-]/g, "").slice(0, 32);
  const body = [];
  i++;
  while (i < lines.length) {
    const close = lines[i].trim();
    if (close[0] === fence[0] && close.length >= fence.length && /^(`+|~+)$/.test(close)) {
      i++;
      break;
    }
    body.push(lines[i]);
    i++;
  }
  const wrap = h("div", "codeblock");
  const bar = h("div", "codebar");
  const label = h("span", "codelang");
  label.textContent = lang || "code";
  const copy = h("button", "copy-code");
  copy.type = "button";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", `Copy ${lang || "code"} block`);
  bar.append(label, copy);
  const pre = h("pre");
  const code = h("code");
  if (lang) code.dataset.lang = lang;
  code.textContent = body.join("\n");
  pre.appendChild(code);
  wrap.append(bar, pre);
  parent.appendChild(wrap);
  return i;
}

function blockquote(parent, lines, i, depth) {
  const inner = [];
  while (i < lines.length) {
    const m = QUOTE.exec(lines[i]);
    if (m) inner.push(m[1]);
    else if (lines[i].trim() && inner.length && inner[inner.length - 1].trim()) inner.push(lines[i]);
    else break;
    i++;
  }
  const el = h("blockquote");
  appendBlocks(el, inner, depth + 1);
  parent.appendChild(el);
  return i;
}

function list(parent, lines, i, depth) {
  const first = LIST_ITEM.exec(lines[i]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const el = h(ordered ? "ol" : "ul");
  if (ordered) {
    const start = parseInt(first[2], 10);
    if (start !== 1) el.start = start;
  }
  while (i < lines.length) {
    const m = LIST_ITEM.exec(lines[i]);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    // The item's own lines: its first line, then lines indented past the marker
    // (or lazy paragraph continuations), up to a blank line followed by a dedent.
    const contentIndent = indent + m[2].length + 1;
    const body = [m[3] || ""];
    i++;
    while (i < lines.length) {
      const line = lines[i];
      const lead = line.length - line.trimStart().length;
      if (!line.trim()) {
        const nextLine = lines[i + 1];
        const nextLead = nextLine ? nextLine.length - nextLine.trimStart().length : 0;
        if (nextLine && nextLine.trim() && nextLead >= contentIndent) {
          body.push("");
          i++;
          continue;
        }
        break;
      }
      if (lead >= contentIndent || (lead > indent && LIST_ITEM.test(line))) {
        body.push(line.slice(Math.min(lead, contentIndent)));
      } else if (!startsBlock(lines, i) && body[body.length - 1].trim()) {
        body.push(line.trim()); // lazy continuation
      } else {
        break;
      }
      i++;
    }
    const li = h("li");
    if (body.length === 1) appendInline(li, body[0], 0);
    else appendBlocks(li, body, depth + 1);
    // A tight item renders its text without a wrapping <p>.
    if (li.childNodes.length === 1 && li.firstChild.nodeName === "P") {
      li.replaceChildren(...li.firstChild.childNodes);
    }
    el.appendChild(li);
    // A blank line between items keeps the list going.
    if (i < lines.length && !lines[i].trim()) {
      const nextM = LIST_ITEM.exec(lines[i + 1] || "");
      if (nextM && nextM[1].length === indent) i++;
    }
  }
  parent.appendChild(el);
  return i;
}

function splitRow(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function isTableStart(lines, i) {
  return (
    lines[i].includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("-")
  );
}

function table(parent, lines, i) {
  const head = splitRow(lines[i]);
  const aligns = splitRow(lines[i + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "",
  );
  const wrap = h("div", "table-wrap");
  const t = h("table");
  const thead = h("thead");
  thead.appendChild(row(head, "th", aligns));
  t.appendChild(thead);
  const tbody = h("tbody");
  i += 2;
  while (i < lines.length && lines[i].trim() && lines[i].includes("|")) {
    tbody.appendChild(row(splitRow(lines[i]), "td", aligns));
    i++;
  }
  t.appendChild(tbody);
  wrap.appendChild(t);
  parent.appendChild(wrap);
  return i;
}

function row(cells, tag, aligns) {
  const tr = h("tr");
  cells.forEach((c, k) => {
    const cell = h(tag);
    // Alignment via a class: the CSP forbids inline style attributes.
    if (aligns[k]) cell.className = `align-${aligns[k]}`;
    appendInline(cell, c, 0);
    tr.appendChild(cell);
  });
  return tr;
}

function paragraph(parent, lines, i) {
  const body = [lines[i]];
  i++;
  while (i < lines.length && !startsBlock(lines, i)) body.push(lines[i++]);
  const p = h("p");
  appendInline(p, body.map((l) => l.trim()).join("\n"), 0);
  parent.appendChild(p);
  return i;
}
