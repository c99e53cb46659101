// The parts of an assistant message besides its text, as the socket brings them
// (docs/protocol.md, "Tools and reasoning"):
//   msg.reasoning   the Thinking text (`reasoning` messages), appended as it streams
//   msg.thinkingMs  how long it thought: first reasoning text to the first answer text
//   msg.toolCalls   [{id, name, arguments}] assembled from `delta.tool_calls`

const MAX_CALLS = 128; // as many as a request may declare tools

/** Append a piece of reasoning. `rt`: the answer's runtime timings; `now`: performance.now(). */
export function addReasoning(msg, text, rt, now) {
  if (rt.thinkAt == null) rt.thinkAt = now;
  msg.reasoning = (typeof msg.reasoning === "string" ? msg.reasoning : "") + text;
}

/** The answer proper started (or ended): the thinking time is known from here on. */
export function endReasoning(msg, rt, now) {
  if (rt?.thinkAt != null && msg.thinkingMs == null) msg.thinkingMs = Math.max(0, now - rt.thinkAt);
}

/** Merge OpenAI-shaped call deltas ({index, id?, function: {name?, arguments?}}) into
 * msg.toolCalls: `id` and `name` come once, `arguments` in pieces to append. */
export function mergeToolCalls(msg, deltas) {
  if (!Array.isArray(deltas)) return;
  const calls = Array.isArray(msg.toolCalls) ? msg.toolCalls : (msg.toolCalls = []);
  for (const d of deltas) {
    if (!d || typeof d !== "object") continue;
    const k = Number.isInteger(d.index) ? d.index : 0;
    if (k < 0 || k >= MAX_CALLS) continue;
    while (calls.length <= k) calls.push({ id: "", name: "", arguments: "" });
    const call = calls[k];
    if (typeof d.id === "string" && d.id) call.id = d.id;
    const fn = d.function && typeof d.function === "object" ? d.function : {};
    if (typeof fn.name === "string" && fn.name && !call.name) call.name = fn.name;
    if (typeof fn.arguments === "string") call.arguments += fn.arguments;
  }
}
