// The "Export and import" dialog (opened from the sidebar): export the conversation on
// screen or all of them as JSON or Markdown, and import a JSON export (conv-io.js).

import {
  download,
  fileName,
  ImportError,
  importSummary,
  MAX_FILE_BYTES,
  parseConversations,
  planImport,
  toJson,
  toMarkdown,
} from "./conv-io.js";

export class DataDialog {
  /** `current()`: the conversation on screen; `imported(convs)`: they were stored. */
  constructor(dialog, chat, store, { current, imported }) {
    this.dialog = dialog;
    this.chat = chat;
    this.store = store;
    this.current = current;
    this.imported = imported;
    const $ = (id) => dialog.querySelector(`#${id}`);
    this.status = $("import-status");
    const save = (convs, ext, name) => {
      if (!convs.length) return;
      const text = ext === "json" ? toJson(convs) : toMarkdown(convs);
      download(fileName(name, ext), text, ext === "json" ? "application/json" : "text/markdown");
    };
    const one = () => [this.current()].filter(Boolean);
    $("export-one-json").addEventListener("click", () => save(one(), "json", one()[0]?.title));
    $("export-one-md").addEventListener("click", () => save(one(), "md", one()[0]?.title));
    $("export-all-json").addEventListener("click", () => save(chat.list(), "json", "conversations"));
    $("export-all-md").addEventListener("click", () => save(chat.list(), "md", "conversations"));
    const file = $("import-file");
    file.addEventListener("change", async () => {
      const f = file.files?.[0];
      file.value = ""; // the same file can be chosen again
      if (f) await this.importFile(f);
    });
    dialog.addEventListener("click", (ev) => {
      if (ev.target === dialog) dialog.close();
    });
  }

  open() {
    const conv = this.current();
    const $ = (id) => this.dialog.querySelector(`#${id}`);
    $("data-conv-name").textContent = conv ? `“${conv.title}”, ${conv.messages.length} messages` : "";
    const n = this.chat.list().length;
    $("data-count").textContent = `(${n})`;
    this.say("");
    if (!this.dialog.open) this.dialog.showModal();
  }

  say(text, error = false) {
    this.status.textContent = text;
    this.status.hidden = !text;
    this.status.classList.toggle("error", error);
  }

  /** Read, check, then store all or nothing. */
  async importFile(f) {
    try {
      if (f.size > MAX_FILE_BYTES) {
        throw new ImportError(`The file is too large (${(f.size / 2 ** 20).toFixed(1)} MB; at most ${MAX_FILE_BYTES / 2 ** 20} MB).`);
      }
      const list = parseConversations(await f.text());
      const plan = planImport(list, (id) => this.chat.get(id));
      if (plan.add.length && !this.store.addConversations(plan.add)) {
        throw new ImportError("This browser's storage would not take them (is it full?).");
      }
      this.chat.adopt(plan.add);
      this.say(importSummary(plan));
      if (plan.add.length) this.imported(plan.add);
    } catch (err) {
      const why = err instanceof ImportError ? err.message : `The file could not be read (${err.message}).`;
      this.say(`Nothing was imported. ${why}`, true);
    }
  }
}
