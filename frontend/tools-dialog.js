// The tools editor of a conversation: the "Tools" button by the model picker and its dialog,
// where the person defines functions (name, description, a JSON Schema of the parameters) and
// picks whether the model may call them, must call one, must call a named one, or must not.
// What it edits is conv.tools (tools.js); every change is saved at once, and checked as typed:
// a problem shows under its function, and while there is one nothing of this conversation is sent.

import { icon } from "./icons.js";
import { blankFunction, MAX_FUNCTIONS, normalizeTools, toolCount, toolProblems } from "./tools.js";

const CHOICE_LABEL = {
  auto: "may call them (auto)",
  required: "must call one of them (required)",
  none: "must not call them (none)",
};

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else if (k in node && !k.startsWith("aria") && !k.startsWith("data")) node[k] = v;
    else node.setAttribute(k, v);
  }
  node.append(...children);
  return node;
}

function field(id, label, hint, control) {
  const l = el("label", { htmlFor: id }, label);
  if (hint) l.append(el("span", { class: "muted" }, hint));
  return el("div", { class: "field" }, l, control);
}

/** `chat`: the Chat (its "refused" events, its store); `activeId()`: the conversation on
 * screen; `refusal`: the "Not sent" line (refusal.js). */
export class ToolsControl {
  constructor(chat, activeId, refusal) {
    this.chat = chat;
    this.activeId = activeId;
    this.refusal = refusal;
    this.rows = []; // per function: {fieldset, name, description, parameters, error}
    this._build();
    chat.addEventListener("refused", (ev) => {
      if (ev.detail.id !== this.activeId() || ev.detail.part !== "tools") return;
      refusal.show("tools", ev.detail.error, "Edit tools", () => this.open());
    });
  }

  _build() {
    this.button = el("button", { type: "button", id: "tools-button", class: "btn tools-btn", "aria-haspopup": "dialog", "aria-controls": "tools-dialog" });
    document.getElementById("model-picker").after(this.button);
    this.button.addEventListener("click", () => this.open());

    const close = el("button", { class: "icon-btn", value: "close", "aria-label": "Close the tools" });
    close.appendChild(icon("close"));
    this.list = el("div", { id: "tool-list", class: "tool-list" });
    this.add = el("button", { type: "button", id: "tool-add", class: "btn" }, "Add a function");
    this.add.prepend(icon("plus"));
    this.choice = el("select", { id: "tool-choice" });
    this.check = el("p", { id: "tools-check", class: "format-check", "aria-live": "polite", hidden: true });
    const form = el(
      "form",
      { method: "dialog", class: "settings-form" },
      el("div", { class: "settings-head" }, el("h2", { id: "tools-title" }, "Tools"), close),
      el("p", { class: "muted format-note" }, "Functions the model may call in this conversation, sent with each of its requests. A call shows as a card under the answer: type its result there, or go on talking."),
      this.list,
      el("div", { class: "tool-add-row" }, this.add),
      field("tool-choice", "The model", "", this.choice),
      this.check,
      el("div", { class: "settings-actions end" }, el("button", { class: "btn primary", value: "close" }, "Done")),
    );
    this.dialog = el("dialog", { id: "tools-dialog", class: "settings tools-dialog", "aria-labelledby": "tools-title" }, form);
    document.body.appendChild(this.dialog);

    this.add.addEventListener("click", () => this._addFunction());
    this.choice.addEventListener("change", () => {
      const v = this.choice.value;
      this._set((t) => Object.assign(t, v.startsWith("fn:") ? { choice: "function", function: v.slice(3) } : { choice: v }));
    });
    this.dialog.addEventListener("keydown", (ev) => {
      if (ev.key === "Escape") ev.stopPropagation(); // closes the dialog only, never stops an answer
    });
    this.dialog.addEventListener("close", () => document.getElementById("prompt")?.focus());
  }

  _tools() {
    return normalizeTools(this.chat.get(this.activeId())?.tools);
  }

  /** Change the conversation's tools with `edit(tools)`, save, and show the result. */
  _set(edit) {
    const conv = this.chat.get(this.activeId());
    if (!conv) return;
    const tools = this._tools();
    edit(tools);
    conv.tools = tools;
    this.chat.store.saveConversation(conv, 300);
    this._showState(tools);
  }

  _addFunction() {
    if (this._tools().functions.length >= MAX_FUNCTIONS) return;
    this._set((t) => t.functions.push(blankFunction()));
    this._buildRows();
    this.rows.at(-1)?.name.focus();
  }

  _remove(k) {
    this._set((t) => t.functions.splice(k, 1));
    this._buildRows();
    (this.rows[Math.min(k, this.rows.length - 1)]?.name || this.add).focus();
  }

