// The sampling parameters the UI sends on the WebSocket (docs/protocol.md, "Client →
// server"): one table of how each is shown, and the three things done with it:
// normalize a stored value, check a typed one, and build the request's fields.
//
// Their ranges are the server's: its `hello` carries `bounds` (each parameter's range,
// declared once on the server) and `limits` (the operator's, tighter); `setBounds` takes
// them. Until the hello has come, values are only checked to be numbers.
//
// `always` parameters are sent with every request. The others may be left empty, which
// means "the server's default": they are not sent at all.

export const MAX_SAFE_SEED = Number.MAX_SAFE_INTEGER; // the protocol takes < 2^63; JS numbers are exact to 2^53
export const STOP_LEN_FALLBACK = 128; // --max-stop-len's default, for a server whose hello lacks it

/** kind: "range" (a slider), "int" or "num" (a number box), "stop" (the stop strings). */
export const PARAMS = Object.freeze([
  { key: "temperature", label: "Temperature", kind: "range", step: 0.05, dflt: 0.7, always: true,
    hint: "0 always picks the likeliest token; higher is more varied" },
  { key: "top_p", label: "Top p", kind: "range", step: 0.05, dflt: 1, always: true,
    hint: "sample from the smallest set of tokens whose probability adds up to this" },
  { key: "max_tokens", label: "Max tokens", kind: "int", dflt: 512, always: true,
    hint: "the longest answer, in tokens" },
  { key: "top_k", label: "Top k", kind: "int", placeholder: "off",
    hint: "only the k likeliest tokens; -1 or 0 is off" },
  { key: "min_p", label: "Min p", kind: "num", step: 0.01, placeholder: "0",
    hint: "drop tokens less likely than this times the likeliest" },
  { key: "presence_penalty", label: "Presence penalty", kind: "num", step: 0.1, placeholder: "0",
    hint: "above 0: new topics; below: stay on them" },
  { key: "frequency_penalty", label: "Frequency penalty", kind: "num", step: 0.1, placeholder: "0",
    hint: "above 0: fewer repeated words" },
  { key: "repetition_penalty", label: "Repetition penalty", kind: "num", step: 0.05,
    placeholder: "1", hint: "above 1: fewer repeats of the prompt and the answer" },
  { key: "seed", label: "Seed", kind: "int", placeholder: "random",
    hint: "the same seed and settings give the same answer" },
  { key: "stop", label: "Stop strings", kind: "stop", hint: "one per line; write \\n for a line break" },
]);

export const BY_KEY = Object.freeze(Object.fromEntries(PARAMS.map((p) => [p.key, p])));

/** The sampling part of DEFAULT_SETTINGS. */
export const SAMPLING_DEFAULTS = Object.freeze(
  Object.fromEntries(PARAMS.map((p) => [p.key, p.kind === "stop" ? [] : (p.dflt ?? null)])),
);

let announced = {}; // key -> {min, max, integer, min_exclusive?, max_exclusive?}: the hello's `bounds`

/** The ranges from the server's hello (`hello.bounds`); a missing or odd table: none known. */
export function setBounds(table) {
  announced = table && typeof table === "object" ? table : {};
}

/** The range a value must be in: the server's (its hello's `bounds`), tightened by its
 * limits (`hello.limits`) and, for the seed, by what a JS number holds exactly. Null
 * before the hello. `server`: whether the operator's limit is the tighter one. */
export function bounds(p, limits) {
  const b = announced[p.key];
  if (!b || !Number.isFinite(b.min) || !Number.isFinite(b.max)) return null;
  let max = b.max_exclusive && p.kind === "int" ? b.max - 1 : b.max;
  if (p.key === "seed") max = Math.min(max, MAX_SAFE_SEED);
  const limit = p.key === "max_tokens" ? limits?.max_tokens : null;
  const server = Number.isInteger(limit) && limit > 0 && limit < max;
  if (server) max = limit;
  return { min: b.min, max, minExclusive: Boolean(b.min_exclusive), server };
}

const isEmpty = (v) => v === null || v === undefined || (typeof v === "string" && v.trim() === "");

function clamp(p, v) {
  const n = typeof v === "string" ? Number(v.trim()) : Number(v);
  if (typeof v === "boolean" || !Number.isFinite(n)) return p.dflt ?? null;
  const b = bounds(p);
  let x = n;
  if (b) {
    // the least value above an open lower end: one slider step, else a hundredth
    const lo = b.minExclusive ? b.min + (p.kind === "range" ? p.step : 0.01) : b.min;
    x = Math.min(b.max, Math.max(lo, n));
  }
  return p.kind === "int" ? Math.round(x) : x;
}

/** Stored (or seeded) values into valid ones, never throwing: out of range is clamped
 * to the server's range (once its hello has come), garbage is the default. The server's
 * own, tighter limits are checked by `check` when a value is typed. */
export function normalizeSampling(raw) {
  const out = {};
  for (const p of PARAMS) {
    const v = raw?.[p.key];
    if (p.kind === "stop") out.stop = Array.isArray(v) ? v.filter((s) => typeof s === "string" && s).slice(0, 64) : [];
    else out[p.key] = isEmpty(v) ? (p.dflt ?? null) : clamp(p, v);
  }
  return out;
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
  const b = bounds(p, limits);
  const whole = p.kind === "int" ? "a whole number" : "a number";
  let error = `${p.label} must be ${whole}.`;
  if (b) {
    const range = b.minExclusive ? `above ${fmt(b.min)} and at most ${fmt(b.max)}` : `from ${fmt(b.min)} to ${fmt(b.max)}`;
    error = `${p.label} must be ${whole} ${range}${b.server ? " (the server's limit)" : ""}.`;
  }
  if (!Number.isFinite(n) || (p.kind === "int" && !Number.isInteger(n))) return { error };
  if (b && (n > b.max || n < b.min || (b.minExclusive && n <= b.min))) return { error };
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
