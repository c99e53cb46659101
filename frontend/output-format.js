// The answer format of a conversation (conv.output), and its control: the "Format" button by
// the message box and its dialog.
//
//   {mode: "text" | "json" | "schema" | "regex", schema: "<JSON text>", regex: "<pattern>"}
//
// On the wire (docs/protocol.md, "Structured output"): json -> response_format json_object,
// schema -> response_format json_schema (strict), regex -> vLLM's structured_outputs.regex.
// A schema is checked before anything is sent: it must parse as JSON and describe an object.
// A bad one is refused with a readable reason, and no request leaves.

import { icon } from "./icons.js";

export const MODES = Object.freeze({
  text: { short: "Text", label: "Text", hint: "free text (markdown)" },
  json: { short: "JSON", label: "JSON object", hint: "any JSON object" },
  schema: { short: "Schema", label: "JSON Schema", hint: "JSON valid against your schema" },
  regex: { short: "Regex", label: "Regular expression", hint: "text that matches your pattern" },
});
const MAX_SPEC_BYTES = 128 * 1024; // the server's limit on a structured-output spec

export function normalizeOutput(raw) {
  const o = raw && typeof raw === "object" ? raw : {};
  return {
    mode: Object.hasOwn(MODES, o.mode) ? o.mode : "text",
    schema: typeof o.schema === "string" ? o.schema : "",
    regex: typeof o.regex === "string" ? o.regex : "",
  };
}

/** True when the answer is asked as JSON (it is then shown formatted). */
export function isJsonOutput(raw) {
  const { mode } = normalizeOutput(raw);
  return mode === "json" || mode === "schema";
}

function kind(v) {
  if (v === null) return "null";
  if (Array.isArray(v)) return "an array";
  return `a ${typeof v}`;
}

/** {schema} or {error}: the schema text, checked as the server will need it. */
export function parseSchema(text) {
  if (!text.trim()) return { error: "Type a JSON Schema, or pick another format." };
  if (new TextEncoder().encode(text).length > MAX_SPEC_BYTES) return { error: "The JSON Schema is larger than 128 KiB." };
  let schema;
  try {
    schema = JSON.parse(text);
  } catch (err) {
    return { error: `The JSON Schema is not valid JSON: ${err.message}.` };
  }
  if (schema === null || typeof schema !== "object" || Array.isArray(schema)) {
    return { error: `The JSON Schema must be a JSON object ({ … }), not ${kind(schema)}.` };
  }
  if (schema.type !== "object") {
    return { error: 'The JSON Schema must describe a JSON object: its top level needs "type": "object".' };
  }
  return { schema };
}

/** Why this format cannot be sent, or null. */
export function outputProblem(raw) {
  const o = normalizeOutput(raw);
  if (o.mode === "schema") return parseSchema(o.schema).error || null;
  if (o.mode === "regex") {
    if (!o.regex) return "Type a regular expression, or pick another format.";
    if (new TextEncoder().encode(o.regex).length > MAX_SPEC_BYTES) return "The regular expression is larger than 128 KiB.";
  }
  return null;
}

/** The request fields for this format ({} for text). Call outputProblem first. */
export function outputFields(raw) {
  const o = normalizeOutput(raw);
  switch (o.mode) {
    case "json":
      return { response_format: { type: "json_object" } };
    case "schema":
      return { response_format: { type: "json_schema", json_schema: { name: "ui", schema: parseSchema(o.schema).schema, strict: true } } };
    case "regex":
      return { structured_outputs: { regex: o.regex } };
    default:
      return {};
  }
}

// ---- the control ------------------------------------------------------------------

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else if (k in node && !k.startsWith("aria") && !k.startsWith("data")) node[k] = v;
    else node.setAttribute(k, v);
  }
  node.append(...children);
  return node;
}

/** The "Format" button by the message box and its dialog. `chat`: the Chat (its "refused"
 * events); `activeId()`: the conversation on screen; `refusal`: the "Not sent" line (refusal.js). */
export class OutputFormatControl {
  constructor(chat, activeId, refusal) {
    this.chat = chat;
    this.activeId = activeId;
    this.refusal = refusal;
    this._build();
    chat.addEventListener("refused", (ev) => {
      if (ev.detail.id !== this.activeId() || ev.detail.part !== "format") return;
      refusal.show("format", ev.detail.error, "Edit format", () => this.open());
    });
  }

