// Attachments: text files (read in the browser, capped in size, shown as chips, sent as text)
// and images (images.js: checked against the server's limits, sent as image parts).
//
// A user message keeps its files in `msg.attachments` ([{name, size, text}]) beside what the
// person typed (`msg.content`), so the message shows the typed text and a chip per file, and an
// edit changes the text only. On the wire each file follows the typed text as a fenced block
// named by the file (`messageText`): the model reads it as part of the message. The file never
// goes to the server by itself, and nothing of it is run or rendered as markup.

import { icon } from "./icons.js";
import { imageGallery, imagesKey } from "./image-view.js";

export const MAX_FILES = 8; // per message
export const DEFAULT_KB = 100; // the largest file, a setting (settings.attach_kb)
export const MAX_KB = 1000; // the setting's own top: conversations live in localStorage (about 5 MB)
// Offered in the picker; any file that reads as UTF-8 text is taken.
export const ACCEPT = ".txt,.md,.markdown,.csv,.tsv,.json,.jsonl,.yaml,.yml,.toml,.ini,.xml,.html,.css,.log,.py,.js,.mjs,.ts,.tsx,.jsx,.c,.h,.cc,.cpp,.hpp,.rs,.go,.java,.kt,.rb,.php,.sh,.sql,.r,.swift,text/*";

export function formatSize(bytes) {
  if (bytes < 1000) return `${bytes} B`;
  return `${(bytes / 1000).toFixed(bytes < 10_000 ? 1 : 0)} kB`;
}

/** {attachment} or {error}: a File read as UTF-8 text, refused past `maxKb` kilobytes (1000
 * bytes each, as sizes are shown) or when it is not text. */
export async function readTextFile(file, maxKb) {
  const name = String(file.name || "file").slice(0, 255);
  if (file.size > maxKb * 1000) {
    return { error: `“${name}” is ${formatSize(file.size)}: a file may be at most ${maxKb} kB (Settings, “Largest attached file”).` };
  }
  const bytes = new Uint8Array(await file.arrayBuffer());
  let text;
  try {
    text = new TextDecoder("utf-8", { fatal: true }).decode(bytes);
  } catch {
    text = null;
  }
  if (text === null || text.includes("\0")) return { error: `“${name}” is not a text file (only UTF-8 text can be attached).` };
  return { attachment: { name, size: bytes.length, text: text.replace(/^\uFEFF/, "") } };
}

/** A list of attachments as stored ([{name, size, text}]), dropping anything else. */
export function attachmentsOf(msg) {
  const list = Array.isArray(msg?.attachments) ? msg.attachments : [];
  return list.filter((a) => a && typeof a.name === "string" && typeof a.text === "string");
}

/** One file as the model reads it: its name, then its text in a fence no line of it can close. */
export function fileBlock(a) {
  let longest = 0;
  for (const run of a.text.match(/`+/g) || []) longest = Math.max(longest, run.length);
  const fence = "`".repeat(Math.max(3, longest + 1));
  const ext = /\.([A-Za-z0-9+#-]{1,12})$/.exec(a.name)?.[1]?.toLowerCase() || "";
  const body = a.text.endsWith("\n") ? a.text : `${a.text}\n`;
  return `File “${a.name}”:\n${fence}${ext}\n${body}${fence}`;
}

/** A user message's text as sent (and exported): what was typed, then each file. */
export function messageText(msg) {
  const files = attachmentsOf(msg).map(fileBlock);
  return [msg.content, ...files].filter((part) => part !== "").join("\n\n");
}

/** A row of chips, one per file; with `onRemove(k)`, each has a remove button. */
export function chipList(list, onRemove = null) {
  const ul = document.createElement("ul");
  ul.className = "chips";
  ul.setAttribute("aria-label", "Attached files");
  list.forEach((a, k) => {
    const li = document.createElement("li");
    li.className = "chip";
    li.title = `${a.name}, ${formatSize(a.size)}`;
    const name = document.createElement("span");
    name.className = "chip-name";
    name.textContent = a.name;
    const size = document.createElement("span");
    size.className = "chip-size";
    size.textContent = formatSize(a.size);
    li.append(icon("file"), name, size);
    if (onRemove) {
      const b = document.createElement("button");
      b.type = "button";
      b.className = "chip-remove";
      b.setAttribute("aria-label", `Remove ${a.name}`);
      b.appendChild(icon("close"));
      b.addEventListener("click", () => onRemove(k));
      li.appendChild(b);
    }
    ul.appendChild(li);
  });
  return ul;
}

/** A sent message's images and file chips (none when it has neither), drawn again only when
 * they change. */
export function renderChips(box, msg) {
  const list = attachmentsOf(msg);
  const key = `${list.map((a) => `${a.name}\u0000${a.size}`).join("\u0000")}\u0001${imagesKey(msg)}`;
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  const parts = [imageGallery(msg), list.length ? chipList(list) : null].filter(Boolean);
  box.replaceChildren(...parts);
  box.hidden = !parts.length;
}

