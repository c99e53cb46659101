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
//
// Hostile text costs time linear in its length: each line is classified by plain scans
// (markdown-lines.js) and inline text by one pass that asks lazily built indexes
// (markdown-scan.js), never by a regex that can backtrack over model text. Nesting is capped
// at MAX_DEPTH levels.

import { appendInline, h, MAX_DEPTH } from "./markdown-inline.js";
import {
  fenceOpen,
  heading,
  isBlank,
  isFenceClose,
  isRule,
  isTableSeparator,
  listItem,
  opensBlock,
  quoteBody,
} from "./markdown-lines.js";

export { safeUrl } from "./markdown-scan.js";

/** Lines longer than this are not parsed: each is shown as one paragraph of plain text. Every
 * part of the parser is linear in its input; the cap also bounds what one line can cost. */
export const MAX_LINE_LENGTH = 10000;

/** Render markdown `src` into a DocumentFragment. `maxLineLength`: the cap above (Infinity:
 * parse every line). */
export function renderMarkdown(src, { maxLineLength = MAX_LINE_LENGTH } = {}) {
  const frag = document.createDocumentFragment();
  const lines = String(src ?? "").replace(/\r\n?/g, "\n").split("\n");
  new Blocks(maxLineLength).append(frag, lines, 0);
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

class Blocks {
  constructor(maxLineLength) {
    this.maxLineLength = maxLineLength;
  }

  isLong(line) {
    return line.length > this.maxLineLength;
  }

  append(parent, lines, depth) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (isBlank(line)) {
        i++;
      } else if (this.isLong(line)) {
        plainParagraph(parent, line);
        i++;
      } else if ((m = fenceOpen(line))) {
        i = codeBlock(parent, lines, i, m);
      } else if ((m = heading(line))) {
        const el = h(`h${m.level}`);
        appendInline(el, m.text, 0);
        parent.appendChild(el);
        i++;
      } else if (isRule(line)) {
        parent.appendChild(h("hr"));
        i++;
      } else if (quoteBody(line) !== null && depth < MAX_DEPTH) {
        i = this.blockquote(parent, lines, i, depth);
      } else if (listItem(line) && depth < MAX_DEPTH) {
        i = this.list(parent, lines, i, depth);
      } else if (this.isTableStart(lines, i)) {
        i = this.table(parent, lines, i);
      } else {
        i = this.paragraph(parent, lines, i);
      }
    }
  }

  startsBlock(lines, i) {
    const line = lines[i];
    return isBlank(line) || this.isLong(line) || opensBlock(line) || this.isTableStart(lines, i);
  }

  blockquote(parent, lines, i, depth) {
    const inner = [];
    for (; i < lines.length && !this.isLong(lines[i]); i++) {
      const body = quoteBody(lines[i]);
      if (body !== null) inner.push(body);
      else if (!isBlank(lines[i]) && inner.length && !isBlank(inner[inner.length - 1])) inner.push(lines[i]);
      else break;
    }
    const el = h("blockquote");
    this.append(el, inner, depth + 1);
    parent.appendChild(el);
    return i;
  }

  list(parent, lines, i, depth) {
    const first = listItem(lines[i]);
    const { indent, ordered } = first;
    const el = h(ordered ? "ol" : "ul");
    if (ordered) {
      const start = parseInt(first.marker, 10);
      if (start !== 1) el.start = start;
    }
    while (i < lines.length && !this.isLong(lines[i])) {
      const m = listItem(lines[i]);
      if (!m || m.indent !== indent || m.ordered !== ordered) break;
      const body = [m.text];
      i = this.itemLines(lines, i + 1, body, indent, indent + m.marker.length + 1);
      el.appendChild(this.item(body, depth));
      // A blank line between items keeps the list going.
      if (i < lines.length && isBlank(lines[i])) {
        const next = listItem(lines[i + 1] || "");
        if (next && next.indent === indent) i++;
      }
    }
    parent.appendChild(el);
    return i;
  }

  item(body, depth) {
    const li = h("li");
    // A tight item renders its text without a wrapping <p>. The common case, lines of one
    // paragraph, goes straight in, without building the <p> and moving its children out.
    if (body.length === 1) appendInline(li, body[0], 0);
    else if (body.every((_, k) => !this.startsBlock(body, k))) appendInline(li, paragraphText(body), 0);
    else this.append(li, body, depth + 1);
    if (li.childNodes.length === 1 && li.firstChild.nodeName === "P") unwrap(li.firstChild);
    return li;
  }

  // An item's own lines after its first: lines indented past the marker (or lazy paragraph
  // continuations), up to a blank line followed by a dedent. Returns the index after them.
  itemLines(lines, i, body, indent, contentIndent) {
    for (; i < lines.length && !this.isLong(lines[i]); i++) {
      const line = lines[i];
      const lead = line.length - line.trimStart().length;
      if (isBlank(line)) {
        const next = lines[i + 1];
        const nextLead = next ? next.length - next.trimStart().length : 0;
        if (!next || isBlank(next) || nextLead < contentIndent || this.isLong(next)) break;
        body.push("");
      } else if (lead >= contentIndent || (lead > indent && listItem(line))) {
        body.push(line.slice(Math.min(lead, contentIndent)));
      } else if (!this.startsBlock(lines, i) && !isBlank(body[body.length - 1])) {
        body.push(line.trim()); // lazy continuation
      } else {
        break;
      }
    }
    return i;
  }

  isTableStart(lines, i) {
    const sep = lines[i + 1];
    return lines[i].includes("|") && sep !== undefined && !this.isLong(sep) && isTableSeparator(sep);
  }

  table(parent, lines, i) {
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
    while (i < lines.length && !isBlank(lines[i]) && lines[i].includes("|") && !this.isLong(lines[i])) {
      tbody.appendChild(row(splitRow(lines[i]), "td", aligns));
      i++;
    }
    t.appendChild(tbody);
    wrap.appendChild(t);
    parent.appendChild(wrap);
    return i;
  }

  paragraph(parent, lines, i) {
    const body = [lines[i]];
    i++;
    while (i < lines.length && !this.startsBlock(lines, i)) body.push(lines[i++]);
    const p = h("p");
    appendInline(p, paragraphText(body), 0);
    parent.appendChild(p);
    return i;
  }
}

