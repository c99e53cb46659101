// A conversation as the `messages` of a chat request (docs/protocol.md): what the model reads.
//
//   system     the conversation's system prompt, when it has one
//   user       what was typed, then each attached file as a fenced block (attachments.js); with
//              images, a list of content parts: each image (an `image_url` part with its data:
//              URL, images.js), then that text as a `text` part when there is any
//   assistant  the answer's text and its tool calls (OpenAI's shape: content null when only
//              calls); failed answers and empty ones are left out, and so is the Thinking text
//   tool       a result the person typed for a call: {role: "tool", tool_call_id, content}; a
//              call with no result is simply followed by the next turn

import { messageText } from "./attachments.js";
import { imageParts } from "./images.js";

/** The calls of an answer that can be sent back: those with an id and a name. */
export function callsOf(msg) {
  const calls = Array.isArray(msg.toolCalls) ? msg.toolCalls : [];
  return calls.filter((c) => c && typeof c.id === "string" && c.id && typeof c.name === "string" && c.name);
}

function assistantTurn(m) {
  const calls = callsOf(m);
  if (m.status === "error" || (!m.content && !calls.length)) return null;
  const turn = { role: "assistant", content: m.content || (calls.length ? null : "") };
  if (calls.length) {
    turn.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: String(c.arguments ?? "") } }));
  }
  return turn;
}

function userTurn(m) {
  const text = messageText(m);
  const images = imageParts(m);
  if (!images.length) return { role: "user", content: text };
  return { role: "user", content: [...images, ...(text ? [{ type: "text", text }] : [])] };
}

export function chatMessages(conv) {
  const out = [];
  if (conv.system.trim()) out.push({ role: "system", content: conv.system });
  const sentCalls = new Set(); // a result is sent only after the call it answers
  for (const m of conv.messages) {
    if (m.role === "user") out.push(userTurn(m));
    else if (m.role === "assistant") {
      const turn = assistantTurn(m);
      if (!turn) continue;
      for (const c of turn.tool_calls || []) sentCalls.add(c.id);
      out.push(turn);
    } else if (m.role === "tool" && sentCalls.has(m.toolCallId)) {
      out.push({ role: "tool", tool_call_id: m.toolCallId, content: m.content });
    }
  }
  return out;
}
