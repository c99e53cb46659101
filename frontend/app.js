// Entry point: wires the socket, the stored conversations and the views together.

import { AttachControl } from "./attachments.js";
import { Chat, describeError } from "./chat.js";
import { ContextMeter, contextUse } from "./context-meter.js";
import { DataDialog } from "./data-dialog.js";
import { icon, setIcon } from "./icons.js";
import { MessageView } from "./messages.js";
import { AuthError, fetchModels, ModelPicker } from "./models.js";
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
const THEMES = ["auto", "light", "dark"];
const THEME_LABEL = { auto: "automatic", light: "light", dark: "dark" };

function main() {
  const store = new Store();
  store.onError = () => toast("Could not save to this browser's storage (full or disabled).", "error");
  let apiKey = store.loadSettings().api_key;
  let needsKey = false; // GET /v1/models said 401
  let models = null; // [{id, contextLength, parent}] from GET /v1/models, once loaded
  const ws = new WsClient(defaultWsUrl(apiKey));
  const settings = new SettingsPanel($("settings-dialog"), store, (s) => {
    applyTheme(s.theme);
    showSummary();
    if (s.api_key !== apiKey) {
      apiKey = s.api_key;
      ws.url = defaultWsUrl(apiKey);
      ws.reconnect();
      models = null;
      loadModels();
    }
  });
  // A conversation's model: its own, or (stored before it had one) the one picked last.
  const modelOf = (conv) => (typeof conv?.model === "string" ? conv.model : settings.get().model);
  const chat = new Chat(store, ws, (conv) => (conv ? { ...settings.get(), model: modelOf(conv) } : settings.get()));
  let activeId = null;
  const picker = new ModelPicker($("model-picker"), $("model-notice"), (id) => {
    chat.setModel(activeId, id);
    settings.set({ model: id }); // the one picked last: new chats start with it
    renderMeter();
  });
  const meter = new ContextMeter($("ctx"));
  const data = new DataDialog($("data-dialog"), chat, store, {
    current: () => chat.get(activeId),
    imported: () => renderList(),
  });

  const view = new MessageView($("messages"), {
    regenerate: (msg) => chat.regenerate(activeId, msg.id),
    edit: (msg, text) => chat.editAndResend(activeId, msg.id, text),
    deleteMessage: (msg) => {
      if (chat.deleteMessage(activeId, msg.id)) $("prompt").focus();
      else toast("Stop the answer before deleting it or its question.", "error");
    },
    replyTools: (msg, results) => {
      if (chat.replyToTools(activeId, msg.id, results)) $("prompt").focus(); // the boxes are gone
    },
    connected: () => ws.state === ConnState.CONNECTED,
  });
  const refusal = new Refusal(); // "Not sent: …" when the format or the tools need fixing
  const format = new OutputFormatControl(chat, () => activeId, refusal); // the answer format, per conversation
  const tools = new ToolsControl(chat, () => activeId, refusal); // the tools editor, per conversation
  const attach = new AttachControl(() => settings.get().attach_kb, () => activeId); // files to send
  const sidebar = new Sidebar($("conv-list"), {
    select: (id) => {
      select(id);
      closeSidebar();
      $("prompt").focus();
    },
    rename: (id, title) => chat.rename(id, title),
    remove: (id) => {
      chat.remove(id);
      if (id === activeId) select(chat.list()[0]?.id ?? chat.create().id);
    },
    generating: (id) => chat.generating(id),
    rerender: () => renderList(),
  });

  // ---- drawing ------------------------------------------------------------------

  function renderList() {
    const query = $("conv-search").value;
    const status = $("search-status");
    if (!query.trim()) {
      sidebar.render(chat.list(), activeId);
      status.textContent = "";
      return;
    }
    const found = searchConversations(chat.list(), query);
    sidebar.render(found.map((f) => f.conv), activeId, new Map(found.map((f) => [f.conv.id, f.snippet])));
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
  function renderMeter() {
    const conv = chat.get(activeId);
    const model = modelOf(conv);
    const hello = ws.hello?.limits?.max_context;
    const limit = picker.contextOf(model) ?? (!model || model === ws.hello?.model ? hello : null);
    meter.show(contextUse(conv), limit ?? null);
  }

  /** A conversation whose model is no longer served falls back to the server's default. */
  function checkModel(conv) {
    if (!conv || !picker.isGone(conv.model)) return;
    const gone = conv.model;
    chat.setModel(conv.id, "");
    picker.show("");
    const dflt = picker.serverDefault ? ` (${picker.serverDefault})` : "";
    picker.say(`The model “${gone}” that this chat used is no longer served. It now uses the server's default${dflt}.`);
  }

  function renderChrome() {
    const conv = chat.get(activeId);
    $("conv-title").textContent = conv?.title || "New chat";
    document.title = conv && conv.messages.length ? `${conv.title} · wsllm` : "wsllm chat";
    const busy = chat.generating(activeId);
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("empty").hidden = !!conv && conv.messages.length > 0;
  }

  function select(id) {
    const conv = chat.get(id);
    if (!conv) return;
    activeId = id;
    store.activeId = id;
    $("system-prompt").value = conv.system;
    $("system-box").open = !!conv.system;
    view.show(conv);
    format.show(conv);
    tools.show();
    attach.switchTo();
    picker.say("");
    picker.show(modelOf(conv));
    checkModel(conv);
    renderMeter();
    renderList();
    renderChrome();
  }

  function showSummary() {
    const s = settings.get(); // the model is on show in the picker
    const parts = [`temp ${s.temperature}`, `max ${s.max_tokens}`];
    if (s.seed !== null) parts.push(`seed ${s.seed}`);
    if (s.stop.length) parts.push(`${s.stop.length} stop`);
    $("settings-summary").textContent = parts.filter(Boolean).join(" · ");
  }

  function applyTheme(theme) {
    if (theme === "auto") delete document.documentElement.dataset.theme;
    else document.documentElement.dataset.theme = theme;
    const b = $("theme-toggle");
    setIcon(b, theme === "auto" ? "auto" : theme === "light" ? "sun" : "moon");
    const label = `Theme: ${THEME_LABEL[theme]} (click to change)`;
    b.setAttribute("aria-label", label);
    b.title = label;
  }

  function renderConn() {
    const el = $("conn-status");
    const { state, retryAt } = ws;
    el.dataset.state = state;
    let text = "Disconnected";
    let detail = ""; // changes every second: kept out of the live region's announcements
    if (state === ConnState.CONNECTED) text = "Connected";
    else if (state === ConnState.CONNECTING) text = "Connecting…";
    else if (needsKey) text = "Disconnected · API key needed";
    else if (retryAt) detail = ` · retry in ${Math.max(1, Math.ceil((retryAt - Date.now()) / 1000))}s`;
    else detail = " · reconnecting…";
    if (el.firstChild?.textContent !== text) el.replaceChildren(document.createTextNode(text));
    let span = el.querySelector(".conn-detail");
    if (detail && !span) {
      span = document.createElement("span");
      span.className = "conn-detail";
      span.setAttribute("aria-hidden", "true");
      el.appendChild(span);
    }
    if (span) span.textContent = detail;
    $("reconnect").hidden = state !== ConnState.DISCONNECTED;
  }

  // ---- chat events --------------------------------------------------------------

  chat.addEventListener("list", () => {
    renderList();
    renderChrome();
  });
  chat.addEventListener("conversation", (ev) => {
    if (ev.detail.id === activeId) {
      view.sync();
      renderMeter();
    }
    renderChrome();
  });
  chat.addEventListener("message", (ev) => {
    if (ev.detail.convId !== activeId) return;
    view.update(ev.detail.msgId);
    renderMeter();
  });
  chat.addEventListener("failed", (ev) => {
    if (ev.detail.code !== "model_not_found") return;
    models = null; // the list changed: ask again, and fall back if the model is gone
    loadModels(true);
  });

  // ---- socket events ------------------------------------------------------------

  let countdown = 0;
  ws.addEventListener("state", () => {
    renderConn();
    clearInterval(countdown);
    if (ws.state === ConnState.DISCONNECTED) countdown = setInterval(renderConn, 1000);
    view.refresh();
  });
  ws.addEventListener("hello", () => {
    settings.setServer(ws.hello); // the ranges of the sampling settings, the server's limits
    showSummary();
    loadModels();
  });
  ws.addEventListener("message-error", (ev) => {
    const e = ev.detail;
    toast(describeError(e.code, e.message, e.param), "error");
  });

  function showModels() {
    settings.setModels(models, ws.hello?.model); // the hello names the default
    picker.setModels(models, ws.hello?.model);
    checkModel(chat.get(activeId));
    renderMeter();
  }

  let loading = null; // the GET /v1/models under way: the start and the hello share it
  function loadModels(quiet = false) {
    if (models) {
      showModels();
      return Promise.resolve();
    }
    loading ??= fetchAndShowModels(quiet).finally(() => (loading = null));
    return loading;
  }

  async function fetchAndShowModels(quiet) {
    try {
      models = await fetchModels(apiKey);
      needsKey = false;
      showModels();
    } catch (err) {
      const kept = [settings.get().model].filter(Boolean).map((id) => ({ id, contextLength: null, parent: null }));
      settings.setModels(kept, ws.hello?.model);
      if (err instanceof AuthError) {
        needsKey = true;
        renderConn();
        toast(`Could not connect: ${err.message}.`, "error");
        settings.open("set-api-key");
      } else if (!quiet) {
        toast(`Could not load the model list: ${err.message}`, "error");
      }
    }
  }

  // ---- controls -----------------------------------------------------------------

  const prompt = $("prompt");
  function autosize() {
    prompt.style.height = "auto";
    prompt.style.height = `${Math.min(prompt.scrollHeight, Math.round(window.innerHeight * 0.4))}px`;
  }

  function send() {
    const text = prompt.value;
    const files = attach.get();
    if (!(text.trim() || files.length) || chat.generating(activeId)) return;
    if (chat.send(activeId, text, files)) {
      prompt.value = "";
      attach.clear();
      autosize();
    }
  }

  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    send();
  });
  prompt.addEventListener("input", autosize);
  prompt.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing && !ev.altKey && !ev.ctrlKey && !ev.metaKey) {
      ev.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => {
    chat.stop(activeId);
    prompt.focus();
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.defaultPrevented) return;
    if (ev.key === "Escape" && !document.querySelector("dialog[open]")) {
      if (chat.stop(activeId)) ev.preventDefault();
      else if (document.body.classList.contains("sidebar-open")) closeSidebar();
    } else if (ev.key.toLowerCase() === "n" && ev.altKey && !ev.ctrlKey && !ev.metaKey) {
      ev.preventDefault();
      newChat();
    }
  });

  function newChat() {
    const current = chat.get(activeId);
    // Reuse an untouched empty chat instead of piling up blank ones.
    const conv = current && current.messages.length === 0 && !current.system && !current.tools ? current : chat.create();
    select(conv.id);
    closeSidebar();
    prompt.focus();
  }
  $("new-chat").prepend(icon("plus"));
  $("new-chat").addEventListener("click", newChat);

  $("system-prompt").addEventListener("input", (ev) => chat.setSystem(activeId, ev.target.value));

  const search = $("conv-search");
  search.addEventListener("input", renderList);
  search.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape" && search.value) {
      ev.preventDefault(); // clears the search; does not stop an answer
      search.value = "";
      renderList();
    }
  });
  $("open-data").addEventListener("click", () => data.open());
  $("data-close").appendChild(icon("close"));

  function openSidebar() {
    document.body.classList.add("sidebar-open");
    $("scrim").hidden = false;
    $("open-sidebar").setAttribute("aria-expanded", "true");
    ($("conv-list").querySelector("[aria-current]") || $("new-chat")).focus();
  }
  function closeSidebar() {
    if (!document.body.classList.contains("sidebar-open")) return;
    document.body.classList.remove("sidebar-open");
    $("scrim").hidden = true;
    $("open-sidebar").setAttribute("aria-expanded", "false");
  }
  $("open-sidebar").appendChild(icon("menu"));
  $("open-sidebar").addEventListener("click", openSidebar);
  $("close-sidebar").appendChild(icon("close"));
  $("close-sidebar").addEventListener("click", () => {
    closeSidebar();
    $("open-sidebar").focus();
  });
  $("scrim").addEventListener("click", closeSidebar);

  $("open-settings").appendChild(icon("settings"));
  $("open-settings").addEventListener("click", () => settings.open());
  $("settings-close").appendChild(icon("close"));
  $("theme-toggle").addEventListener("click", () => {
    const next = THEMES[(THEMES.indexOf(settings.get().theme) + 1) % THEMES.length];
    settings.set({ theme: next });
  });
  $("reconnect").appendChild(icon("retry"));
  $("reconnect").addEventListener("click", () => ws.retryNow());
  $("send").appendChild(icon("send"));
  $("stop").appendChild(icon("stop"));

  window.addEventListener("online", () => ws.retryNow());
  window.addEventListener("pagehide", () => store.flush());
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) ws.retryNow();
  });
  window.addEventListener("storage", (ev) => {
    // Another tab changed settings: follow its theme.
    if (ev.key === "wsllm.v1.settings") applyTheme(store.loadSettings().theme);
  });

  // ---- start --------------------------------------------------------------------

  applyTheme(settings.get().theme);
  const first = chat.get(store.activeId) || chat.list()[0] || chat.create();
  select(first.id);
  renderConn();
  showSummary();
  chat.resumeStored();
  ws.start();
  loadModels(true); // quiet: if the server is down, the hello after reconnect retries
  prompt.focus();
  // Handles for tests and debugging in the console.
  window.wsllm = { chat, ws, store, settings, view, format, tools, attach, picker, meter, data };
}

main();
