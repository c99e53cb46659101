// Lookups over one inline text, for markdown-inline.js: where a code span closes, which "]"
// closes a "[", where a bare URL ends, and whether a URL may become a link.
//
// Why a class of indexes: the inline parser asks these questions at many positions of the
// same text. Answered by a fresh scan each time (`indexOf` to the end, a regex over the rest of
// a URL), a text full of "`", "[" or "http://[" costs quadratic time. Each index here is built
// once, lazily, in one linear pass, and each answer then costs amortized constant time, so
// parsing stays linear in the text's length. Nothing here touches the DOM.

import { isSpace } from "./markdown-lines.js";

const MAX_LINK_TEXT = 1000; // a link's [text] is at most this long
const MAX_LINK_URL = 2048; // and its (url) part

/** Only absolute http(s) URLs become links; anything else stays text. */
export function safeUrl(raw) {
  const u = parseUrl(raw.trim());
  return u && (u.protocol === "http:" || u.protocol === "https:") ? u.href : null;
}

// URL.parse answers null where `new URL` throws: a thrown error costs far more than the parse,
// and a text can hold one failed URL every eight characters.
function parseUrl(s) {
  if (URL.parse) return URL.parse(s);
  try {
    return new URL(s);
  } catch {
    return null;
  }
}

// A bare URL is "http://" or "https://" and a run of these; it ends before trailing
// punctuation (TRAILING) and before a ")" it did not open.
const SCHEME = /https?:\/\//iy; // sticky: matches at one position, bounded
const NOT_IN_URL = new Set([..."<>\"'`"]);
const TRAILING = new Set([...".,;:!?]*_'\""]);
// Where a URL's authority (user, host, port) ends; "\" counts as "/" in http(s) URLs.
const AUTHORITY_END = new Set([..."/?#\\"]);

function isUrlChar(s, i) {
  return !NOT_IN_URL.has(s[i]) && !isSpace(s, i);
}

export class InlineScan {
  constructor(src) {
    this.src = src;
    this._ticks = null; // backtick runs: {starts, lens, maxAfter, next}
    this._close = null; // Int32Array: for each "[", the "]" that closes it (-1 none, 0 not known)
    this._parens = null; // where the ")"s are, in order
    this._url = null; // the run of URL characters last looked at (see bareUrl)
  }

  /** Where the code span whose opening run of `n` backticks ends at `from` closes: the start
   * of the first later run of at least `n` backticks (as `src.indexOf("`".repeat(n), from)`),
   * or -1. Calls come with growing `from`, as the parser moves forwards. */
  codeSpanEnd(from, n) {
    const t = this._ticks || (this._ticks = backtickRuns(this.src));
    while (t.next < t.starts.length && t.starts[t.next] < from) t.next++;
    if (t.next === t.starts.length || t.maxAfter[t.next] < n) return -1;
    // The runs skipped here lie inside the span, which the parser then steps over.
    while (t.lens[t.next] < n) t.next++;
    return t.starts[t.next];
  }

  /** `[text](url)` starting at src[i] === "[": [text, url, end] or null. */
  link(i) {
    const src = this.src;
    const close = this._close || (this._close = closingBrackets(src));
    const j = close[i] === 0 ? scanBracket(src, i) : close[i];
    if (j < 0 || j - i >= MAX_LINK_TEXT || src[j + 1] !== "(") return null;
    const end = firstAfter(this._parens || (this._parens = positionsOf(src, ")")), j + 2);
    if (end < 0 || end - j > MAX_LINK_URL) return null;
    const target = src.slice(j + 2, end).trim().split(/\s+/)[0] || "";
    return [src.slice(i + 1, j), target.replace(/^<|>$/g, ""), end + 1];
  }

  /** `<http://...>` starting at src[i] === "<": the URL inside, or null. */
  autolink(i) {
    const src = this.src;
    SCHEME.lastIndex = i + 1;
    if (!SCHEME.test(src)) return null;
    const from = SCHEME.lastIndex;
    let e = from; // stops at the next "<": the scans from different "<" never overlap
    while (e < src.length && src[e] !== "<" && src[e] !== ">" && !isSpace(src, e)) e++;
    return e > from && src[e] === ">" ? src.slice(i + 1, e) : null;
  }

