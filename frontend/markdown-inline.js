// Inline markdown (code spans, emphasis, links) as DOM nodes: model text only ever
// enters through text nodes, and the only attribute it can reach is a checked
// http(s) href. Used by markdown.js for the text inside each block.
//
// One pass over the text: where a construct needs its closer (a code span's backticks, a
// link's "]" and ")", the end of a bare URL), InlineScan answers from indexes built once, and
// a failed search for an emphasis closer is remembered; so the work is linear in the text.

import { isSpace } from "./markdown-lines.js";
import { InlineScan, safeUrl } from "./markdown-scan.js";

export const MAX_DEPTH = 8; // nesting cap for lists/quotes/emphasis: bounded work on hostile input

export function h(tag, cls) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  return el;
}

const ESCAPABLE = "\\`*_{}[]()#+-.!|~<>";

function link(text, href, depth) {
  const a = h("a");
  a.href = href;
  a.rel = "noopener noreferrer nofollow";
  a.target = "_blank";
  a.referrerPolicy = "no-referrer";
  appendInline(a, text, depth + 1, true);
  return a;
}

// Text goes in as text nodes (insertAdjacentText: one call where createTextNode and appendChild
// are two, which counts in an answer with tens of thousands of them); "\n" becomes <br>.
function appendText(parent, text) {
  let from = 0;
  for (let nl = text.indexOf("\n"); nl >= 0; nl = text.indexOf("\n", from)) {
    if (nl > from) parent.insertAdjacentText("beforeend", text.slice(from, nl));
    parent.appendChild(h("br"));
    from = nl + 1;
  }
  if (from < text.length) parent.insertAdjacentText("beforeend", from ? text.slice(from) : text);
}

// A code span's content loses one space at each end, if both are there and the span is one line.
function unpad(s) {
  const padded = s.length > 2 && s[0] === " " && s[s.length - 1] === " ";
  return padded && !/[\n\r\u2028\u2029]/.test(s) ? s.slice(1, -1) : s;
}

// JavaScript's `\w`.
function isWordChar(c) {
  return (c >= "a" && c <= "z") || (c >= "A" && c <= "Z") || (c >= "0" && c <= "9") || c === "_";
}

const EMPHASIS = [
  ["**", "strong"],
  ["__", "strong"],
  ["~~", "del"],
  ["*", "em"],
  ["_", "em"],
];

// Sticky patterns of one greedy character class: they match at one position and have nothing
// to backtrack into. PLAIN is a run of characters that start no inline syntax.
const BACKTICKS = /`+/y;
const PLAIN = /[^\\`[!<hH*_~]+/y;

export function appendInline(parent, src, depth, inLink = false) {
  PLAIN.lastIndex = 0;
  if (depth > MAX_DEPTH || (PLAIN.test(src) && PLAIN.lastIndex === src.length)) {
    appendText(parent, src); // too deep, or nothing to parse (most table cells, list items)
    return;
  }
  new Inline(parent, src, depth, inLink).run();
}

// One inline text being appended to `parent`: plain runs are collected in `text` and flushed
// as text nodes before each element.
class Inline {
  constructor(parent, src, depth, inLink) {
    this.parent = parent;
    this.src = src;
    this.depth = depth;
    this.inLink = inLink; // inside a link's label: no nested links
    this.scan = new InlineScan(src);
    // Where a search for a closing emphasis delimiter already failed: any later opener of the
    // same kind fails too, so each kind scans the text at most once (linear time).
    this.noClose = {};
    this.text = "";
  }

  run() {
    const src = this.src;
    let i = 0;
    while (i < src.length) {
      PLAIN.lastIndex = i;
      if (PLAIN.test(src)) {
        this.text += src.slice(i, PLAIN.lastIndex);
        i = PLAIN.lastIndex;
        continue;
      }
      const end = this.construct(i);
      if (end > i) {
        i = end;
      } else {
        this.text += src[i];
        i++;
      }
    }
    this.flush();
  }

