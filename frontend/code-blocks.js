// Syntax highlighting of the markdown renderer's code blocks, with the vendored highlight.js
// (frontend/vendor/highlight/, BSD-3-Clause).
//
// Safety: model text still never reaches the page as markup. highlight.js escapes the code it
// highlights (`&`, `<`, `>`, `"` and `'`) and wraps tokens in `<span class="hljs-...">`. That
// HTML is parsed in an inert <template> (nothing in it runs or loads), and copied into fresh
// nodes: only text and <span> elements with class names of plain word characters survive;
// anything else becomes its text. The copy must have exactly the code's text, or the block
// stays plain. So a block is the same text as before, with coloured spans around its tokens.
//
// Cost: each (language, code) pair is highlighted once and kept (most recently used first),
// so an answer re-rendered on every frame while it streams only clones the cached result.
// highlight.js is not linear on every input (20,000 `"` take C# about 0.4 s), so a block longer
// than MAX_BLOCK characters stays plain, and one render starts no new block after BUDGET_MS:
// the rest waits for the next render (highlightBlocks says so).

import hljs from "./vendor/highlight/highlight.min.js";

const MAX_BLOCK = 10000; // characters: longer blocks are not highlighted
const MAX_AUTO = 2000; // characters: a block without a language is auto-detected up to this
const BUDGET_MS = 25; // new highlighting per render
const MIN_AUTO_RELEVANCE = 5; // below this, an auto-detected language is a guess: stay plain
const CACHE_SIZE = 256;
const CLASS_WORD = /^[A-Za-z][\w-]*$/;
const MAX_NESTING = 64;

const cache = new Map(); // `${lang}\0${text}` -> {frag, language} or null (left plain)

/** Highlight the code blocks under `root` (an element or a fragment, before it is shown).
 * `live`: the answer is still streaming, so its last block may still grow: it stays plain.
 * Returns true when blocks were left for a later render (out of time). */
export function highlightBlocks(root, { live = false } = {}) {
  const blocks = root.querySelectorAll(".codeblock");
  const deadline = performance.now() + BUDGET_MS;
  let pending = false;
  const last = live ? blocks.length - 1 : -1;
  blocks.forEach((block, k) => {
    if (k === last) return;
    const code = block.querySelector("pre > code");
    if (!code || code.classList.contains("hljs")) return;
    const text = code.textContent;
    if (text.length > MAX_BLOCK || !text.trim()) return;
    const lang = code.dataset.lang || "";
    const key = `${lang}\u0000${text}`;
    let hit = cache.get(key);
    if (hit === undefined) {
      if (performance.now() > deadline) {
        pending = true;
        return;
      }
      hit = highlight(text, lang);
    }
    remember(key, hit);
    if (!hit) return;
    code.replaceChildren(hit.frag.cloneNode(true));
    code.classList.add("hljs", `language-${hit.language}`);
    const label = block.querySelector(".codelang");
    if (!lang && label) label.textContent = hit.language; // detected: say which
  });
  return pending;
}

function remember(key, value) {
  cache.delete(key);
  cache.set(key, value);
  if (cache.size > CACHE_SIZE) cache.delete(cache.keys().next().value);
}

/** {frag, language} for `text`, or null to leave it plain. */
function highlight(text, lang) {
  let result = null;
  try {
    if (lang) {
      const def = hljs.getLanguage(lang);
      if (!def) return null; // a language highlight.js does not know: plain
      result = hljs.highlight(text, { language: lang, ignoreIllegals: true });
    } else if (text.length <= MAX_AUTO) {
      result = hljs.highlightAuto(text);
      if (!result.language || result.relevance < MIN_AUTO_RELEVANCE) return null;
    }
  } catch {
    return null;
  }
  if (!result || !result.language) return null;
  const frag = safeNodes(result.value);
  // The copy holds exactly the code, or nothing is shown from it.
  if (frag.textContent !== text) return null;
  return { frag, language: String(result.language).replace(/[^\w+#.-]/g, "").slice(0, 32) || "code" };
}

/** highlight.js's HTML as fresh nodes: text, and <span> with word-like class names. */
function safeNodes(html) {
  const tpl = document.createElement("template");
  tpl.innerHTML = html; // an inert document: nothing in a template runs, loads or renders
  const out = document.createDocumentFragment();
  const stack = [[tpl.content, out, 0]];
  while (stack.length) {
    const [from, to, depth] = stack.pop();
    for (const node of from.childNodes) {
      if (node.nodeType === Node.TEXT_NODE) {
        to.appendChild(document.createTextNode(node.data));
      } else if (node.nodeType === Node.ELEMENT_NODE && node.tagName === "SPAN" && depth < MAX_NESTING) {
        const span = document.createElement("span");
        const classes = (node.getAttribute("class") || "").split(/\s+/).filter((c) => CLASS_WORD.test(c));
        if (classes.length) span.className = classes.join(" ");
        to.appendChild(span);
        stack.push([node, span, depth + 1]);
      } else {
        to.appendChild(document.createTextNode(node.textContent));
      }
    }
  }
  return out;
}

// ---- themes: the light or the dark highlight.js theme, as the page's theme is --------------

const THEMES = { light: "vendor/highlight/a11y-light.min.css", dark: "vendor/highlight/a11y-dark.min.css" };

function themeLinks() {
  const links = {};
  for (const [name, href] of Object.entries(THEMES)) {
    const link = document.createElement("link");
    link.rel = "stylesheet";
    link.href = href;
    link.dataset.hljsTheme = name;
    document.head.appendChild(link);
    links[name] = link;
  }
  const apply = () => {
    const forced = document.documentElement.dataset.theme; // set by theme-init.js / app.js
    for (const [name, link] of Object.entries(links)) {
      link.media = forced ? (forced === name ? "all" : "not all") : `(prefers-color-scheme: ${name})`;
    }
  };
  apply();
  new MutationObserver(apply).observe(document.documentElement, { attributes: true, attributeFilter: ["data-theme"] });
}

if (typeof document !== "undefined" && document.head) themeLinks();
