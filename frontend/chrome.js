// The page's chrome: the theme, the connection line, the narrow screen's drawer.

import { icon, setIcon } from "./icons.js";
import { ConnState } from "./ws.js";

const $ = (id) => document.getElementById(id);
const THEMES = ["auto", "light", "dark"];
const THEME_LABEL = { auto: "automatic", light: "light", dark: "dark" };

/** Apply a theme ("auto", "light" or "dark") and say it on its toggle. */
export function applyTheme(theme) {
  if (theme === "auto") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  const b = $("theme-toggle");
  setIcon(b, theme === "auto" ? "auto" : theme === "light" ? "sun" : "moon");
  const label = `Theme: ${THEME_LABEL[theme]} (click to change)`;
  b.setAttribute("aria-label", label);
  b.title = label;
}

/** The theme after `theme`, in the toggle's order. */
export function nextTheme(theme) {
  return THEMES[(THEMES.indexOf(theme) + 1) % THEMES.length];
}

/** The connection line: the socket's state, the retry countdown, "API key needed". */
export class ConnStatus {
  constructor(ws) {
    this.ws = ws;
    this.needsKey = false; // GET /v1/models said 401
    this.countdown = 0;
    $("reconnect").appendChild(icon("retry"));
    $("reconnect").addEventListener("click", () => ws.retryNow());
  }

  /** The socket's state changed: draw it, and count down to the retry while disconnected. */
  changed() {
    this.render();
    clearInterval(this.countdown);
    if (this.ws.state === ConnState.DISCONNECTED) this.countdown = setInterval(() => this.render(), 1000);
  }

  render() {
    const el = $("conn-status");
    const { state, retryAt } = this.ws;
    el.dataset.state = state;
    let text = "Disconnected";
    let detail = ""; // changes every second: kept out of the live region's announcements
    if (state === ConnState.CONNECTED) text = "Connected";
    else if (state === ConnState.CONNECTING) text = "Connecting…";
    else if (this.needsKey) text = "Disconnected · API key needed";
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
}

/** The conversation list as a drawer on a narrow screen: its buttons and its scrim. */
export class Drawer {
  constructor() {
    $("open-sidebar").appendChild(icon("menu"));
    $("open-sidebar").addEventListener("click", () => this.open());
    $("close-sidebar").appendChild(icon("close"));
    $("close-sidebar").addEventListener("click", () => {
      this.close();
      $("open-sidebar").focus();
    });
    $("scrim").addEventListener("click", () => this.close());
  }

  get isOpen() {
    return document.body.classList.contains("sidebar-open");
  }

  open() {
    document.body.classList.add("sidebar-open");
    $("scrim").hidden = false;
    $("open-sidebar").setAttribute("aria-expanded", "true");
    ($("conv-list").querySelector("[aria-current]") || $("new-chat")).focus();
  }

  close() {
    if (!this.isOpen) return;
    document.body.classList.remove("sidebar-open");
    $("scrim").hidden = true;
    $("open-sidebar").setAttribute("aria-expanded", "false");
  }
}
