// The context meter next to the composer: how much of the model's context the
// conversation used, from the `usage` of its last answer (the WebSocket's `done`:
// prompt tokens + answer tokens), against the model's `max_model_len` from GET
// /v1/models. The next question adds its own tokens on top of that.

import { formatTokens } from "./models.js";

/** The last answer that carries usage: {used, prompt, completion, model} or null. */
export function contextUse(conv) {
  const msgs = conv?.messages || [];
  for (let k = msgs.length - 1; k >= 0; k--) {
    const u = msgs[k].usage;
    if (msgs[k].role !== "assistant" || !u || typeof u !== "object") continue;
    const prompt = Number(u.prompt_tokens) || 0;
    const completion = Number(u.completion_tokens) || 0;
    const used = Number.isFinite(u.total_tokens) ? u.total_tokens : prompt + completion;
    return { used, prompt, completion, model: msgs[k].model || "" };
  }
  return null;
}

export class ContextMeter {
  /** `root` holds `.ctx-text` (visible figures) and a <meter>. */
  constructor(root) {
    this.root = root;
    this.text = root.querySelector(".ctx-text");
    this.meter = root.querySelector("meter");
  }

  /** "123 / 2,048" and " tokens" (a word narrow screens leave out). */
  _text(figures) {
    const unit = document.createElement("span");
    unit.className = "ctx-unit";
    unit.textContent = " tokens";
    this.text.replaceChildren(figures, ...(figures ? [unit] : []));
  }

  /** `use`: contextUse(conv); `limit`: the model's context length, or null if unknown. */
  show(use, limit) {
    const used = use ? use.used : 0;
    const lim = Number.isInteger(limit) && limit > 0 ? limit : null;
    const key = JSON.stringify([use, lim]);
    if (key === this._key) return; // called on every streamed delta: draw only changes
    this._key = key;
    const ctx = lim ? ` of ${formatTokens(lim)}` : "";
    if (!use) {
      const label = lim ? `Context: no answer yet; the model's context is ${formatTokens(lim)} tokens` : "";
      this._text(lim ? `– / ${formatTokens(lim)}` : "");
      this.meter.setAttribute("aria-label", label);
      this.root.title = label;
    } else {
      const pct = lim ? ` (${Math.min(100, Math.round((used / lim) * 100))}%)` : "";
      this._text(lim ? `${formatTokens(used)} / ${formatTokens(lim)}` : formatTokens(used));
      this.meter.setAttribute("aria-label", `Context used: ${formatTokens(used)}${ctx} tokens${pct}, as of the last answer`);
      this.root.title = `Prompt ${formatTokens(use.prompt)} + answer ${formatTokens(use.completion)} = ${formatTokens(used)}${ctx} tokens (the last answer's usage)`;
    }
    this.meter.hidden = !lim;
    if (lim) {
      this.meter.max = lim;
      this.meter.low = Math.round(lim * 0.75);
      this.meter.high = Math.round(lim * 0.9);
      this.meter.optimum = 0;
      this.meter.value = Math.min(used, lim);
    }
    this.root.hidden = !use && !lim;
  }
}