  _build() {
    const prompt = document.getElementById("prompt");
    this.button = el("button", {
      type: "button",
      id: "format-button",
      class: "btn format-btn",
      "aria-haspopup": "dialog",
      "aria-controls": "format-dialog",
    });
    prompt.before(this.button);
    this.button.addEventListener("click", () => this.open());

    const close = el("button", { class: "icon-btn", value: "close", "aria-label": "Close the format" });
    close.appendChild(icon("close"));
    const radios = Object.entries(MODES).map(([mode, m]) =>
      el(
        "label",
        { class: "format-mode" },
        el("input", { type: "radio", name: "format-mode", value: mode }),
        el("span", {}, m.label, el("span", { class: "muted" }, ` · ${m.hint}`)),
      ),
    );
    this.schema = el("textarea", {
      id: "format-schema",
      rows: 8,
      spellcheck: false,
      placeholder: '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}',
      "aria-describedby": "format-check",
    });
    this.regex = el("input", {
      id: "format-regex",
      type: "text",
      spellcheck: false,
      autocomplete: "off",
      placeholder: "(yes|no), because [a-z ]{10,80}\\.",
      "aria-describedby": "format-check",
    });
    this.check = el("p", { id: "format-check", class: "format-check", "aria-live": "polite" });
    this.schemaField = el("div", { class: "field" }, el("label", { htmlFor: "format-schema" }, "JSON Schema", el("span", { class: "muted" }, "an object schema")), this.schema);
    this.regexField = el(
      "div",
      { class: "field" },
      el("label", { htmlFor: "format-regex" }, "Regular expression", el("span", { class: "muted" }, "the whole answer matches")),
      this.regex,
    );
    this.form = el(
      "form",
      { method: "dialog", class: "settings-form" },
      el("div", { class: "settings-head" }, el("h2", { id: "format-title" }, "Answer format"), close),
      el("fieldset", { class: "format-modes" }, el("legend", {}, "The answer is"), ...radios),
      this.schemaField,
      this.regexField,
      this.check,
      el("p", { class: "muted format-note" }, "Kept with this conversation. JSON answers are shown formatted."),
      el("div", { class: "settings-actions end" }, el("button", { class: "btn primary", value: "close" }, "Done")),
    );
    this.dialog = el("dialog", { id: "format-dialog", class: "settings format-dialog", "aria-labelledby": "format-title" }, this.form);
    document.body.appendChild(this.dialog);

    this.form.addEventListener("change", (ev) => {
      if (ev.target.name === "format-mode") this._set({ mode: ev.target.value });
    });
    this.schema.addEventListener("input", () => this._set({ schema: this.schema.value }));
    this.regex.addEventListener("input", () => this._set({ regex: this.regex.value }));
    // Esc closes the dialog only (never stops an answer).
    this.dialog.addEventListener("keydown", (ev) => {
      if (ev.key === "Escape") ev.stopPropagation();
    });
    this.dialog.addEventListener("close", () => document.getElementById("prompt")?.focus());
  }

  _conv() {
    return this.chat.get(this.activeId());
  }

  _set(patch) {
    const conv = this._conv();
    if (!conv) return;
    conv.output = { ...normalizeOutput(conv.output), ...patch };
    this.chat.store.saveConversation(conv, 300);
    this.show(conv);
  }

  /** The conversation on screen changed (or its format did): redraw the button and dialog. */
  show(conv = this._conv()) {
    const o = normalizeOutput(conv?.output);
    const problem = outputProblem(o);
    this.button.textContent = MODES[o.mode].short;
    const { short, label } = MODES[o.mode];
    // The visible word first in the name (WCAG 2.5.3), then what it stands for.
    const name = short === label ? short : `${short} (${label})`;
    this.button.setAttribute("aria-label", `Answer format: ${name}${problem ? ", needs fixing" : ""}`);
    this.button.title = `Answer format: ${MODES[o.mode].label}`;
    this.button.classList.toggle("on", o.mode !== "text");
    this.button.classList.toggle("invalid", !!problem);
    for (const r of this.form.elements["format-mode"]) r.checked = r.value === o.mode;
    if (document.activeElement !== this.schema) this.schema.value = o.schema;
    if (document.activeElement !== this.regex) this.regex.value = o.regex;
    this.schemaField.hidden = o.mode !== "schema";
    this.regexField.hidden = o.mode !== "regex";
    this.check.textContent = problem || "";
    this.check.hidden = !problem;
    this.schema.setAttribute("aria-invalid", String(o.mode === "schema" && !!problem));
    if (!problem) this.refusal.clear("format");
  }

  open() {
    this.show();
    if (!this.dialog.open) this.dialog.showModal();
    const o = normalizeOutput(this._conv()?.output);
    (o.mode === "schema" ? this.schema : o.mode === "regex" ? this.regex : this.form.querySelector("input:checked"))?.focus();
  }
}
