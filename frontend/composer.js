// The message box: its height, sending, Enter and the stop button.

import { icon } from "./icons.js";

const $ = (id) => document.getElementById(id);

export class Composer {
  /** `chat` sends into the conversation `activeId()` names, with the files and images of `attach`. */
  constructor(chat, attach, activeId) {
    this.chat = chat;
    this.attach = attach;
    this.activeId = activeId;
    this.prompt = $("prompt");
    $("composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.send();
    });
    this.prompt.addEventListener("input", () => this.autosize());
    this.prompt.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing && !ev.altKey && !ev.ctrlKey && !ev.metaKey) {
        ev.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => {
      chat.stop(activeId());
      this.focus();
    });
    $("send").appendChild(icon("send"));
    $("stop").appendChild(icon("stop"));
  }

  focus() {
    this.prompt.focus();
  }

  autosize() {
    const p = this.prompt;
    p.style.height = "auto";
    p.style.height = `${Math.min(p.scrollHeight, Math.round(window.innerHeight * 0.4))}px`;
  }

  send() {
    const id = this.activeId();
    const text = this.prompt.value;
    const files = this.attach.get();
    const images = this.attach.images();
    if (!(text.trim() || files.length || images.length) || this.chat.generating(id)) return;
    if (this.attach.blocked()) {
      this.attach.show(); // says why: the model cannot see them
      return;
    }
    if (this.chat.send(id, text, files, images)) {
      this.prompt.value = "";
      this.attach.clear();
      this.autosize();
    }
  }
}
