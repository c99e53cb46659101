// The sampling parameters the UI sends on the WebSocket (docs/protocol.md, "Client →
// server"): one table with each parameter's protocol range, and the three things done
// with it: normalize a stored value, check a typed one (with the server's limits from
// its `hello`), and build the request's fields.
//
// `always` parameters are sent with every request. The others may be left empty, which
// means "the server's default": they are not sent at all.

export const MAX_SAFE_SEED = Number.MAX_SAFE_INTEGER; // the protocol takes < 2^63; JS numbers are exact to 2^53
export const STOP_LEN_FALLBACK = 128; // --max-stop-len's default, for a server whose hello lacks it

/** kind: "range" (a slider), "int" or "num" (a number box), "stop" (the stop strings). */
export const PARAMS = Object.freeze([
  { key: "temperature", label: "Temperature", kind: "range", min: 0, max: 2, step: 0.05, dflt: 0.7, always: true,
    hint: "0 always picks the likeliest token; higher is more varied" },
  { key: "top_p", label: "Top p", kind: "range", min: 0.05, max: 1, step: 0.05, dflt: 1, always: true,
    hint: "sample from the smallest set of tokens whose probability adds up to this" },
  { key: "max_tokens", label: "Max tokens", kind: "int", min: 1, max: 1_000_000, dflt: 512, always: true,
    hint: "the longest answer, in tokens" },
  { key: "top_k", label: "Top k", kind: "int", min: -1, max: 2 ** 20, placeholder: "off",
    hint: "only the k likeliest tokens; -1 or 0 is off" },
  { key: "min_p", label: "Min p", kind: "num", min: 0, max: 1, step: 0.01, placeholder: "0",
    hint: "drop tokens less likely than this times the likeliest" },
  { key: "presence_penalty", label: "Presence penalty", kind: "num", min: -2, max: 2, step: 0.1, placeholder: "0",
    hint: "above 0: new topics; below: stay on them" },
  { key: "frequency_penalty", label: "Frequency penalty", kind: "num", min: -2, max: 2, step: 0.1, placeholder: "0",
    hint: "above 0: fewer repeated words" },
  { key: "repetition_penalty", label: "Repetition penalty", kind: "num", min: 0, max: 2, step: 0.05, minExclusive: true,
    placeholder: "1", hint: "above 1: fewer repeats of the prompt and the answer" },
  { key: "seed", label: "Seed", kind: "int", min: 0, max: MAX_SAFE_SEED, placeholder: "random",
    hint: "the same seed and settings give the same answer" },
  { key: "stop", label: "Stop strings", kind: "stop", hint: "one per line; write \\n for a line break" },
]);

export const BY_KEY = Object.freeze(Object.fromEntries(PARAMS.map((p) => [p.key, p])));

/** The sampling part of DEFAULT_SETTINGS. */
export const SAMPLING_DEFAULTS = Object.freeze(
  Object.fromEntries(PARAMS.map((p) => [p.key, p.kind === "stop" ? [] : (p.dflt ?? null)])),
);

const isEmpty = (v) => v === null || v === undefined || (typeof v === "string" && v.trim() === "");

function clamp(p, v) {
  const n = typeof v === "string" ? Number(v.trim()) : Number(v);
  if (typeof v === "boolean" || !Number.isFinite(n)) return p.dflt ?? null;
  const lo = p.minExclusive ? p.min + 0.01 : p.min;
  const x = Math.min(p.max, Math.max(lo, n));
  return p.kind === "int" ? Math.round(x) : x;
}

/** Stored (or seeded) values into valid ones, never throwing: out of range is clamped
 * to the protocol's range, garbage is the default. The server's own, tighter limits are
 * checked by `check` when a value is typed. */
export function normalizeSampling(raw) {
  const out = {};
  for (const p of PARAMS) {
    const v = raw?.[p.key];
    if (p.kind === "stop") out.stop = Array.isArray(v) ? v.filter((s) => typeof s === "string" && s).slice(0, 64) : [];
    else out[p.key] = isEmpty(v) ? (p.dflt ?? null) : clamp(p, v);
  }
  return out;
}

/** The bounds a typed value must meet: the protocol's, tightened by the hello's limits. */
export function bounds(p, limits) {
  let { min, max } = p;
  if (p.key === "max_tokens" && Number.isInteger(limits?.max_tokens) && limits.max_tokens > 0) max = limits.max_tokens;
  return { min, max };
}

function fmt(n) {
  return Number.isInteger(n) && Math.abs(n) >= 1000 ? n.toLocaleString("en-US") : String(n);
}

/** A number from its text box: {value} (null when empty and the server's default applies)
 * or {error} (a sentence naming the field and its bounds). */
export function checkNumber(p, raw, limits) {
  const text = String(raw ?? "").trim();
  if (text === "") return p.always ? { error: `${p.label} is needed.` } : { value: null };
  const n = Number(text);
  const { min, max } = bounds(p, limits);
  const server = p.key === "max_tokens" && max !== p.max ? " (the server's limit)" : "";
  const range = p.minExclusive ? `above ${fmt(min)} and at most ${fmt(max)}` : `from ${fmt(min)} to ${fmt(max)}`;
  const whole = p.kind === "int" ? "a whole number" : "a number";
  const error = `${p.label} must be ${whole} ${range}${server}.`;
  if (!Number.isFinite(n) || (p.kind === "int" && !Number.isInteger(n))) return { error };
  if (n > max || n < min || (p.minExclusive && n <= min)) return { error };
  return { value: n };
}

/** Stop strings as the text box shows them: one per line, `\n`, `\t` and `\\` escaped. */
export function stopToText(list) {
  return list.map((s) => s.replace(/\\/g, "\\\\").replace(/\n/g, "\\n").replace(/\t/g, "\\t")).join("\n");
}

function unescapeStop(line) {
  let out = "";
  for (let i = 0; i < line.length; i++) {
    const c = line[i];
    if (c !== "\\" || i + 1 === line.length) {
      out += c;
      continue;
    }
    const next = line[++i];
    out += next === "n" ? "\n" : next === "t" ? "\t" : next === "\\" ? "\\" : `\\${next}`;
  }
  return out;
}

/** The stop strings typed in the box: {value: [...]} or {error}. Empty lines are skipped.
 * `limits.max_stop` and `limits.max_stop_len` are the server's (from its hello). */
export function checkStop(text, limits) {
  const list = String(text ?? "")
    .split("\n")
    .filter((line) => line !== "")
    .map(unescapeStop);
  const most = Number.isInteger(limits?.max_stop) && limits.max_stop >= 0 ? limits.max_stop : 8;
  if (list.length > most) {
    return { error: `At most ${most} stop string${most === 1 ? "" : "s"} (the server's limit); there are ${list.length}.` };
  }
  const len = Number.isInteger(limits?.max_stop_len) && limits.max_stop_len > 0 ? limits.max_stop_len : STOP_LEN_FALLBACK;
  const long = list.findIndex((s) => [...s].length > len);
  if (long >= 0) return { error: `Stop string ${long + 1} is longer than ${len} characters (the server's limit).` };
  return { value: list };
}

/** The request fields of the parameters that are not always sent (those left empty are
 * not sent: the server's default applies). */
export function optionalFields(s) {
  const out = {};
  for (const p of PARAMS) {
    if (p.always || p.key === "seed") continue; // the seed goes out with the always-sent ones
    const v = s[p.key];
    if (p.kind === "stop" ? Array.isArray(v) && v.length > 0 : v !== null && v !== undefined) out[p.key] = v;
  }
  return out;
}
