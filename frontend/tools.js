// The tools of a conversation (conv.tools): the functions the model may call, and whether
// it may, must, or must not call them.
//
//   {functions: [{name, description, parameters: "<JSON Schema text>"}],
//    choice: "auto" | "required" | "none" | "function", function: "<name, for choice function>"}
//
// On the wire (docs/protocol.md, "Tools and reasoning"): `tools` as OpenAI's function tools and
// `tool_choice` ("auto", "required", "none" or {type: "function", function: {name}}), sent with
// every request of the conversation. A function's parameters are checked before anything is
// sent, with the same check as the answer format's JSON Schema (output-format.js): a bad one is
// refused with a readable reason, and no request leaves. A function left wholly blank is a
// draft: it is kept, and not sent.

import { parseSchema } from "./output-format.js";

export const CHOICES = Object.freeze(["auto", "required", "none", "function"]);
export const MAX_FUNCTIONS = 128; // the server's limit on tools in one request
const NAME = /^[A-Za-z0-9_.-]{1,64}$/; // the server's (and OpenAI's) rule for a function name
const MAX_DESCRIPTION = 4096;

const str = (v) => (typeof v === "string" ? v : "");

export function blankFunction() {
  return { name: "", description: "", parameters: "" };
}

/** Stored or typed tools in their full shape, never throwing. */
export function normalizeTools(raw) {
  const t = raw && typeof raw === "object" ? raw : {};
  const functions = Array.isArray(t.functions) ? t.functions.filter((f) => f && typeof f === "object") : [];
  return {
    functions: functions.slice(0, MAX_FUNCTIONS).map((f) => ({ name: str(f.name), description: str(f.description), parameters: str(f.parameters) })),
    choice: CHOICES.includes(t.choice) ? t.choice : "auto",
    function: str(t.function),
  };
}

const isBlank = (f) => !f.name.trim() && !f.description.trim() && !f.parameters.trim();

/** The functions that are sent (drafts left out), each with its index in the list. */
function offered(tools) {
  return tools.functions.map((f, index) => ({ ...f, index })).filter((f) => !isBlank(f));
}

/** What is wrong, as [{index, field, message}]: `index` is the function's place in the list
 * (null for the choice), `field` "name", "description", "parameters" or "choice". */
export function toolProblems(raw) {
  const tools = normalizeTools(raw);
  const out = [];
  const seen = new Set();
  for (const f of offered(tools)) {
    const who = f.name ? `Function “${f.name}”` : `Function ${f.index + 1}`;
    const add = (field, message) => out.push({ index: f.index, field, message: `${who}: ${message}` });
    if (!NAME.test(f.name)) add("name", "the name must be 1 to 64 letters, digits, “_”, “.” or “-”.");
    else if (seen.has(f.name)) add("name", "another function has this name.");
    seen.add(f.name);
    if (f.description.length > MAX_DESCRIPTION) add("description", `the description is longer than ${MAX_DESCRIPTION} characters.`);
    if (f.parameters.trim()) {
      const { error } = parseSchema(f.parameters);
      if (error) add("parameters", error.replace(/^The JSON Schema/, "its parameters schema"));
    }
  }
  if (tools.choice === "function" && !offered(tools).some((f) => f.name === tools.function)) {
    const named = tools.function ? `“${tools.function}”, which is not one of the functions` : "no function";
    out.push({ index: null, field: "choice", message: `The tool choice names ${named}.` });
  }
  return out;
}

/** Why these tools cannot be sent, or null. */
export function toolsProblem(raw) {
  return toolProblems(raw)[0]?.message ?? null;
}

/** How many functions are offered (drafts left out). */
export function toolCount(raw) {
  return offered(normalizeTools(raw)).length;
}

/** The request fields ({} when no function is offered). Call toolsProblem first. */
export function toolsFields(raw) {
  const tools = normalizeTools(raw);
  const fns = offered(tools);
  if (!fns.length) return {};
  const defs = fns.map((f) => {
    const fn = { name: f.name };
    if (f.description.trim()) fn.description = f.description;
    if (f.parameters.trim()) fn.parameters = parseSchema(f.parameters).schema;
    return { type: "function", function: fn };
  });
  const choice = tools.choice === "function" ? { type: "function", function: { name: tools.function } } : tools.choice;
  return { tools: defs, tool_choice: choice };
}

/** Why a stored or imported `tools` field has the wrong shape, or null. Only the shape: a
 * function still being written (a bad name, a schema with a typo) is kept as it is. */
export function toolsShapeProblem(raw) {
  if (raw === null || typeof raw !== "object" || Array.isArray(raw)) return `"tools" must be an object`;
  if ("functions" in raw && !Array.isArray(raw.functions)) return `"tools.functions" must be a list`;
  const fns = raw.functions || [];
  if (fns.length > MAX_FUNCTIONS) return `"tools.functions" has more than ${MAX_FUNCTIONS} functions`;
  for (const [k, f] of fns.entries()) {
    if (f === null || typeof f !== "object" || Array.isArray(f)) return `tool function ${k + 1} is not an object`;
    for (const key of ["name", "description", "parameters"]) {
      if (key in f && typeof f[key] !== "string") return `"${key}" of tool function ${k + 1} must be a text`;
    }
  }
  if ("choice" in raw && !CHOICES.includes(raw.choice)) return `"tools.choice" must be one of ${CHOICES.join(", ")}`;
  if ("function" in raw && typeof raw.function !== "string") return `"tools.function" must be a text`;
  return null;
}
