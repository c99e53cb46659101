// One WebSocket to /v1/ws carrying many requests at once (docs/protocol.md).
//
// - Reconnects by itself with exponential backoff and jitter, without a page reload.
// - Requests started while the socket is down wait in an outbox and go out on open.
// - A request cut mid-stream is resumed on the next socket with
//   {"type":"resume","id","after_seq","resume_token"}: the token comes in the request's
//   `started` message, and only its holder can resume the stream. Deltas at or below
//   the last seen seq are dropped, so a resumed stream never repeats text. A server
//   without resume answers an error (`unknown_id`), which reaches the request's `error`
//   handler with `resumed: true`.
// - An application-level ping detects a dead socket that never reported its close.

export const ConnState = Object.freeze({
  CONNECTING: "connecting", // first attempt, before any socket opened
  CONNECTED: "connected",
  DISCONNECTED: "disconnected", // lost or refused; retrying in the background
});

const DEFAULTS = {
  minDelayMs: 300,
  maxDelayMs: 5000,
  pingEveryMs: 15000,
  pongTimeoutMs: 10000,
  cancelGraceMs: 10000, // how long a cancelled request waits for the server's `done`
};

export class WsClient extends EventTarget {
  /** `url`: absolute ws(s):// URL. Events: "state" {state, retryAt}, "hello" (the
   * server's hello), "message-error" (errors that name no live request). */
  constructor(url, options = {}) {
    super();
    this.url = url;
    this.opt = { ...DEFAULTS, ...options };
    this.state = ConnState.CONNECTING;
    this.retryAt = null;
    this.hello = null;
    this._ws = null;
    this._attempt = 0;
    this._retryTimer = null;
    this._pingTimer = null;
    this._pongTimer = null;
    this._seq = 0;
    this._live = new Map(); // id -> {payload, handlers, lastSeq, sent, resuming, cancelled, token}
    this._stopped = false;
  }

  start() {
    this._stopped = false;
    this._open();
  }

  /** Close for good (tests, page unload). */
  stop() {
    this._stopped = true;
    clearTimeout(this._retryTimer);
    this._teardown();
  }

  /** Open a fresh socket now, e.g. after the URL changed (a new API key). */
  reconnect() {
    clearTimeout(this._retryTimer);
    if (this._ws) {
      this._teardown();
      for (const entry of this._live.values()) entry.handlers.interrupted?.();
    }
    this._attempt = 0;
    this._setState(ConnState.CONNECTING);
    this._open();
  }

  /** Try now instead of waiting out the backoff (button click, `online` event). */
  retryNow() {
    if (this.state === ConnState.CONNECTED || this._stopped) return;
    if (this._ws && this._ws.readyState === WebSocket.CONNECTING) return;
    clearTimeout(this._retryTimer);
    this._open();
  }

  newId() {
    this._seq += 1;
    return `r${Date.now().toString(36)}-${this._seq}`;
  }

  /** Start a request. `payload` is the message without `id`; `handlers` has optional
   * queued(position), delta(text, seq, toolCalls), reasoning(text, seq), done(msg),
   * error({code, message, param, resumed}), sent(), started(resumeToken). Returns the request id. */
  request(payload, handlers, id = this.newId()) {
    const entry = { payload: { ...payload, id }, handlers, lastSeq: -1, sent: false, resuming: false };
    // A frame over the server's limit would close the whole socket (1009): refuse it here.
    const limit = Number(this.hello?.limits?.max_message_bytes);
    const size = new TextEncoder().encode(JSON.stringify(entry.payload)).length;
    if (limit > 0 && size > limit) {
      const message = `${Math.ceil(size / 1024)} KB; the server takes up to ${Math.floor(limit / 1024)} KB`;
      queueMicrotask(() => handlers.error?.({ code: "too_large", message, param: null, resumed: false }));
      return id;
    }
    this._live.set(id, entry);
    if (this.state === ConnState.CONNECTED) this._sendStart(id, entry);
    return id;
  }

  /** Pick up a stream started on an earlier socket (or before a page reload), with the
   * resume token its `started` message gave. */
  resume(id, afterSeq, handlers, token) {
    const entry = { payload: null, handlers, lastSeq: afterSeq, sent: true, resuming: false, token };
    this._live.set(id, entry);
    if (this.state === ConnState.CONNECTED) this._sendResume(id, entry);
    return id;
  }

  /** Stop a request. Deltas after this are dropped; the server's `done` (with usage)
   * still reaches `handlers.done`. */
  cancel(id) {
    const entry = this._live.get(id);
    if (!entry) return;
    entry.cancelled = true;
    if (!entry.sent || this.state !== ConnState.CONNECTED) {
      // Never reached the server, or the server already lost it with the socket.
      this._live.delete(id);
      return;
    }
    this._send({ type: "cancel", id });
    setTimeout(() => this._live.delete(id), this.opt.cancelGraceMs);
  }

  get liveCount() {
    return this._live.size;
  }

  // ---- socket lifecycle ---------------------------------------------------------

  _setState(state, retryAt = null) {
    this.state = state;
    this.retryAt = retryAt;
    this.dispatchEvent(new CustomEvent("state", { detail: { state, retryAt } }));
  }

  _open() {
    this._teardown();
    // While an attempt runs the state stays as it was; retryAt null means "trying now".
    if (this.state === ConnState.DISCONNECTED) this._setState(this.state, null);
    let ws;
    try {
      ws = new WebSocket(this.url);
    } catch (err) {
      this._scheduleRetry();
      return;
    }
    this._ws = ws;
    ws.onopen = () => this._onOpen();
    ws.onmessage = (ev) => this._onMessage(ev);
    ws.onclose = () => this._onClose(ws);
    ws.onerror = () => {}; // onclose follows and does the work
  }

