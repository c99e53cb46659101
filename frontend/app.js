// Entry point: builds the socket, the stored conversations and the views, and wires them
// together (the chrome, the composer and the model list are modules of their own).

import { AttachControl } from "./attach-control.js";
import { Chat, describeError } from "./chat.js";
import { applyTheme, ConnStatus, Drawer, nextTheme } from "./chrome.js";
import { Composer } from "./composer.js";
import { ContextMeter, contextUse } from "./context-meter.js";
import { DataDialog } from "./data-dialog.js";
import { icon } from "./icons.js";
import { MessageView } from "./messages.js";
import { ModelList } from "./model-list.js";
import { ModelPicker } from "./models.js";
import { OutputFormatControl } from "./output-format.js";
import { Refusal } from "./refusal.js";
import { searchConversations } from "./search.js";
import { SettingsPanel } from "./settings.js";
import { Sidebar } from "./sidebar.js";
import { Store } from "./store.js";
import { toast } from "./toast.js";
import { ToolsControl } from "./tools-dialog.js";
import { ConnState, defaultWsUrl, WsClient } from "./ws.js";

const $ = (id) => document.getElementById(id);

/** The page: its parts, the conversation on show, and how they answer each other. */
class App {
  constructor() {
    const store = (this.store = new Store());
    store.onError = () => toast("Could not save to this browser's storage (full or disabled).", "error");
    store.onImagesLeftOut = (conv) =>
      toast(`This browser's storage is full: “${conv.title}” is saved with small previews of its images only. They are sent while this page stays open; after a reload the model no longer sees them.`, "error");
    this.apiKey = store.loadSettings().api_key;
    const ws = (this.ws = new WsClient(defaultWsUrl(this.apiKey)));
    this.conn = new ConnStatus(ws);
    this.drawer = new Drawer();
    this.activeId = null;
    const active = () => this.activeId;
    const settings = (this.settings = new SettingsPanel($("settings-dialog"), store, (s) => this.settingsChanged(s)));
    const chat = (this.chat = new Chat(store, ws, (conv) =>
      conv ? { ...settings.get(), model: this.modelOf(conv) } : settings.get(),
    ));
    this.picker = new ModelPicker($("model-picker"), $("model-notice"), (id) => {
      chat.setModel(this.activeId, id);
      settings.set({ model: id }); // the one picked last: new chats start with it
      this.renderMeter();
      this.attach.show(); // whether the new model sees the waiting images
    });
    this.meter = new ContextMeter($("ctx"));
    this.data = new DataDialog($("data-dialog"), chat, store, {
      current: () => chat.get(this.activeId),
      imported: () => this.renderList(),
    });
    this.view = new MessageView($("messages"), {
      regenerate: (msg) => chat.regenerate(this.activeId, msg.id),
      edit: (msg, text) => chat.editAndResend(this.activeId, msg.id, text),
      deleteMessage: (msg) => {
        if (chat.deleteMessage(this.activeId, msg.id)) this.composer.focus();
        else toast("Stop the answer before deleting it or its question.", "error");
      },
      replyTools: (msg, results) => {
        if (chat.replyToTools(this.activeId, msg.id, results)) this.composer.focus(); // the boxes are gone
      },
      connected: () => ws.state === ConnState.CONNECTED,
    });
    const refusal = new Refusal(); // "Not sent: …" when the format or the tools need fixing
    this.format = new OutputFormatControl(chat, active, refusal); // the answer format, per conversation
    this.tools = new ToolsControl(chat, active, refusal); // the tools editor, per conversation
    this.attach = new AttachControl(() => settings.get().attach_kb, active, {
      hello: () => ws.hello, // its limits
      conv: () => chat.get(this.activeId),
      model: () => {
        const id = this.modelOf(chat.get(this.activeId));
        return { name: id || this.picker.serverDefault, sees: this.picker.seesImages(id) };
      },
    }); // files and images to send
    this.sidebar = new Sidebar($("conv-list"), {
      select: (id) => {
        this.select(id);
        this.drawer.close();
        this.composer.focus();
      },
      rename: (id, title) => chat.rename(id, title),
      remove: (id) => {
        chat.remove(id);
        if (id === this.activeId) this.select(chat.list()[0]?.id ?? chat.create().id);
      },
      generating: (id) => chat.generating(id),
      rerender: () => this.renderList(),
    });
    this.composer = new Composer(chat, this.attach, active);
    this.models = new ModelList(
      () => this.apiKey,
      () => this.showModels(),
      (err, quiet, refused) => this.modelsFailed(err, quiet, refused),
    );
  }

