// The settings dialog: the model for new chats, every sampling parameter of the
// protocol (built from sampling.js's table), the API key. A valid change is saved at
// once; a value out of bounds (the server's, from its hello: `bounds`, tightened by
// `limits`) shows a message under its field and is not saved, so the last valid value stays.

import { fillModelSelect } from "./models.js";
import { BY_KEY, bounds, checkNumber, checkStop, PARAMS, SAMPLING_DEFAULTS, setBounds, stopToText } from "./sampling.js";
import { normalizeSettings } from "./store.js";

const idOf = (key) => key.replace(/_/g, "-");

function el(tag, attrs = {}, text = "") {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) e.setAttribute(k, String(v));
  if (text) e.textContent = text;
  return e;
}

/** One field of the sampling table: label, control, hint, and a slot for its error. Its
 * range comes with the server's hello (`SettingsPanel.setServer`). */
function buildField(p) {
  const id = idOf(p.key);
  const field = el("div", { class: `field field-${p.kind}` });
  const label = el("label", { for: `set-${id}` }, `${p.label} `);
  const hint = el("p", { class: "field-hint", id: `hint-${id}` }, p.hint);
  const error = el("p", { class: "field-error", id: `err-${id}`, "aria-live": "polite" });
  error.hidden = true;
  const described = `hint-${id} err-${id}`;
  let input;
  if (p.kind === "range") {
    label.appendChild(el("output", { id: `out-${id}`, for: `set-${id}` }));
    input = el("input", { id: `set-${id}`, type: "range", step: p.step, "aria-describedby": described });
  } else if (p.kind === "stop") {
    label.appendChild(el("span", { class: "muted", id: "stop-limit" }));
    input = el("textarea", { id: `set-${id}`, rows: 2, spellcheck: "false", placeholder: "none", "aria-describedby": described });
  } else {
    if (p.key === "max_tokens") label.appendChild(el("span", { class: "muted", id: "max-tokens-limit" }));
    input = el("input", {
      id: `set-${id}`,
      type: "number",
      step: p.kind === "int" ? 1 : "any",
      inputmode: p.kind === "int" ? "numeric" : "decimal",
      placeholder: p.placeholder,
      "aria-describedby": described,
    });
  }
  field.append(label, input, hint, error);
  return { field, input, error, output: field.querySelector("output") };
}

export class SettingsPanel {
  /** `onChange(settings)` runs after every saved change. */
  constructor(dialog, store, onChange) {
    this.dialog = dialog;
    this.store = store;
    this.onChange = onChange;
    this.settings = store.loadSettings();
    this.limits = null; // the hello's
    const $ = (id) => dialog.querySelector(`#${id}`);
    this.fields = {}; // key -> {input, error, output}
    const box = $("sampling-fields");
    for (const p of PARAMS) {
      const f = buildField(p);
      box.appendChild(f.field);
      this.fields[p.key] = f;
    }
    this.inputs = { model: $("set-model"), api_key: $("set-api-key"), attach_kb: $("set-attach-kb") };
    for (const [key, f] of Object.entries(this.fields)) this.inputs[key] = f.input;
    this._fill();
    for (const [key, input] of Object.entries(this.inputs)) {
      input.addEventListener("input", () => this._read(key, false));
      input.addEventListener("change", () => this._read(key, true));
    }
    $("settings-reset").addEventListener("click", () => {
      this.settings = normalizeSettings({ ...this.settings, ...SAMPLING_DEFAULTS }); // model, theme, key kept
      this._save();
      this._fill();
    });
    // A click on the backdrop (outside the panel) closes the dialog.
    dialog.addEventListener("click", (ev) => {
      if (ev.target === dialog) dialog.close();
    });
  }

  open(focusId = null) {
    this._fill();
    if (!this.dialog.open) this.dialog.showModal();
    if (focusId) this.dialog.querySelector(`#${focusId}`)?.focus();
  }

