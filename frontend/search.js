// Search across conversations (the sidebar's search box): titles, system prompts and
// the text of every message. Case and accents are ignored; every word of the query
// must occur somewhere in the conversation, in any order.

const SNIPPET = 70; // characters of context shown around a match

/** Lower case without accents, so "Café" matches "cafe". Keeps string length for ASCII. */
export function fold(text) {
  return String(text).normalize("NFD").replace(/[\u0300-\u036f]/g, "").toLowerCase();
}

function terms(query) {
  return fold(query).split(/\s+/).filter(Boolean);
}

/** The part of `text` around `at`, on one line, with ellipses where it was cut. */
function around(text, at, len) {
  const start = Math.max(0, at - Math.floor((SNIPPET - len) / 2));
  const end = Math.min(text.length, start + SNIPPET);
  const piece = text.slice(start, end).replace(/\s+/g, " ").trim();
  return `${start > 0 ? "…" : ""}${piece}${end < text.length ? "…" : ""}`;
}

/** The conversations that match `query`, in the given order: [{conv, snippet}]. The
 * snippet shows the first message that contains the first word ("" when the title has it). */
export function searchConversations(convs, query) {
  const words = terms(query);
  if (!words.length) return convs.map((conv) => ({ conv, snippet: "" }));
  const out = [];
  for (const conv of convs) {
    const title = fold(conv.title || "");
    const texts = [conv.system || "", ...conv.messages.map((m) => (typeof m.content === "string" ? m.content : ""))];
    const folded = texts.map(fold);
    const all = `${title}\n${folded.join("\n")}`;
    if (!words.every((w) => all.includes(w))) continue;
    let snippet = "";
    if (!title.includes(words[0])) {
      const k = folded.findIndex((t) => t.includes(words[0]));
      // Folding can change the length of non-ASCII text: then the snippet starts at its beginning.
      const at = folded[k].length === texts[k].length ? folded[k].indexOf(words[0]) : 0;
      snippet = around(texts[k], at, words[0].length);
    }
    out.push({ conv, snippet });
  }
  return out;
}