  flush() {
    appendText(this.parent, this.text);
    this.text = "";
  }

  append(node) {
    this.flush();
    this.parent.appendChild(node);
  }

  // The syntax that starts at src[i], appended: returns where it ends, or -1 if none does.
  construct(i) {
    const src = this.src;
    const c = src[i];
    if (c === "\\" && i + 1 < src.length && ESCAPABLE.includes(src[i + 1])) {
      this.text += src[i + 1];
      return i + 2;
    }
    if (c === "`") return this.codeSpan(i);
    let end = -1;
    if (!this.inLink) {
      if (c === "[" || (c === "!" && src[i + 1] === "[")) end = this.link(i, c === "!");
      else if (c === "<") end = this.autolink(i);
      else if ((c === "h" || c === "H") && !isWordChar(src[i - 1]) && src[i - 1] !== "/") end = this.bareUrl(i);
    }
    return end > 0 ? end : this.emphasis(i);
  }

  codeSpan(i) {
    const src = this.src;
    BACKTICKS.lastIndex = i;
    const n = BACKTICKS.exec(src)[0].length;
    const end = this.scan.codeSpanEnd(i + n, n);
    if (end < 0) {
      this.text += src.slice(i, i + n); // no closer: the backticks are text
      return i + n;
    }
    const code = h("code");
    code.textContent = unpad(src.slice(i + n, end));
    this.append(code);
    return end + n;
  }

  link(i, isImage) {
    const m = this.scan.link(isImage ? i + 1 : i);
    if (!m) return -1;
    const [text, url, end] = m;
    const href = safeUrl(url);
    const label = isImage ? `image: ${text || url}` : text;
    if (href) this.append(link(label, href, this.depth));
    else {
      this.flush();
      appendInline(this.parent, label, this.depth + 1, this.inLink);
    }
    return end;
  }

  autolink(i) {
    const url = this.scan.autolink(i);
    const href = url && safeUrl(url);
    if (!href) return -1;
    this.append(link(url, href, this.depth));
    return i + url.length + 2;
  }

  bareUrl(i) {
    const m = this.scan.bareUrl(i);
    if (!m) return -1;
    this.append(link(m.url, m.href, this.depth));
    return i + m.url.length;
  }

  emphasis(i) {
    const src = this.src;
    const em = emphasisAt(src, i, i > 0 ? src[i - 1] : "", this.noClose);
    if (!em) return -1;
    const el = h(em.tag);
    appendInline(el, src.slice(i + em.delim.length, em.end), this.depth + 1, this.inLink);
    this.append(el);
    return em.end + em.delim.length;
  }
}

function emphasisAt(src, i, prev, noClose) {
  for (const [delim, tag] of EMPHASIS) {
    if (!src.startsWith(delim, i)) continue;
    const after = src[i + delim.length];
    if (!after || isSpace(after, 0)) continue; // must open against text
    if (delim[0] === "_" && isWordChar(prev)) continue; // snake_case stays text
    if (i >= (noClose[delim] ?? Infinity)) continue;
    const end = closingDelimiter(src, i, delim);
    if (end > 0) return { delim, tag, end };
    noClose[delim] = i;
  }
  return null;
}

function closingDelimiter(src, i, delim) {
  let end = src.indexOf(delim, i + delim.length + 1);
  while (end > 0) {
    if (delim.length === 1 && src[end + 1] === delim) {
      // A single * never closes on part of a ** run: skip the whole run.
      while (src[end] === delim) end++;
      end = src.indexOf(delim, end);
      continue;
    }
    // Close on the last delimiter of a run: ***x*** is <strong><em>x</em></strong>.
    while (src[end + delim.length] === delim[0]) end++;
    const before = src[end - 1];
    const next = src[end + delim.length];
    const closes = !isSpace(before, 0) && before !== "\\" && !(delim[0] === "_" && next && isWordChar(next));
    if (closes) return end;
    end = src.indexOf(delim, end + delim.length);
  }
  return -1;
}