function paragraphText(lines) {
  return lines.map((l) => l.trim()).join("\n");
}

// A line past the length cap: shown as text, not parsed.
function plainParagraph(parent, line) {
  const p = h("p");
  p.textContent = line.trim();
  parent.appendChild(p);
}

// Move `el`'s children into its place (one by one: a spread of many nodes overflows the stack).
function unwrap(el) {
  while (el.firstChild) el.parentNode.insertBefore(el.firstChild, el);
  el.remove();
}

// A code block's frame (bar with label and copy button, pre, code), built once and deep-cloned
// for each block: one call instead of a dozen, which counts when an answer has thousands.
let frame = null;

function codeFrame() {
  if (!frame) {
    frame = h("div", "codeblock");
    const bar = h("div", "codebar");
    const copy = h("button", "copy-code");
    copy.type = "button";
    copy.textContent = "Copy";
    bar.append(h("span", "codelang"), copy);
    const pre = h("pre");
    pre.appendChild(h("code"));
    frame.append(bar, pre);
  }
  return frame.cloneNode(true);
}

function codeBlock(parent, lines, i, m) {
  const { fence } = m;
  const lang = m.info.replace(/[^\w+#.-]/g, "").slice(0, 32);
  const body = [];
  for (i++; i < lines.length; i++) {
    if (isFenceClose(lines[i], fence)) {
      i++;
      break;
    }
    body.push(lines[i]);
  }
  parent.appendChild(codeBlockElement(body.join("\n"), lang));
  return i;
}

/** A code block (bar with its language and a copy button, then the code as text). `lang`:
 * a short word of `\w+#.-`, or "". Also used for answers that are not markdown (JSON). */
export function codeBlockElement(text, lang) {
  const wrap = codeFrame();
  const label = wrap.firstChild.firstChild;
  label.textContent = lang || "code";
  wrap.firstChild.lastChild.setAttribute("aria-label", `Copy ${lang || "code"} block`);
  const code = wrap.lastChild.firstChild;
  if (lang) code.dataset.lang = lang;
  code.textContent = text;
  return wrap;
}

function splitRow(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
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
