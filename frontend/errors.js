// Sentences a person understands for the protocol's error codes (docs/protocol.md,
// "Server → client"), each followed by the server's own message in brackets.

/** When to retry, from a `retry_after_s`: "in 13 s (at 14:02:31)". */
export function retryWhen(seconds, now = Date.now()) {
  const s = Math.max(1, Math.ceil(Number(seconds)));
  const at = new Date(now + s * 1000).toLocaleTimeString("en-GB", { hour12: false });
  const span = s < 120 ? `${s} s` : `${Math.round(s / 60)} min`;
  return `in ${span} (at ${at})`;
}

/** `extra`: {retryAfterS} (the error's `retry_after_s`), {model} (the model asked for). */
export function describeError(code, message, param, extra = {}) {
  const detail = message ? ` (${message})` : "";
  const retry = Number(extra.retryAfterS) > 0 ? retryWhen(extra.retryAfterS) : "in a moment";
  const model = extra.model ? `“${extra.model}”` : "this model";
  const Model = extra.model ? model : "This model";
  switch (code) {
    case "rate_limited":
      return `You have reached the request limit of this API key. Try again ${retry}.${detail}`;
    case "queue_timeout":
      return `The server was too busy to start this answer in time (it waited in the queue and was dropped). Try again ${retry}.${detail}`;
    case "model_not_found":
      return `The server does not serve ${model} (any more). Pick another model next to the message box.${detail}`;
    case "connection_lost":
    case "unknown_id":
      return "The connection to the server was lost and the server could not resume this answer. The text so far is kept; regenerate to ask again.";
    case "too_many_requests":
      return `Too many requests at once on this connection. Wait for one to finish.${detail}`;
    case "queue_full":
      return `The server is busy right now (its queue is full). Try again ${retry}.${detail}`;
    case "engine_busy":
      return `The model is busy right now. Try again ${retry}.${detail}`;
    case "model_not_ready":
      return `The model is not ready yet (still loading?). Try again ${retry}.${detail}`;
    case "context_length_exceeded":
      return `This conversation no longer fits the model's context. Start a new chat, delete some messages, or lower "Max tokens".${detail}`;
    case "invalid_request":
      if (/cannot see images/.test(message)) {
        return `${Model} cannot see images: it reads text only. Pick a model that sees images next to the message box, or start a new chat without them.${detail}`;
      }
      if (/does not read images yet/.test(message)) return `This server cannot read images yet.${detail}`;
      return `The server rejected the request${param ? `: check "${param}"` : ""}.${detail}`;
    case "slow_consumer":
      return `This answer fell too far behind (the page was not reading it) and the server stopped it.${detail}`;
    case "resumed_elsewhere":
      return "This answer is now shown in another tab or window.";
    case "worker_lost":
      return `The engine serving this answer went away.${detail}`;
    case "engine_stalled":
      return `The engine serving this answer stopped making progress and is restarting. Try again ${retry}.${detail}`;
    case "too_large":
      return `This conversation is too long to send (${message}). Start a new chat or shorten it.`;
    case "internal_error":
      return `The server hit an internal error.${detail}`;
    default:
      return message || `Error: ${code}`;
  }
}
