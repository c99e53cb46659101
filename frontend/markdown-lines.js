// What one line of markdown opens: the block syntax of a single line, read by plain scans.
//
// Why scans and not regexes: model text is hostile input. A pattern such as
// /^ {0,3}(#{1,6})(?:\s+(.*?))?\s*#*\s*$/ has runs of `\s` that can trade characters with
// each other, so a failed match backtracks through every split: "# a" + " ".repeat(5000) + "b"
// took about 100 s. Each function here walks the line forwards or backwards a bounded number
// of times, so classifying a line costs time linear in its length. Every function names the
// grammar it accepts; "space" is JavaScript's `\s` (what String.prototype.trim removes). Unlike
// the `.` of those patterns, nothing here stops at U+2028 or U+2029 inside a line.

/** JavaScript's `\s`: WhiteSpace and LineTerminator code units. */
export function isSpace(s, i) {
  const k = s.charCodeAt(i);
  return (
    k === 32 ||
    (k >= 9 && k <= 13) ||
    k === 0xa0 ||
    k === 0x1680 ||
    (k >= 0x2000 && k <= 0x200a) ||
    k === 0x2028 ||
    k === 0x2029 ||
    k === 0x202f ||
    k === 0x205f ||
    k === 0x3000 ||
    k === 0xfeff
  );
}

function skipSpace(s, i) {
  while (i < s.length && isSpace(s, i)) i++;
  return i;
}

/** Where the run of `ch` that starts at s[i] ends. */
function runEnd(s, i, ch) {
  while (s[i] === ch) i++;
  return i;
}

/** How many U+0020 spaces `s` starts with. */
function indentOf(s) {
  return runEnd(s, 0, " ");
}

/** Whether `line` is empty or only spaces. */
export function isBlank(line) {
  return skipSpace(line, 0) === line.length;
}

/** Whether `line` opens a code fence, heading, rule, blockquote or list item. Its first
 * character rules most of them out first: most lines of a paragraph open nothing. */
export function opensBlock(line) {
  const c = line[indentOf(line)];
  switch (c) {
    case "`":
    case "~":
      return fenceOpen(line) !== null;
    case "#":
      return heading(line) !== null;
    case "-":
    case "*":
      return isRule(line) || listItem(line) !== null;
    case "_":
      return isRule(line);
    case "+":
      return listItem(line) !== null;
    case ">":
      return quoteBody(line) !== null;
    default:
      return c >= "0" && c <= "9" && listItem(line) !== null;
  }
}

/** A code fence: up to 3 spaces, 3+ backticks or 3+ tildes, then an info string with no backtick.
 * Returns {fence, info} (info: the first word after the fence) or null. */
export function fenceOpen(line) {
  const s = indentOf(line);
  const ch = line[s];
  if (s > 3 || (ch !== "`" && ch !== "~")) return null;
  const e = runEnd(line, s, ch);
  if (e - s < 3 || line.indexOf("`", e) >= 0) return null;
  const a = skipSpace(line, e);
  let b = a;
  while (b < line.length && line[b] !== "`" && !isSpace(line, b)) b++;
  return { fence: line.slice(s, e), info: line.slice(a, b) };
}

/** Whether `line` closes a code block opened by `fence`: after trimming, only the fence's
 * character, at least as many times. */
export function isFenceClose(line, fence) {
  const close = line.trim();
  return close.length >= fence.length && runEnd(close, 0, fence[0]) === close.length;
}

/** An ATX heading: up to 3 spaces, 1-6 "#", then nothing or a space and the text; a closing run
 * of "#" and spaces at the end is dropped. Seven or more "#" followed by spaces only is an empty
 * h6 (as before). Returns {level, text} or null. */
export function heading(line) {
  const s = indentOf(line);
  if (s > 3 || line[s] !== "#") return null;
  const e = runEnd(line, s, "#");
  if (e - s > 6) return skipSpace(line, e) === line.length ? { level: 6, text: "" } : null;
  if (e < line.length && !isSpace(line, e)) return null; // "#5" is not a heading
  const a = skipSpace(line, e);
  let t = line.length; // the text ends before trailing spaces, a closing "#" run and spaces
  while (t > a && isSpace(line, t - 1)) t--;
  while (t > a && line[t - 1] === "#") t--;
  while (t > a && isSpace(line, t - 1)) t--;
  return { level: e - s, text: line.slice(a, t) };
}

/** A thematic break: up to 3 spaces, then 3+ of one of "-", "*", "_", with only spaces between. */
export function isRule(line) {
  const s = indentOf(line);
  const ch = line[s];
  if (s > 3 || (ch !== "-" && ch !== "*" && ch !== "_")) return false;
  let n = 0;
  for (let i = s; i < line.length; i++) {
    if (line[i] === ch) n++;
    else if (!isSpace(line, i)) return false;
  }
  return n >= 3;
}

/** A blockquote line: up to 3 spaces, ">", an optional space. Returns the rest, or null. */
export function quoteBody(line) {
  const s = indentOf(line);
  if (s > 3 || line[s] !== ">") return null;
  return line.slice(line[s + 1] === " " ? s + 2 : s + 1);
}

/** A list item: any indent of spaces, a marker ("-", "*", "+", or 1-9 digits and "." or ")"),
 * then the end of the line or spaces and the text. Returns {indent, marker, ordered, text} or null. */
export function listItem(line) {
  const s = indentOf(line);
  let e = s + 1;
  const ordered = !(line[s] === "-" || line[s] === "*" || line[s] === "+");
  if (ordered) {
    e = s;
    while (e - s < 10 && line[e] >= "0" && line[e] <= "9") e++;
    if (e === s || e - s > 9 || (line[e] !== "." && line[e] !== ")")) return null;
    e++;
  }
  if (e < line.length && line[e] !== " ") return null;
  return { indent: s, marker: line.slice(s, e), ordered, text: line.slice(runEnd(line, e, " ")) };
}

/** A GFM table's delimiter row: optional outer pipes around cells of spaces, an optional ":",
 * one or more "-", an optional ":" and spaces, separated by "|". */
export function isTableSeparator(line) {
  const t = line.trim();
  let i = t[0] === "|" ? 1 : 0;
  for (;;) {
    i = skipSpace(t, i);
    if (t[i] === ":") i++;
    const dashes = i;
    i = runEnd(t, i, "-");
    if (i === dashes) return false;
    if (t[i] === ":") i++;
    i = skipSpace(t, i);
    if (i === t.length) return true;
    if (t[i] !== "|") return false;
    i++;
    if (i === t.length) return true; // the closing pipe
  }
}
