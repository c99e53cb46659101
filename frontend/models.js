// The served models (GET /v1/models) and the per-conversation model picker.
//
// Each conversation keeps the model it was given (`conv.model`; "" is the server's
// default, the model the socket's `hello` names). A new conversation starts with the
// model picked last (`settings.model`). A conversation stored before it had a `model`
// follows the last picked one. If a conversation's model is no longer served, the
// picker says so and the conversation falls back to the server's default.

export class AuthError extends Error {}

/** [{id, contextLength, parent, lora, sees}] from GET /v1/models (the default model first; a LoRA
 * adapter's card has `lora: true` and its base model as `parent`; `sees`: whether it reads
 * images, from the card's `input_modalities`, null where the card does not say). */
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
    .filter((m) => m && typeof m.id === "string" && m.id)
    .map((m) => ({
      id: m.id,
      contextLength: Number.isInteger(m.max_model_len) && m.max_model_len > 0 ? m.max_model_len : null,
      parent: typeof m.parent === "string" ? m.parent : null,
      lora: m.lora === true,
      sees: Array.isArray(m.input_modalities) ? m.input_modalities.includes("image") : null,
    }));
}

export function formatTokens(n) {
  return Number(n).toLocaleString("en-US");
}

/** "tiny-llama · 2,048-token context" (an alias names its model, an adapter its base). */
export function modelLabel(m) {
  const alias = m.parent ? ` (${m.lora ? "LoRA adapter" : "alias"} of ${m.parent})` : "";
  const ctx = m.contextLength ? ` · ${formatTokens(m.contextLength)}-token context` : "";
  return `${m.id}${alias}${ctx}`;
}

/** Fill a <select>: "Server default (…)" first (value ""), then every model. */
export function fillModelSelect(select, models, serverDefault, value) {
  const opts = [];
  const auto = document.createElement("option");
  auto.value = "";
  const dflt = models.find((m) => m.id === serverDefault);
  const ctx = dflt?.contextLength ? ` · ${formatTokens(dflt.contextLength)}-token context` : "";
  auto.textContent = serverDefault ? `Server default (${serverDefault})${ctx}` : "Server default";
  opts.push(auto);
  for (const m of models) {
    const o = document.createElement("option");
    o.value = m.id;
    o.textContent = modelLabel(m);
    opts.push(o);
  }
  // A model not (or not yet) in the list stays selectable while it is the choice.
  if (value && !models.some((m) => m.id === value)) {
    const o = document.createElement("option");
    o.value = value;
    o.textContent = value;
    opts.push(o);
  }
  select.replaceChildren(...opts);
  select.value = value || "";
}

export class ModelPicker {
  /** `select`: the composer's picker; `notice`: where "that model is gone" is said;
   * `pick(id)`: the person picked a model for the conversation on screen. */
  constructor(select, notice, pick) {
    this.select = select;
    this.notice = notice;
    this.models = null; // null until GET /v1/models answered
    this.serverDefault = "";
    this.value = "";
    select.addEventListener("change", () => {
      this.value = select.value;
      this.say("");
      pick(select.value);
    });
  }

  setModels(models, serverDefault) {
    this.models = models;
    this.serverDefault = serverDefault || models[0]?.id || "";
    fillModelSelect(this.select, models, this.serverDefault, this.value);
  }

  /** Show a conversation's model (`id`, "" for the server's default). */
  show(id) {
    this.value = id || "";
    fillModelSelect(this.select, this.models || [], this.serverDefault, this.value);
  }

  /** Whether the list is known and lacks `id` (a model that went away). */
  isGone(id) {
    return !!id && this.models !== null && !this.models.some((m) => m.id === id);
  }

  /** The context length of a model ("" or unknown: the server default's). */
  contextOf(id) {
    const m = (this.models || []).find((x) => x.id === (id || this.serverDefault));
    return m?.contextLength ?? null;
  }

  /** Whether a model reads images ("" or unknown: the server default's): true, false, or
   * null while the list has not said. */
  seesImages(id) {
    const m = (this.models || []).find((x) => x.id === (id || this.serverDefault));
    return m?.sees ?? null;
  }

  say(text) {
    this.notice.textContent = text;
    this.notice.hidden = !text;
  }
}