  /** One fieldset per function; built when the list changes, not while typing (focus stays). */
  _buildRows() {
    const tools = this._tools();
    this.rows = tools.functions.map((f, k) => {
      const id = (what) => `tool-${what}-${k}`;
      const error = el("p", { id: id("err"), class: "field-error", "aria-live": "polite", hidden: true });
      const input = (what, props) => el(props.rows ? "textarea" : "input", { id: id(what), spellcheck: false, autocomplete: "off", "aria-describedby": id("err"), ...props });
      const row = {
        name: input("name", { type: "text", placeholder: "get_weather", value: f.name }),
        description: input("description", { type: "text", placeholder: "What it does, for the model", value: f.description }),
        parameters: input("parameters", { rows: 5, placeholder: '{"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}', value: f.parameters }),
        error,
      };
      const remove = el("button", { type: "button", class: "btn tool-remove", "aria-label": `Remove function ${k + 1}` }, "Remove");
      remove.addEventListener("click", () => this._remove(k));
      row.fieldset = el(
        "fieldset",
        { class: "tool-def" },
        el("legend", {}, `Function ${k + 1}`),
        field(id("name"), "Name", "letters, digits, _ . -", row.name),
        field(id("description"), "Description", "optional", row.description),
        field(id("parameters"), "Parameters", "a JSON Schema of an object, optional", row.parameters),
        error,
        remove,
      );
      for (const what of ["name", "description", "parameters"]) {
        row[what].addEventListener("input", () => this._set((t) => (t.functions[k][what] = row[what].value)));
      }
      return row;
    });
    this.list.replaceChildren(...this.rows.map((r) => r.fieldset));
    this.add.disabled = tools.functions.length >= MAX_FUNCTIONS;
    this._showState(tools);
  }

  /** The button, the choice's options, and each function's problem (as typed). */
  _showState(tools) {
    const problems = toolProblems(tools);
    this.rows.forEach((row, k) => {
      const mine = problems.filter((p) => p.index === k);
      row.error.textContent = mine.map((p) => p.message).join(" ");
      row.error.hidden = !mine.length;
      for (const what of ["name", "description", "parameters"]) {
        row[what].setAttribute("aria-invalid", String(mine.some((p) => p.field === what)));
      }
    });
    this._fillChoice(tools);
    const general = problems.find((p) => p.index === null);
    this.check.textContent = general?.message || "";
    this.check.hidden = !general;
    this._showButton(tools, problems.length > 0);
    if (!problems.length) this.refusal.clear("tools");
  }

  _fillChoice(tools) {
    const names = [...new Set(tools.functions.map((f) => f.name).filter(Boolean))];
    const named = tools.choice === "function" ? tools.function : null;
    if (named && !names.includes(named)) names.push(named); // shown, and named in the problem
    const options = [["auto", CHOICE_LABEL.auto], ["required", CHOICE_LABEL.required]];
    for (const n of names) options.push([`fn:${n}`, `must call ${n}`]);
    options.push(["none", CHOICE_LABEL.none]);
    const value = named !== null ? `fn:${named}` : tools.choice;
    const key = JSON.stringify(options);
    if (this.choice.dataset.key !== key) {
      this.choice.dataset.key = key;
      this.choice.replaceChildren(...options.map(([v, label]) => el("option", { value: v }, label)));
    }
    this.choice.value = value;
  }

  _showButton(tools, invalid) {
    const n = toolCount(tools);
    this.button.textContent = n ? `Tools (${n})` : "Tools";
    const what = n ? `${n} function${n === 1 ? "" : "s"}, the model ${tools.choice === "function" ? `must call ${tools.function}` : CHOICE_LABEL[tools.choice].replace(/ \(.*\)$/, "")}` : "none defined";
    // The visible text first in the name (WCAG 2.5.3), then what it stands for.
    this.button.setAttribute("aria-label", `${this.button.textContent}: ${what}${invalid ? ", needs fixing" : ""}`);
    this.button.title = `Tools the model may call: ${what}`;
    this.button.classList.toggle("on", n > 0);
    this.button.classList.toggle("invalid", invalid);
  }

  /** The conversation on screen changed: redraw the button (and the dialog, if open). */
  show() {
    if (this.dialog.open) this._buildRows();
    else this._showState(this._tools());
  }

  open() {
    this._buildRows();
    if (!this.dialog.open) this.dialog.showModal();
    const bad = toolProblems(this._tools())[0];
    const row = bad && bad.index !== null ? this.rows[bad.index] : this.rows[0];
    (bad?.field === "choice" ? this.choice : row ? row[bad?.field || "name"] : this.add).focus();
  }
}
