// The paperclip by the message box: text files and images picked, pasted into the message box
// or dropped on the chat, waiting per conversation (in this page only) until they are sent;
// their chips; and the line that says why one was refused or why they cannot be sent now.

import { chipList, MAX_FILES, ACCEPT, readTextFile } from "./attachments.js";
import { icon } from "./icons.js";
import { conversationImages, formatBytes, IMAGE_ACCEPT, imageLimits, looksLikeImage, readImageFile } from "./images.js";
import { imageChipList } from "./image-view.js";

const $ = (id) => document.getElementById(id);

export class AttachControl {
  /** `maxKb()`: the text files' size cap now; `activeId()`: the conversation on screen;
   * `server`: {hello() (the socket's hello: its limits), conv() (the conversation on screen),
   * model() ({name, sees}: `sees` true, false, or null while /v1/models has not said)}. */
  constructor(maxKb, activeId, server) {
    this.maxKb = maxKb;
    this.activeId = activeId;
    this.server = server;
    this.pending = new Map(); // conversation id -> {files: [{name, size, text}], images: [...]} (images.js)
    this.refused = []; // why the last files added were refused
    const prompt = $("prompt");
    this.input = Object.assign(document.createElement("input"), {
      type: "file",
      id: "attach-file",
      multiple: true,
      accept: `${IMAGE_ACCEPT},${ACCEPT}`,
      hidden: true,
    });
    this.input.setAttribute("aria-hidden", "true");
    this.input.tabIndex = -1;
    this.button = document.createElement("button");
    this.button.type = "button";
    this.button.id = "attach";
    this.button.className = "btn attach-btn";
    this.button.setAttribute("aria-label", "Attach images or text files");
    this.button.title = "Attach images (PNG, JPEG, WebP, GIF) or text files; or paste or drop them here";
    this.button.appendChild(icon("clip"));
    prompt.before(this.button, this.input);
    this.chips = document.createElement("div");
    this.chips.id = "attach-chips";
    this.chips.className = "attach-chips";
    this.error = document.createElement("p");
    this.error.id = "attach-error";
    this.error.className = "attach-error";
    this.error.setAttribute("role", "alert");
    this.error.hidden = true;
    $("composer").before(this.chips, this.error);
    this.button.addEventListener("click", () => this.input.click());
    this.input.addEventListener("change", async () => {
      const files = [...(this.input.files || [])];
      this.input.value = ""; // the same file can be picked again
      await this.add(files);
    });
    this.listenForPasteAndDrop(prompt, $("main"));
  }

  /** A pasted image (a screenshot) or files dropped anywhere on the chat are attached. */
  listenForPasteAndDrop(prompt, area) {
    prompt.addEventListener("paste", (ev) => {
      const files = [...(ev.clipboardData?.files || [])];
      if (!files.length) return;
      if (!ev.clipboardData.types.includes("text/plain")) ev.preventDefault(); // only files: no text to paste
      this.add(files);
    });
    const hasFiles = (ev) => [...(ev.dataTransfer?.types || [])].includes("Files");
    area.addEventListener("dragover", (ev) => {
      if (!hasFiles(ev)) return;
      ev.preventDefault();
      ev.dataTransfer.dropEffect = "copy";
      area.classList.add("dropping");
    });
    area.addEventListener("dragleave", (ev) => {
      if (!area.contains(ev.relatedTarget)) area.classList.remove("dropping");
    });
    area.addEventListener("drop", (ev) => {
      area.classList.remove("dropping");
      if (!hasFiles(ev)) return;
      ev.preventDefault();
      this.add([...ev.dataTransfer.files]);
    });
  }

  _list(id = this.activeId()) {
    if (!this.pending.has(id)) this.pending.set(id, { files: [], images: [] });
    return this.pending.get(id);
  }

  /** Read files into the conversation on screen; a refused one is named in the error line. */
  async add(files) {
    const list = this._list();
    this.refused = [];
    for (const file of files) {
      const why = looksLikeImage(file) ? await this._addImage(list, file) : await this._addText(list, file);
      if (why) this.refused.push(why);
    }
    this.show();
  }

  async _addText(list, file) {
    if (list.files.length >= MAX_FILES) return `At most ${MAX_FILES} files go with one message.`;
    const { attachment, error } = await readTextFile(file, this.maxKb());
    if (!error) list.files.push(attachment);
    return error;
  }

  async _addImage(list, file) {
    const hello = this.server.hello();
    const limits = imageLimits(hello);
    const most = limits.max_images_per_request;
    const sent = conversationImages(this.server.conv());
    if (sent.count + list.images.length >= most) {
      const held = sent.count ? ` This conversation already holds ${sent.count}, and each request carries them all.` : "";
      return `The server reads at most ${most} images in one request.${held} Start a new chat for more images.`;
    }
    const { image, error } = await readImageFile(file, limits);
    if (error) return error;
    // Every later request carries the conversation's images: they must fit one message.
    const frame = Number(hello?.limits?.max_message_bytes);
    const chars = sent.chars + list.images.reduce((n, im) => n + im.url.length, 0) + image.url.length;
    if (frame > 0 && chars > frame * 0.95) {
      return `With “${image.name}”, this conversation's images come to ${formatBytes(chars)} as sent (base64); the server takes at most ${formatBytes(frame)} in one message. Use a smaller image, or start a new chat.`;
    }
    list.images.push(image);
    return "";
  }

  /** Why the waiting images cannot be sent to the conversation's model, or "". */
  blocked() {
    if (!this.images().length) return "";
    const { name, sees } = this.server.model();
    if (sees !== false) return "";
    return `${name ? `“${name}”` : "This model"} cannot see images: it reads text only. Pick a model that sees images next to the message box, or remove the images.`;
  }

  /** The text files waiting in the conversation on screen. */
  get(id = this.activeId()) {
    return this.pending.get(id)?.files || [];
  }

  /** The images waiting in the conversation on screen. */
  images(id = this.activeId()) {
    return this.pending.get(id)?.images || [];
  }

  /** They were sent: the composer is empty again. */
  clear(id = this.activeId()) {
    this.pending.delete(id);
    this.refused = [];
    this.show();
  }

  /** The chips of the conversation on screen, and the error line (also after the model changed). */
  show() {
    const list = this._list();
    const removed = () => {
      this.refused = [];
      this.show();
      $("prompt").focus();
    };
    const parts = [];
    if (list.images.length) parts.push(imageChipList(list.images, (k) => removed(list.images.splice(k, 1))));
    if (list.files.length) parts.push(chipList(list.files, (k) => removed(list.files.splice(k, 1))));
    this.chips.replaceChildren(...parts);
    this.chips.hidden = !parts.length;
    const text = [...this.refused, this.blocked()].filter(Boolean).join(" ");
    if (this.error.textContent !== text) this.error.textContent = text;
    this.error.hidden = !text;
  }

  /** Another conversation is on screen: its own files, no old message. */
  switchTo() {
    this.refused = [];
    this.show();
  }
}