  /** A bare http(s) URL starting at src[i]: {url, href} when it is a safe link, else null. */
  bareUrl(i) {
    const src = this.src;
    SCHEME.lastIndex = i;
    const scheme = SCHEME.test(src) ? SCHEME.lastIndex - i : 0;
    if (!scheme || i + scheme >= src.length || !isUrlChar(src, i + scheme)) return null;
    const end = this._urlEnd(i);
    // Whether an http(s) URL parses is decided by its authority (user, host, port, after any
    // number of slashes): check that alone first, so that a run of broken URLs such as
    // "http://[http://[..." costs linear time, not quadratic. The "/" appended keeps the check
    // exact (the URL parser strips C0 controls at the end of its input, not inside a URL).
    let a = i + scheme - 2;
    while (a < end && (src[a] === "/" || src[a] === "\\")) a++;
    while (a < end && !AUTHORITY_END.has(src[a])) a++;
    if (a < end && !safeUrl(`${src.slice(i, a)}/`)) return null;
    const url = src.slice(i, end);
    const href = safeUrl(url);
    return href ? { url, href } : null;
  }

  // The end of the bare URL at i: its run of URL characters, less trailing punctuation and
  // the ")"s it did not open (one at a time, each with the punctuation before it).
  _urlEnd(i) {
    let u = this._url;
    if (!u || i >= u.end) u = this._url = urlRun(this.src, i);
    // ")" minus "(" in src[i, u.tail): the index stores it from the run's first start.
    const excess = u.balance[i - u.start];
    const drop = Math.min(u.closes.length, Math.max(0, excess + u.closes.length));
    return drop < u.closes.length ? u.closes[drop] + 1 : u.tail;
  }
}

// One pass over a run of URL characters starting at i (a bare URL's start).
function urlRun(src, i) {
  let end = i;
  while (end < src.length && isUrlChar(src, end)) end++;
  // The tail that trimming may cut: trailing punctuation and ")", never the "://" before it.
  let tail = end;
  while (TRAILING.has(src[tail - 1]) || src[tail - 1] === ")") tail--;
  const closes = []; // the ")"s in the tail, last first
  for (let k = end - 1; k >= tail; k--) if (src[k] === ")") closes.push(k);
  // balance[k - i]: ")" minus "(" in src[k, tail), for every later start k in the run.
  const balance = new Int32Array(tail - i + 1);
  for (let k = tail - 1; k >= i; k--) {
    balance[k - i] = balance[k - i + 1] + (src[k] === ")" ? 1 : src[k] === "(" ? -1 : 0);
  }
  return { start: i, end, tail, closes, balance };
}

// Maximal runs of backticks, and the longest run at or after each one.
function backtickRuns(src) {
  const starts = [];
  const lens = [];
  for (let i = src.indexOf("`"); i >= 0; i = src.indexOf("`", i)) {
    const s = i;
    while (src[i] === "`") i++;
    starts.push(s);
    lens.push(i - s);
  }
  const maxAfter = new Int32Array(lens.length + 1);
  for (let r = lens.length - 1; r >= 0; r--) maxAfter[r] = Math.max(lens[r], maxAfter[r + 1]);
  return { starts, lens, maxAfter, next: 0 };
}

// One left-to-right pass with a stack pairs every "[" with the "]" that closes it, skipping
// the character after a "\". A "[" that pass skipped as escaped stays 0, "not known" (no "]"
// closing a "[" is at 0).
function closingBrackets(src) {
  const close = new Int32Array(src.length);
  const open = [];
  for (let p = 0; p < src.length; p++) {
    const c = src.charCodeAt(p);
    if (c === 92 /* \ */) p++;
    else if (c === 91 /* [ */) {
      close[p] = -1;
      open.push(p);
    } else if (c === 93 /* ] */ && open.length) close[open.pop()] = p;
  }
  return close;
}

// The same answer for one "[" by a scan bounded by MAX_LINK_TEXT: for a "[" the pass above saw
// as escaped, which the inline parser, stepping over escapes the same way, does not ask about.
function scanBracket(src, i) {
  let depth = 0;
  const stop = Math.min(src.length, i + MAX_LINK_TEXT);
  for (let j = i; j < stop; j++) {
    const c = src[j];
    if (c === "\\") j++;
    else if (c === "[") depth++;
    else if (c === "]" && --depth === 0) return j;
  }
  return -1;
}

function positionsOf(src, ch) {
  const at = [];
  for (let p = src.indexOf(ch); p >= 0; p = src.indexOf(ch, p + 1)) at.push(p);
  return at;
}

// The first of the ascending `sorted` at or after `from`, or -1 (binary search).
function firstAfter(sorted, from) {
  let lo = 0;
  let hi = sorted.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (sorted[mid] < from) lo = mid + 1;
    else hi = mid;
  }
  return lo < sorted.length ? sorted[lo] : -1;
}