  /** The server's hello: the range of every parameter (`bounds`) and its own limits
   * (`limits`: max tokens, the stop strings). Stored values out of range are clamped. */
  setServer(hello) {
    setBounds(hello?.bounds);
    this.limits = hello?.limits && typeof hello.limits === "object" ? hello.limits : null;
    for (const p of PARAMS) {
      const b = p.kind === "stop" ? null : bounds(p, this.limits);
      const input = this.fields[p.key].input;
      for (const [attr, value] of [["min", b?.min], ["max", b?.max]]) {
        // a number box's open lower end is checked by checkNumber, not by `min`
        const shown = attr === "min" && b?.minExclusive ? (p.kind === "range" ? b.min + p.step : undefined) : value;
        if (shown === undefined) input.removeAttribute(attr);
        else input.setAttribute(attr, String(shown));
      }
    }
    const b = bounds(BY_KEY.max_tokens, this.limits);
    const maxHint = this.dialog.querySelector("#max-tokens-limit");
    maxHint.textContent = b?.server ? `(server max ${b.max.toLocaleString("en-US")})` : "";
    const clamped = normalizeSettings(this.settings);
    if (JSON.stringify(clamped) !== JSON.stringify(this.settings)) {
      this.settings = clamped; // e.g. a stored value the server's range leaves out
      this._save();
      this._fill();
    }
    const most = this.limits?.max_stop;
    this.dialog.querySelector("#stop-limit").textContent = Number.isInteger(most) ? `(at most ${most})` : "";
    this._validateShown();
  }

  get() {
    return this.settings;
  }

  set(partial) {
    this.settings = normalizeSettings({ ...this.settings, ...partial });
    this._save();
  }

  /** Fill "Model for new chats"; a stored choice the server no longer has falls back
   * to the server's default. `models`: [{id, contextLength, parent}]. */
  setModels(models, serverDefault) {
    if (this.settings.model && !models.some((m) => m.id === this.settings.model)) {
      this.settings.model = "";
      this._save();
    }
    fillModelSelect(this.inputs.model, models, serverDefault, this.settings.model);
  }

  _fill() {
    const s = this.settings;
    this.inputs.model.value = s.model;
    this.inputs.api_key.value = s.api_key;
    this.inputs.attach_kb.value = String(s.attach_kb);
    for (const p of PARAMS) {
      const f = this.fields[p.key];
      const v = s[p.key];
      f.input.value = p.kind === "stop" ? stopToText(v) : v === null ? "" : String(v);
      if (f.output) f.output.textContent = v.toFixed(2);
    }
    this._validateShown();
  }

  /** Show the problem of every value on screen (e.g. a stored max tokens over the limit
   * the server announced later). */
  _validateShown() {
    for (const p of PARAMS) {
      if (p.kind !== "range") this._showError(p.key, this._check(p, this.fields[p.key].input.value).error);
    }
  }

  _check(p, raw) {
    return p.kind === "stop" ? checkStop(raw, this.limits) : checkNumber(p, raw, this.limits);
  }

  _showError(key, error) {
    const f = this.fields[key];
    f.input.setCustomValidity(error || "");
    if (error) f.input.setAttribute("aria-invalid", "true");
    else f.input.removeAttribute("aria-invalid");
    f.error.textContent = error ? `${error} Not saved.` : "";
    f.error.hidden = !error;
  }

  _read(key, final) {
    const raw = this.inputs[key].value;
    const p = BY_KEY[key];
    if (key === "api_key" || key === "attach_kb") {
      if (!final) return; // once, when the field is left (the key reconnects; a size is clamped)
    } else if (p && p.kind !== "range") {
      // While typing, an empty box is left alone until it is left (`change`).
      if (!final && raw.trim() === "" && p.always) return;
      const { value, error } = this._check(p, raw);
      this._showError(key, error);
      if (error) return;
      this.settings = normalizeSettings({ ...this.settings, [key]: value });
      this._save();
      return;
    }
    this.settings = normalizeSettings({ ...this.settings, [key]: raw });
    this._save();
    if (key === "attach_kb") this.inputs.attach_kb.value = String(this.settings.attach_kb); // as clamped
    const out = this.fields[key]?.output;
    if (out) out.textContent = this.settings[key].toFixed(2);
  }

  _save() {
    this.store.saveSettings(this.settings);
    this.onChange(this.settings);
  }
}
