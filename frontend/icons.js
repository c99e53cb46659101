// Line icons drawn as SVG paths (24x24, stroked with currentColor). Built with
// createElementNS: no markup strings, and nothing for the CSP to object to.

const PATHS = {
  plus: "M12 5v14M5 12h14",
  menu: "M4 6h16M4 12h16M4 18h16",
  close: "M6 6l12 12M18 6L6 18",
  settings: "M4 7h9M17 7h3M4 17h3M11 17h9M13 7a2 2 0 1 0 4 0a2 2 0 1 0-4 0M7 17a2 2 0 1 0 4 0a2 2 0 1 0-4 0",
  send: "M12 19V5M5 12l7-7 7 7",
  stop: "M7 7h10v10H7z",
  copy: "M9 9h10v10H9zM5 15V5h10",
  check: "M5 12l5 5 9-10",
  edit: "M4 20h4L19 9l-4-4L4 16v4zM13.5 6.5l4 4",
  regenerate: "M20 12a8 8 0 1 1-2.34-5.66M20 4v5h-5",
  trash: "M4 7h16M9 7V4h6v3M6 7l1 13h10l1-13",
  sun: "M12 8a4 4 0 1 0 0 8a4 4 0 1 0 0-8M12 2v2M12 20v2M4.9 4.9l1.4 1.4M17.7 17.7l1.4 1.4M2 12h2M20 12h2M4.9 19.1l1.4-1.4M17.7 6.3l1.4-1.4",
  moon: "M20 14.5A8 8 0 1 1 9.5 4a6.5 6.5 0 0 0 10.5 10.5z",
  auto: "M12 3a9 9 0 1 0 0 18a9 9 0 1 0 0-18zM12 3v18M12 7h5M12 11h8M12 15h7",
  retry: "M4 12a8 8 0 0 1 14-5.3M20 4v5h-5M20 12a8 8 0 0 1-14 5.3M4 20v-5h5",
  clip: "M20 11.5l-8.2 8.2a5 5 0 0 1-7-7l8.6-8.6a3.3 3.3 0 0 1 4.7 4.7l-8.6 8.6a1.6 1.6 0 0 1-2.3-2.3L15 7.3",
  file: "M6 3h8l4 4v14H6zM14 3v4h4M9 12h6M9 16h6",
};

const NS = "http://www.w3.org/2000/svg";

export function icon(name) {
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("aria-hidden", "true");
  svg.setAttribute("focusable", "false");
  svg.classList.add("icon");
  const path = document.createElementNS(NS, "path");
  path.setAttribute("d", PATHS[name] || "");
  svg.appendChild(path);
  return svg;
}

/** A button with an icon, an accessible name, and optionally visible text. */
export function iconButton(name, label, { text = "", cls = "icon-btn" } = {}) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = cls;
  b.setAttribute("aria-label", label);
  b.title = label;
  b.appendChild(icon(name));
  if (text) {
    const span = document.createElement("span");
    span.textContent = text;
    b.appendChild(span);
  }
  return b;
}

/** Swap the icon inside a button (theme toggle, copy -> check). */
export function setIcon(button, name) {
  const old = button.querySelector("svg.icon");
  const next = icon(name);
  if (old) old.replaceWith(next);
  else button.prepend(next);
}
