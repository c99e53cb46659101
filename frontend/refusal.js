// The line above the message box that says why nothing was sent ("Not sent: …"), with a
// button that opens what needs fixing: the answer format (output-format.js) or the tools
// (tools-dialog.js). Chat emits "refused" {id, error, part} and sends nothing.

export class Refusal {
  constructor() {
    this.el = document.createElement("p");
    this.el.id = "format-error"; // the first refusal was the format's; the tests know it by this id
    this.el.className = "format-error";
    this.el.setAttribute("role", "alert");
    this.el.hidden = true;
    this.text = document.createElement("span");
    this.fix = document.createElement("button");
    this.fix.type = "button";
    this.fix.className = "btn small-btn";
    this.el.append(this.text, this.fix);
    this.part = null; // what the shown refusal is about
    this.onFix = null;
    this.fix.addEventListener("click", () => this.onFix?.());
    document.getElementById("composer").before(this.el);
  }

  /** Say why `part` kept the message back; `label` and `onFix` make the button. */
  show(part, error, label, onFix) {
    this.part = part;
    this.onFix = onFix;
    this.text.textContent = `Not sent: ${error}`;
    this.fix.textContent = label;
    this.el.hidden = false;
  }

  /** `part` is fine now: its refusal goes (another part's stays). */
  clear(part) {
    if (this.part === part) this.el.hidden = true;
  }
}