  /** A conversation's model: its own, or (stored before it had one) the one picked last. */
  modelOf(conv) {
    return typeof conv?.model === "string" ? conv.model : this.settings.get().model;
  }

  settingsChanged(s) {
    applyTheme(s.theme);
    this.showSummary();
    if (s.api_key !== this.apiKey) {
      this.apiKey = s.api_key;
      this.ws.url = defaultWsUrl(this.apiKey);
      this.ws.reconnect();
      this.models.reset();
      this.models.load();
    }
  }

  // ---- drawing ------------------------------------------------------------------

  renderList() {
    const { chat, sidebar } = this;
    const query = $("conv-search").value;
    const status = $("search-status");
    if (!query.trim()) {
      sidebar.render(chat.list(), this.activeId);
      status.textContent = "";
      return;
    }
    const found = searchConversations(chat.list(), query);
    sidebar.render(found.map((f) => f.conv), this.activeId, new Map(found.map((f) => [f.conv.id, f.snippet])));
    const n = found.length;
    const matches = n === 1 ? "1 conversation matches" : `${n} conversations match`;
    status.textContent = n ? matches : `No conversation matches “${query.trim()}”`;
    if (!n) {
      const li = document.createElement("li");
      li.className = "conv-empty";
      li.textContent = "No conversation matches.";
      $("conv-list").appendChild(li);
    }
  }

  /** The context meter: the last answer's usage against the conversation's model. */
  renderMeter() {
    const conv = this.chat.get(this.activeId);
    const model = this.modelOf(conv);
    const hello = this.ws.hello?.limits?.max_context;
    const limit = this.picker.contextOf(model) ?? (!model || model === this.ws.hello?.model ? hello : null);
    this.meter.show(contextUse(conv), limit ?? null);
  }

  /** A conversation whose model is no longer served falls back to the server's default. */
  checkModel(conv) {
    const picker = this.picker;
    if (!conv || !picker.isGone(conv.model)) return;
    const gone = conv.model;
    this.chat.setModel(conv.id, "");
    picker.show("");
    const dflt = picker.serverDefault ? ` (${picker.serverDefault})` : "";
    picker.say(`The model “${gone}” that this chat used is no longer served. It now uses the server's default${dflt}.`);
  }

  renderChrome() {
    const conv = this.chat.get(this.activeId);
    $("conv-title").textContent = conv?.title || "New chat";
    document.title = conv && conv.messages.length ? `${conv.title} · wsllm` : "wsllm chat";
    const busy = this.chat.generating(this.activeId);
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("empty").hidden = !!conv && conv.messages.length > 0;
  }

  select(id) {
    const conv = this.chat.get(id);
    if (!conv) return;
    this.activeId = id;
    this.store.activeId = id;
    $("system-prompt").value = conv.system;
    $("system-box").open = !!conv.system;
    this.view.show(conv);
    this.format.show(conv);
    this.tools.show();
    this.attach.switchTo();
    this.picker.say("");
    this.picker.show(this.modelOf(conv));
    this.checkModel(conv);
    this.renderMeter();
    this.renderList();
    this.renderChrome();
  }

  showSummary() {
    const s = this.settings.get(); // the model is on show in the picker
    const parts = [`temp ${s.temperature}`, `max ${s.max_tokens}`];
    if (s.seed !== null) parts.push(`seed ${s.seed}`);
    if (s.stop.length) parts.push(`${s.stop.length} stop`);
    $("settings-summary").textContent = parts.filter(Boolean).join(" · ");
  }

  showModels() {
    const { models } = this.models;
    this.conn.needsKey = false;
    this.settings.setModels(models, this.ws.hello?.model); // the hello names the default
    this.picker.setModels(models, this.ws.hello?.model);
    this.checkModel(this.chat.get(this.activeId));
    this.renderMeter();
    this.attach.show(); // whether the model sees the waiting images, now that the list says
  }

  modelsFailed(err, quiet, refused) {
    const kept = [this.settings.get().model].filter(Boolean).map((id) => ({ id, contextLength: null, parent: null }));
    this.settings.setModels(kept, this.ws.hello?.model);
    if (refused) {
      this.conn.needsKey = true;
      this.conn.render();
      toast(`Could not connect: ${err.message}.`, "error");
      this.settings.open("set-api-key");
    } else if (!quiet) {
      toast(`Could not load the model list: ${err.message}`, "error");
    }
  }

