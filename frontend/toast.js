// Toasts: short notes in the corner for what belongs to no message (errors that name no
// request, storage that refused a write, a model list that could not load).

import { icon } from "./icons.js";

const TOAST_MS = 6000;

/** Show `text` for a few seconds; `kind` "error" makes it an alert. */
export function toast(text, kind = "info") {
  const box = document.createElement("div");
  box.className = `toast ${kind}`;
  box.setAttribute("role", kind === "error" ? "alert" : "status");
  const span = document.createElement("span");
  span.textContent = text;
  const close = document.createElement("button");
  close.type = "button";
  close.className = "icon-btn small";
  close.setAttribute("aria-label", "Dismiss");
  close.appendChild(icon("close"));
  close.addEventListener("click", () => box.remove());
  box.append(span, close);
  document.getElementById("toasts").appendChild(box);
  setTimeout(() => box.remove(), TOAST_MS);
}
