// The conversation list: select, rename (inline), delete (click twice to confirm).

import { iconButton } from "./icons.js";

const CONFIRM_MS = 3000;

export class Sidebar {
  /** `actions`: {select(id), rename(id, title), remove(id), generating(id)} */
  constructor(listEl, actions) {
    this.el = listEl;
    this.actions = actions;
    this.renaming = null;
    this.confirming = null;
    this._confirmTimer = 0;
    listEl.addEventListener("click", (ev) => this._onClick(ev));
  }

  /** `snippets`: conversation id -> the matching text a search found (search.js). */
  render(convs, activeId, snippets = null) {
    this.snippets = snippets;
    const focusedId = document.activeElement?.closest?.(".conv-item")?.dataset.id;
    const focusedAction = document.activeElement?.dataset?.action;
    // An open rename box survives re-renders (another chat finishing) with its text.
    const editing = this.renaming
      ? this.el.querySelector(`.conv-item[data-id="${CSS.escape(this.renaming)}"]`)?.querySelector("input")?.closest("li")
      : null;
    const items = convs.map((c) => (editing && c.id === this.renaming ? editing : this._item(c, c.id === activeId)));
    this.el.replaceChildren(...items);
    editing?.querySelector("input")?.focus();
    // Keep keyboard focus where it was across the re-render.
    if (focusedId && focusedAction) {
      this.el.querySelector(`.conv-item[data-id="${CSS.escape(focusedId)}"] [data-action="${focusedAction}"]`)?.focus();
    }
  }

  _item(conv, active) {
    const li = document.createElement("li");
    li.className = "conv-item";
    li.dataset.id = conv.id;
    if (active) li.classList.add("active");
    if (this.renaming === conv.id) {
      li.appendChild(this._renameInput(conv));
      return li;
    }
    const sel = document.createElement("button");
    sel.type = "button";
    sel.className = "conv-select";
    sel.dataset.action = "select";
    if (active) sel.setAttribute("aria-current", "page");
    const title = document.createElement("span");
    title.className = "conv-title-text";
    title.textContent = conv.title;
    sel.appendChild(title);
    const snippet = this.snippets?.get(conv.id);
    if (snippet) {
      const s = document.createElement("span");
      s.className = "conv-snippet";
      s.textContent = snippet;
      sel.classList.add("has-snippet");
      sel.appendChild(s);
    }
    if (this.actions.generating(conv.id)) {
      const dot = document.createElement("span");
      dot.className = "live-dot";
      dot.title = "Answering";
      const sr = document.createElement("span");
      sr.className = "visually-hidden";
      sr.textContent = " (answering)";
      sel.append(dot, sr);
    }
    const rename = iconButton("edit", `Rename conversation “${conv.title}”`, { cls: "icon-btn small" });
    rename.dataset.action = "rename";
    const confirming = this.confirming === conv.id;
    const del = iconButton(
      "trash",
      confirming ? `Press again to delete “${conv.title}”` : `Delete conversation “${conv.title}”`,
      { cls: `icon-btn small${confirming ? " confirm" : ""}`, text: confirming ? "Delete?" : "" },
    );
    del.dataset.action = "delete";
    li.append(sel, rename, del);
    return li;
  }

  _renameInput(conv) {
    const input = document.createElement("input");
    input.type = "text";
    input.className = "conv-rename-input";
    input.value = conv.title;
    input.maxLength = 200;
    input.setAttribute("aria-label", "New name for the conversation");
    let done = false;
    const finish = (save) => {
      if (done) return;
      done = true;
      this.renaming = null;
      if (save && input.value.trim() && input.value.trim() !== conv.title) this.actions.rename(conv.id, input.value);
      else this.actions.rerender();
      this.el.querySelector(`.conv-item[data-id="${CSS.escape(conv.id)}"] [data-action="rename"]`)?.focus();
    };
    input.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter") {
        ev.preventDefault();
        finish(true);
      } else if (ev.key === "Escape") {
        ev.preventDefault();
        ev.stopPropagation();
        finish(false);
      }
    });
    input.addEventListener("blur", () => finish(true));
    requestAnimationFrame(() => {
      input.focus();
      input.select();
    });
    return input;
  }

  _onClick(ev) {
    const button = ev.target.closest("button[data-action]");
    const li = button?.closest(".conv-item");
    if (!li) return;
    const id = li.dataset.id;
    switch (button.dataset.action) {
      case "select":
        this.actions.select(id);
        break;
      case "rename":
        this.renaming = id;
        this.actions.rerender();
        break;
      case "delete":
        clearTimeout(this._confirmTimer);
        if (this.confirming === id) {
          this.confirming = null;
          this.actions.remove(id);
        } else {
          this.confirming = id;
          this._confirmTimer = setTimeout(() => {
            this.confirming = null;
            this.actions.rerender();
          }, CONFIRM_MS);
          this.actions.rerender();
        }
        break;
      default:
        break;
    }
  }
}