  newChat() {
    const current = this.chat.get(this.activeId);
    // Reuse an untouched empty chat instead of piling up blank ones.
    const empty = current && current.messages.length === 0 && !current.system && !current.tools;
    this.select((empty ? current : this.chat.create()).id);
    this.drawer.close();
    this.composer.focus();
  }

  // ---- events -------------------------------------------------------------------

  listenToChat() {
    const chat = this.chat;
    chat.addEventListener("list", () => {
      this.renderList();
      this.renderChrome();
    });
    chat.addEventListener("conversation", (ev) => {
      if (ev.detail.id === this.activeId) {
        this.view.sync();
        this.renderMeter();
      }
      this.renderChrome();
    });
    chat.addEventListener("message", (ev) => {
      if (ev.detail.convId !== this.activeId) return;
      this.view.update(ev.detail.msgId);
      this.renderMeter();
    });
    chat.addEventListener("failed", (ev) => {
      if (ev.detail.code !== "model_not_found") return;
      this.models.reset(); // the list changed: ask again, and fall back if the model is gone
      this.models.load(true);
    });
  }

  listenToSocket() {
    const ws = this.ws;
    ws.addEventListener("state", () => {
      this.conn.changed();
      this.view.refresh();
    });
    ws.addEventListener("hello", () => {
      this.settings.setServer(ws.hello); // the ranges of the sampling settings, the server's limits
      this.showSummary();
      this.models.load();
    });
    ws.addEventListener("message-error", (ev) => {
      const e = ev.detail;
      toast(describeError(e.code, e.message, e.param), "error");
    });
    window.addEventListener("online", () => ws.retryNow());
    window.addEventListener("pagehide", () => this.store.flush());
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) ws.retryNow();
    });
    window.addEventListener("storage", (ev) => {
      // Another tab changed settings: follow its theme.
      if (ev.key === "wsllm.v1.settings") applyTheme(this.store.loadSettings().theme);
    });
  }

  wireControls() {
    const { chat, settings } = this;
    document.addEventListener("keydown", (ev) => {
      if (ev.defaultPrevented) return;
      if (ev.key === "Escape" && !document.querySelector("dialog[open]")) {
        if (chat.stop(this.activeId)) ev.preventDefault();
        else if (this.drawer.isOpen) this.drawer.close();
      } else if (ev.key.toLowerCase() === "n" && ev.altKey && !ev.ctrlKey && !ev.metaKey) {
        ev.preventDefault();
        this.newChat();
      }
    });
    $("new-chat").prepend(icon("plus"));
    $("new-chat").addEventListener("click", () => this.newChat());
    $("system-prompt").addEventListener("input", (ev) => chat.setSystem(this.activeId, ev.target.value));
    const search = $("conv-search");
    search.addEventListener("input", () => this.renderList());
    search.addEventListener("keydown", (ev) => {
      if (ev.key === "Escape" && search.value) {
        ev.preventDefault(); // clears the search; does not stop an answer
        search.value = "";
        this.renderList();
      }
    });
    $("open-data").addEventListener("click", () => this.data.open());
    $("data-close").appendChild(icon("close"));
    $("open-settings").appendChild(icon("settings"));
    $("open-settings").addEventListener("click", () => settings.open());
    $("settings-close").appendChild(icon("close"));
    $("theme-toggle").addEventListener("click", () => settings.set({ theme: nextTheme(settings.get().theme) }));
  }

  start() {
    this.listenToChat();
    this.listenToSocket();
    this.wireControls();
    applyTheme(this.settings.get().theme);
    const { chat, store } = this;
    const first = chat.get(store.activeId) || chat.list()[0] || chat.create();
    this.select(first.id);
    this.conn.render();
    this.showSummary();
    chat.resumeStored();
    this.ws.start();
    this.models.load(true); // quiet: if the server is down, the hello after reconnect retries
    this.composer.focus();
    // Handles for tests and debugging in the console.
    const { ws, settings, view, format, tools, attach, picker, meter, data } = this;
    window.wsllm = { chat, ws, store, settings, view, format, tools, attach, picker, meter, data };
  }
}

new App().start();
