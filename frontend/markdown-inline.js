// Inline markdown (code spans, emphasis, links) as DOM nodes: model text only ever
// enters through text nodes, and the only attribute it can reach is a checked
// http(s) href. Used by markdown.js for the text inside each block.

export const MAX_DEPTH = 8; // nesting cap for lists/quotes/emphasis: bounded work on hostile input

export function h(tag, cls) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  return el;
}

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

export function appendInline(parent, src, depth, inLink = false) {
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
