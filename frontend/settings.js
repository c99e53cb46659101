// The settings dialog: model (from GET /v1/models), temperature, top_p, max tokens,
// seed. Every change is normalized and saved at once.

import { normalizeSettings } from "./store.js";

export class AuthError extends Error {}

export async function fetchModels(apiKey = "") {
  const headers = { Accept: "application/json" };
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  const res = await fetch("/v1/models", { headers });
  if (res.status === 401) throw new AuthError("this server needs an API key (Settings → API key)");
  if (!res.ok) {
    let detail = "";
    try {
      detail = (await res.json())?.error?.message || "";
    } catch {
      /* not the OpenAI error shape */
    }
    const busy = res.status === 429 || res.status === 503 ? "the server is busy; " : "";
    throw new Error(`${busy}GET /v1/models answered HTTP ${res.status}${detail ? `: ${detail}` : ""}`);
  }
  const body = await res.json();
  return (Array.isArray(body?.data) ? body.data : [])
    .map((m) => (m && typeof m.id === "string" ? m.id : null))
    .filter(Boolean);
}

export class SettingsPanel {
  /** `onChange(settings)` runs after every saved change. */
  constructor(dialog, store, onChange) {
    this.dialog = dialog;
    this.store = store;
    this.onChange = onChange;
    this.settings = store.loadSettings();
    this.models = [];
    const $ = (id) => dialog.querySelector(`#${id}`);
    this.inputs = {
      model: $("set-model"),
      temperature: $("set-temperature"),
      top_p: $("set-top-p"),
      max_tokens: $("set-max-tokens"),
      seed: $("set-seed"),
      api_key: $("set-api-key"),
    };
    this.outputs = { temperature: $("out-temperature"), top_p: $("out-top-p") };
    this._fill();
    for (const [key, input] of Object.entries(this.inputs)) {
      input.addEventListener("input", () => this._read(key, false));
      input.addEventListener("change", () => this._read(key, true));
    }
    dialog.querySelector("#settings-reset").addEventListener("click", () => {
      const { theme, model, api_key } = this.settings; // not sampling: kept
      this.settings = normalizeSettings({ theme, model, api_key });
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

  /** Show the server's limits from its hello (a hint; the server still validates). */
  setLimits(limits) {
    const max = Number(limits?.max_tokens);
    const hint = this.dialog.querySelector("#max-tokens-limit");
    if (Number.isInteger(max) && max > 0) {
      this.inputs.max_tokens.max = String(max);
      hint.textContent = `(server max ${max})`;
    }
  }

  get() {
    return this.settings;
  }

  set(partial) {
    this.settings = normalizeSettings({ ...this.settings, ...partial });
    this._save();
  }

  /** Fill the model list; keep the stored choice when the server still has it. */
  setModels(ids, serverDefault) {
    this.models = ids;
    const sel = this.inputs.model;
    const opts = [];
    const auto = document.createElement("option");
    auto.value = "";
    auto.textContent = serverDefault ? `Server default (${serverDefault})` : "Server default";
    opts.push(auto);
    for (const id of ids) {
      const o = document.createElement("option");
      o.value = id;
      o.textContent = id;
      opts.push(o);
    }
    sel.replaceChildren(...opts);
    if (this.settings.model && !ids.includes(this.settings.model)) {
      this.settings.model = ""; // that model is gone; fall back to the server's
      this._save();
    }
    sel.value = this.settings.model;
  }

  _fill() {
    const s = this.settings;
    this.inputs.model.value = s.model;
    this.inputs.temperature.value = String(s.temperature);
    this.inputs.top_p.value = String(s.top_p);
    this.inputs.max_tokens.value = String(s.max_tokens);
    this.inputs.seed.value = s.seed === null ? "" : String(s.seed);
    this.inputs.api_key.value = s.api_key;
    this.outputs.temperature.textContent = s.temperature.toFixed(2);
    this.outputs.top_p.textContent = s.top_p.toFixed(2);
  }

  _read(key, final) {
    const raw = this.inputs[key].value;
    // While typing, an empty or half-typed number is left alone until `change`.
    if (!final && (key === "max_tokens" || key === "seed") && raw.trim() === "") return;
    if (!final && key === "api_key") return; // reconnect once, when the field is left
    this.settings = normalizeSettings({ ...this.settings, [key]: raw });
    this._save();
    if (key in this.outputs) this.outputs[key].textContent = this.settings[key].toFixed(2);
    if (final) this._fill(); // show the clamped value
  }

  _save() {
    this.store.saveSettings(this.settings);
    this.onChange(this.settings);
  }
}