  _teardown() {
    clearInterval(this._pingTimer);
    clearTimeout(this._pongTimer);
    const ws = this._ws;
    this._ws = null;
    if (ws) {
      ws.onopen = ws.onmessage = ws.onclose = ws.onerror = null;
      try {
        ws.close();
      } catch {
        /* already closed */
      }
    }
  }

  _onOpen() {
    this._attempt = 0;
    this._setState(ConnState.CONNECTED);
    this._pingTimer = setInterval(() => this._ping(), this.opt.pingEveryMs);
    for (const [id, entry] of this._live) {
      if (entry.cancelled) this._live.delete(id);
      else if (!entry.sent) this._sendStart(id, entry);
      else this._sendResume(id, entry);
    }
  }

  _onClose(ws) {
    if (ws !== this._ws) return;
    this._ws = null;
    this._lost();
  }

  _lost() {
    clearInterval(this._pingTimer);
    clearTimeout(this._pongTimer);
    for (const [id, entry] of this._live) {
      if (entry.cancelled) this._live.delete(id);
      else entry.handlers.interrupted?.();
    }
    if (!this._stopped) this._scheduleRetry();
  }

  _scheduleRetry() {
    const base = Math.min(this.opt.maxDelayMs, this.opt.minDelayMs * 2 ** this._attempt);
    const delay = Math.round(base * (0.5 + Math.random() * 0.5));
    this._attempt += 1;
    this._setState(ConnState.DISCONNECTED, Date.now() + delay);
    clearTimeout(this._retryTimer);
    this._retryTimer = setTimeout(() => this._open(), delay);
  }

  _ping() {
    if (!this._send({ type: "ping" })) return;
    clearTimeout(this._pongTimer);
    // Any frame from the server clears this; silence means a dead socket.
    this._pongTimer = setTimeout(() => {
      if (!this._ws) return;
      this._teardown();
      this._lost();
    }, this.opt.pongTimeoutMs);
  }

  _send(obj) {
    if (!this._ws || this._ws.readyState !== WebSocket.OPEN) return false;
    this._ws.send(JSON.stringify(obj));
    return true;
  }

  _sendStart(id, entry) {
    if (this._send(entry.payload)) {
      entry.sent = true;
      entry.handlers.sent?.();
    }
  }

  _sendResume(id, entry) {
    entry.resuming = true;
    if (!entry.token) {
      // Cut before the server said it started: nothing to resume it with.
      this._route(id, entry, { type: "error", code: "unknown_id", message: "" });
      return;
    }
    this._send({ type: "resume", id, after_seq: entry.lastSeq, resume_token: entry.token });
  }

  // ---- incoming -----------------------------------------------------------------

  _onMessage(ev) {
    clearTimeout(this._pongTimer);
    let msg;
    try {
      msg = JSON.parse(ev.data);
    } catch {
      return; // not ours to fix; never let a bad frame break the socket
    }
    if (!msg || typeof msg !== "object") return;
    if (msg.type === "hello") {
      this.hello = msg;
      this.dispatchEvent(new CustomEvent("hello", { detail: msg }));
      return;
    }
    if (msg.type === "pong") return;
    const entry = msg.id == null ? undefined : this._live.get(String(msg.id));
    if (!entry) {
      if (msg.type === "error") this.dispatchEvent(new CustomEvent("message-error", { detail: msg }));
      return;
    }
    this._route(String(msg.id), entry, msg);
  }

  _route(id, entry, msg) {
    const hd = entry.handlers;
    switch (msg.type) {
      case "started":
        entry.token = String(msg.resume_token ?? "");
        hd.started?.(entry.token);
        break;
      case "queued":
        if (!entry.cancelled) hd.queued?.(msg.position);
        break;
      case "delta": {
        if ((msg.index ?? 0) !== 0) break; // the UI asks for n=1
        const seq = Number.isInteger(msg.seq) ? msg.seq : entry.lastSeq + 1;
        if (seq <= entry.lastSeq) break; // already shown before a reconnect
        entry.lastSeq = seq;
        entry.resuming = false;
        if (!entry.cancelled) hd.delta?.(String(msg.text ?? ""), seq, msg.tool_calls);
        break;
      }
      case "reasoning": {
        // Thinking text; it shares the deltas' seq count (resume skips both alike).
        if ((msg.index ?? 0) !== 0) break;
        const seq = Number.isInteger(msg.seq) ? msg.seq : entry.lastSeq + 1;
        if (seq <= entry.lastSeq) break;
        entry.lastSeq = seq;
        entry.resuming = false;
        if (!entry.cancelled) hd.reasoning?.(String(msg.text ?? ""), seq);
        break;
      }
      case "done":
        if ((msg.index ?? 0) !== 0) break;
        this._live.delete(id);
        hd.done?.(msg);
        break;
      case "error":
        this._live.delete(id);
        hd.error?.({
          code: msg.code || "error",
          message: msg.message || "",
          param: msg.param ?? null,
          retryAfterS: Number.isFinite(msg.retry_after_s) ? msg.retry_after_s : null, // rate_limited, queue_full, ...
          resumed: entry.resuming,
        });
        break;
      default:
        break;
    }
  }
}

/** The gateway's socket URL for this page. Browsers cannot set headers on a
 * WebSocket, so an API key travels as `?api_key=` (the gateway accepts it there). */
export function defaultWsUrl(apiKey = "", loc = window.location) {
  const url = `${loc.protocol === "https:" ? "wss:" : "ws:"}//${loc.host}/v1/ws`;
  return apiKey ? `${url}?api_key=${encodeURIComponent(apiKey)}` : url;
}
