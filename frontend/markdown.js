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

const MAX_DEPTH = 8; // nesting cap for lists/quotes/emphasis: bounded work on hostile input

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

function h(tag, cls) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  return el;
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

// ---- inline --------------------------------------------------------------------

const ESCAPABLE = "\\`*_{}[]()#+-.!|~<>";

/** Only absolute http(s) URLs become links; anything else stays text. */
export function safeUrl(raw) {
  try {
    const u = new URL(raw.trim());
    return u.protocol === "http:" || u.protocol === "https:" ? u.href : null;
  } catch {
    return null;
  }
}

function link(text, href, depth) {
  const a = h("a");
  a.href = href;
  a.rel = "noopener noreferrer nofollow";
  a.target = "_blank";
  a.referrerPolicy = "no-referrer";
  appendInline(a, text, depth + 1, true);
  return a;
}

function appendText(parent, text) {
  if (!text) return;
  const parts = text.split("\n");
  parts.forEach((part, k) => {
    if (k > 0) parent.appendChild(h("br"));
    if (part) parent.appendChild(document.createTextNode(part));
  });
}

// Finds `[text](url)` starting at src[i] === "["; returns [text, url, end] or null.
// The scans are bounded so that a paragraph full of "[" stays linear-ish.
const MAX_LINK_TEXT = 1000;
const MAX_LINK_URL = 2048;

function matchLink(src, i) {
  let depth = 0;
  let j = i;
  const stop = Math.min(src.length, i + MAX_LINK_TEXT);
  for (; j < stop; j++) {
    const c = src[j];
    if (c === "\\") j++;
    else if (c === "[") depth++;
    else if (c === "]" && --depth === 0) break;
  }
  if (j >= stop || src[j + 1] !== "(") return null;
  const close = src.indexOf(")", j + 2);
  if (close < 0 || close - j > MAX_LINK_URL) return null;
  const target = src.slice(j + 2, close).trim().split(/\s+/)[0] || "";
  return [src.slice(i + 1, j), target.replace(/^<|>$/g, ""), close + 1];
}

// A bare URL ends before trailing punctuation, and before a ")" it did not open.
function trimUrl(url) {
  let u = url.replace(/[.,;:!?\]*_'"]+$/, "");
  while (u.endsWith(")") && (u.match(/\)/g) || []).length > (u.match(/\(/g) || []).length) {
    u = u.slice(0, -1).replace(/[.,;:!?\]*_'"]+$/, "");
  }
  return u;
}

const EMPHASIS = [
  ["**", "strong"],
  ["__", "strong"],
  ["~~", "del"],
  ["*", "em"],
  ["_", "em"],
];

// Sticky regexes match at one position without slicing the string.
const BACKTICKS = /`+/y;
const AUTOLINK = /<(https?:\/\/[^\s<>]+)>/iy;
const BARE_URL = /https?:\/\/[^\s<>"'`]+/iy;

function stickyAt(re, src, i) {
  re.lastIndex = i;
  return re.exec(src);
}

function appendInline(parent, src, depth, inLink = false) {
  if (depth > MAX_DEPTH) {
    appendText(parent, src);
    return;
  }
  // Where a search for a closing delimiter already failed: any later opener of the
  // same kind fails too, so each kind scans the text at most once (linear time).
  const noClose = new Map();
  let text = "";
  const flush = () => {
    appendText(parent, text);
    text = "";
  };
  let i = 0;
  while (i < src.length) {
    const c = src[i];
    const prev = i > 0 ? src[i - 1] : "";
    if (c === "\\" && i + 1 < src.length && ESCAPABLE.includes(src[i + 1])) {
      text += src[i + 1];
      i += 2;
      continue;
    }
    if (c === "`") {
      const run = stickyAt(BACKTICKS, src, i)[0];
      const key = `\`${run.length}`;
      const end = i >= (noClose.get(key) ?? Infinity) ? -1 : src.indexOf(run, i + run.length);
      if (end > 0) {
        flush();
        const code = h("code");
        code.textContent = src.slice(i + run.length, end).replace(/^ (.+) $/, "$1");
        parent.appendChild(code);
        i = end + run.length;
        continue;
      }
      noClose.set(key, Math.min(i, noClose.get(key) ?? Infinity));
      text += run;
      i += run.length;
      continue;
    }
    if ((c === "[" || (c === "!" && src[i + 1] === "[")) && !inLink) {
      const isImage = c === "!";
      const m = matchLink(src, isImage ? i + 1 : i);
      if (m) {
        const href = safeUrl(m[1]);
        flush();
        const label = isImage ? `image: ${m[0] || m[1]}` : m[0];
        if (href) parent.appendChild(link(label, href, depth));
        else appendInline(parent, label, depth + 1, inLink);
        i = m[2];
        continue;
      }
    }
    if (c === "<" && !inLink) {
      const m = stickyAt(AUTOLINK, src, i);
      const href = m && safeUrl(m[1]);
      if (href) {
        flush();
        parent.appendChild(link(m[1], href, depth));
        i += m[0].length;
        continue;
      }
    }
    if ((c === "h" || c === "H") && !inLink && !/[\w/]/.test(prev)) {
      const m = stickyAt(BARE_URL, src, i);
      if (m) {
        const url = trimUrl(m[0]);
        const href = safeUrl(url);
        if (href) {
          flush();
          parent.appendChild(link(url, href, depth));
          i += url.length;
          continue;
        }
      }
    }
    const em = emphasisAt(src, i, prev, noClose);
    if (em) {
      flush();
      const el = h(em.tag);
      appendInline(el, src.slice(i + em.delim.length, em.end), depth + 1, inLink);
      parent.appendChild(el);
      i = em.end + em.delim.length;
      continue;
    }
    text += c;
    i++;
  }
  flush();
}

function emphasisAt(src, i, prev, noClose) {
  for (const [delim, tag] of EMPHASIS) {
    if (!src.startsWith(delim, i)) continue;
    const after = src[i + delim.length];
    if (!after || /\s/.test(after)) continue; // must open against text
    if (delim[0] === "_" && /\w/.test(prev)) continue; // snake_case stays text
    if (i >= (noClose.get(delim) ?? Infinity)) continue;
    const end = closingDelimiter(src, i, delim);
    if (end > 0) return { delim, tag, end };
    noClose.set(delim, i);
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
    const closes = !/\s/.test(before) && before !== "\\" && !(delim[0] === "_" && next && /\w/.test(next));
    if (closes) return end;
    end = src.indexOf(delim, end + delim.length);
  }
  return -1;
}
