"""The chat UI's markdown renderer (frontend/markdown.js) in Chromium: it keeps its behaviour,
its line-length cap turns long lines into plain text, and hostile 100,000-character inputs
render in under 100 ms each with the output still inert (issue 12, item 8 and acceptance 5).

The 100 ms bound is the issue's and the one timing this suite asserts. It is measured inside
the browser with performance.now() around renderMarkdown(), as the fastest of several runs, so
that other work on a shared machine is not taken for the renderer's cost: the old renderer
needed minutes for the heading case and seconds for the ")" case on every run.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

N = 100_000  # characters in each hostile input
BOUND_MS = 100.0
RUNS = 5  # renders of an input per round; the fastest run counts
ROUNDS = 4  # an input over the bound gets more rounds: a busy machine slows some runs, not all
HANG_MS = 20_000  # an input still rendering after this is reported as hung
CAP = 10_000  # the renderer's default line-length cap (MAX_LINE_LENGTH, checked below)

# What the renderer may build, and the attributes those elements may carry (docs/ui.md).
TAGS = "P BR H1 H2 H3 H4 H5 H6 STRONG EM DEL CODE PRE UL OL LI BLOCKQUOTE HR TABLE THEAD TBODY TR TH TD A DIV SPAN BUTTON"
ATTRS = "class href rel target referrerpolicy start type aria-label data-lang"

# Renders one input (after a timer, so that a renderer stuck for minutes is reported by the
# wait below instead of blocking this call), timed as the best of `runs`. Then it puts the
# output in the page and lists every element or attribute the renderer may not make.
START = """([src, cap, runs, tags, attrs]) => {
  window.__md = null;
  setTimeout(async () => {
    try {
      const { renderMarkdown } = await import('/markdown.js');
      const opts = cap === 'off' ? { maxLineLength: Infinity } : {};
      let best = Infinity, frag = null;
      for (let r = 0; r < runs; r++) {
        const t0 = performance.now();
        frag = renderMarkdown(src, opts);
        best = Math.min(best, performance.now() - t0);
      }
      const box = document.createElement('div');
      box.append(frag);
      document.body.append(box);
      const allowTag = new Set(tags.split(' ')), allowAttr = new Set(attrs.split(' '));
      const bad = [];
      for (const el of box.querySelectorAll('*')) {
        if (!allowTag.has(el.tagName)) bad.push(el.tagName);
        for (const a of el.attributes) if (!allowAttr.has(a.name)) bad.push(`${el.tagName}[${a.name}]`);
        if (el.tagName === 'A' && (!/^https?:$/.test(el.protocol) || el.rel !== 'noopener noreferrer nofollow'))
          bad.push(`A ${el.getAttribute('href')}`);
      }
      const elements = box.querySelectorAll('*').length;
      box.remove();
      window.__md = { ms: best, bad: bad.slice(0, 5), elements };
    } catch (e) {
      window.__md = { error: String(e && e.stack || e) };
    }
  }, 0);
}"""


def fill(unit: str, n: int = N) -> str:
    """`unit` repeated to exactly n characters."""
    return (unit * (n // len(unit) + 1))[:n]


def lines(make: Callable[[int], str], n: int = N) -> str:
    """Lines make(0), make(1), ... joined, cut to n characters."""
    out, size = [], 0
    while size < n:
        out.append(make(len(out)))
        size += len(out[-1]) + 1
    return "\n".join(out)[:n]


def descending_runs(ch: str) -> str:
    """Runs of `ch` of lengths k, k-1, ..., 1 apart: each opener looks for a longer closer."""
    k = int((2 * N) ** 0.5)
    return "".join(ch * j + "a" for j in range(k, 0, -1))[:N]


# Fences are left to their own cases (an unclosed one would turn the rest of a mixed input into
# code): no fragment starts with more than two backticks or tildes.
FRAGMENTS = [
    "*", "**", "_", "__", "~~c", "c~~", "`a", "a`", "``b", "b``", "[", "]", "(", ")", "](", "![", "<", ">", "\\", "|",
    "#", "- ", "1. ", "> ", "---", ":-:", " ", "  ", "\t", "\n", "\n\n", "a", "word", "snake_case",
    "http://", "https://x.com/", "http://[", "<http://a.b>", "[t](https://t.example/)", "é", "中",
    '<img src=x onerror="window.__pwned=1">', "<script>window.__pwned=2</script>",
    "[x](javascript:window.__pwned=3)", "![i](http://127.0.0.1:9/p.png)", "<svg onload=window.__pwned=4>",
]  # fmt: skip


def mixed(seed: int, newline_every: int | None) -> str:
    """Random fragments of every construct, with a line break every few fragments or none."""
    rng = random.Random(seed)
    out, size = [], 0
    while size < N:
        frag = rng.choice(FRAGMENTS)
        if newline_every is None:
            frag = frag.replace("\n", " ")
        elif rng.randrange(newline_every) == 0:
            frag += "\n" + rng.choice(["", "  ", "- ", "    1. ", "> > ", "# ", "|-|-|", "| a | b |", "***"])
        out.append(frag)
        size += len(frag)
    return "".join(out)[:N]


def hostile_inputs() -> dict[str, str]:
    """Every construct the parser knows, each in shapes that make a naive parser re-scan the text.

    They are hostile to the parser, not to the page: none builds more elements than a long answer
    has (up to about 15,000). Creating an element costs a busy browser a microsecond or so however
    it was parsed, so 100,000 characters of "*a*" alone would time the DOM, not the parser.
    """
    return {
        # Issue 12, item 8: the cubic heading regex and the quadratic-or-worse trimUrl.
        "heading with 5000 spaces, as lines": lines(lambda k: "# a" + " " * 5000 + "b"),
        "heading with 100k spaces": "# a" + " " * (N - 4) + "b",
        "heading, closing run and spaces": fill("## a" + " #" * (N // 2), N - 1) + "x",
        "trimUrl, many ')'": "http://x.com/" + ")" * (N - 13),
        "trimUrl, ')' and punctuation": "http://x.com/" + fill(").,", N - 13),
        "trimUrl, '(' then ')'": "http://x.com/" + "(" * (N // 2 - 13) + ")" * (N // 2),
        "bare URLs, many ')' each": fill("see http://x.com/a" + ")" * 40 + " "),
        # Emphasis runs.
        "emphasis: pairs": fill("*a* **b** ***c*** _d_ __e__ ~~f~~ and some plain words in between "),
        "emphasis: '**a*'": fill("**a* and plain text "),
        "emphasis: openers without closers": fill("*a **b __c ~~d _e "),
        "emphasis: nested, closed at the end": fill("*a _b **c __d ~~e ", N // 2)
        + fill("e~~ d__ c** b_ a*", N // 2),
        "emphasis: only asterisks": "*" * N,
        "emphasis: only underscores": "_" * N,
        "emphasis: '_a' runs": fill("_a"),
        "emphasis: snake_case": fill("snake_case_"),
        # Lists.
        "lists: nested, mixed markers": lines(
            lambda k: " " * (2 * (k % 12)) + ("1. " if k % 3 else "- ") + "an item with *some* words"
        ),
        "lists: continuations and blanks": lines(
            lambda k: ["- an item", "  continued", "", "  a second paragraph", "lazy continuation"][k % 5]
        ),
        "lists: deep indents": lines(lambda k: " " * (k % 300) + "- x"),
        "lists: markers only": fill("- \n1234567890. ten digits\n123456789) nine digits\n"),
        # Code.
        "code: unclosed fence": "```python\n" + fill("x = `1` **2**\n", N - 10),
        "code: fence info of spaces": "```" + " " * (N - 4) + "`",
        "code: many fences": fill("```js\nlet x = 1;\nlet y = 2;\n~~~~\nreturn x + y; // `sum`\n```\n"),
        "code: only backticks": "`" * N,
        "code: backtick runs, longest first": descending_runs("`"),
        "code: spans of mixed runs": fill("`a ``b ```c ``d `e and some text "),
        # Links and autolinks.
        "links: only '['": "[" * N,
        "links: '[' then ']'": "[" * (N // 2) + "]" * (N // 2),
        "links: '[a](' without ')'": fill("[a]("),
        "links: '](' runs": fill("]("),
        "links: images without ')'": fill("![i]("),
        "links: many good links": fill("[a](https://x.example/p) "),
        "links: escaped brackets": fill("\\[a\\](b) "),
        "autolinks: '<http://' without '>'": fill("<http://"),
        "autolinks: many": fill("<https://a.example/x> "),
        "bare URLs: broken hosts": fill("http://["),
        "bare URLs: control characters": fill("http://a\x01/"),
        "bare URLs: one long host": "http://" + "a" * (N - 7),
        "bare URLs: one long path": "https://x.com/" + fill("ä/", N - 14),
        # Tables.
        "tables: wide": fill("| head ", N // 3)
        + "\n"
        + fill("|---", N // 3)
        + "\n"
        + fill("| *b* c ", N - 2 * (N // 3) - 2),
        "tables: delimiter row then spaces": "a|b\n---" + " " * (N - 8) + "x",
        "tables: many rows": "a|b\n-|-\n" + fill("| a cell with some text | *y* and more |\n", N - 8),
        "tables: escaped pipes": "a|b\n-|-\n" + fill("a\\|", N - 8),
        # Blockquotes and rules.
        "quotes: one line of '> '": fill("> "),
        "quotes: nesting": lines(lambda k: "> " * (k % 12) + "x"),
        "quotes: lazy lines": lines(lambda k: ["> a quoted line", "lazy continuation"][k % 2], N - 1) + "c",
        "rules: '- ' then text": "-" + " -" * (N // 2 - 1) + "x",
        "rules: many": fill("---\nsome text between\n* * *\n"),
        # Escapes, long lines, everything mixed.
        "escapes": fill("\\*\\_\\`\\[\\\\"),
        "long line of everything": mixed(1, None),
        "mixed lines of everything": mixed(2, 8),
        "mixed, short lines": mixed(3, 3),
    }


def render(page: Any, src: str, cap: str) -> dict[str, Any]:
    page.evaluate(START, [src, cap, RUNS, TAGS, ATTRS])
    page.wait_for_function("() => window.__md !== null", timeout=HANG_MS, polling=50)
    result: dict[str, Any] = page.evaluate("window.__md")
    assert "error" not in result, result["error"]
    return result


def test_hostile_inputs_render_fast_and_inert(ui) -> None:
    page = ui.page(connected=False)
    inputs = hostile_inputs()
    assert all(len(src) == N for src in inputs.values()), [k for k, v in inputs.items() if len(v) != N]
    slow, unsafe = [], []
    for name, src in inputs.items():
        # Lines past the default cap are shown unparsed: render those inputs with no cap too.
        caps = ["default", "off"] if max(map(len, src.split("\n"))) > CAP else ["default"]
        for cap in caps:
            try:
                r = render(page, src, cap)
                for _ in range(ROUNDS - 1):
                    if r["ms"] < BOUND_MS:
                        break
                    r["ms"] = min(r["ms"], render(page, src, cap)["ms"])
            except PlaywrightTimeout:
                pytest.fail(f"{name!r} (cap {cap}) still rendering after {HANG_MS / 1000:.0f} s")
            if r["ms"] >= BOUND_MS:
                slow.append(f"{name} (cap {cap}): {r['ms']:.0f} ms, {r['elements']} elements")
            if r["bad"]:
                unsafe.append(f"{name} (cap {cap}): {r['bad']}")
    page.wait_for_timeout(200)  # time for any handler that slipped through to fire
    assert page.evaluate("window.__pwned") is None
    assert not unsafe, unsafe
    assert not slow, slow
    ui.assert_no_errors(page)


RENDER = """async ([src, opts]) => {
  const { renderMarkdown } = await import('/markdown.js');
  const box = document.createElement('div');
  box.append(renderMarkdown(src, opts || {}));
  return box.innerHTML;
}"""

A = 'rel="noopener noreferrer nofollow" target="_blank" referrerpolicy="no-referrer"'


def codeblock(lang: str | None, body: str) -> str:
    label = lang or "code"
    bar = (
        f'<div class="codebar"><span class="codelang">{label}</span>'
        f'<button class="copy-code" type="button" aria-label="Copy {label} block">Copy</button></div>'
    )
    data = f' data-lang="{lang}"' if lang else ""
    return f'<div class="codeblock">{bar}<pre><code{data}>{body}</code></pre></div>'


# Markdown as the renderer drew it before it was made linear, and must still draw it.
CONSTRUCTS = [
    (
        "# Title #\n## Sub ##   \n####### x\n#5 no\n  ### three ###",
        "<h1>Title</h1><h2>Sub</h2><p>####### x<br>#5 no</p><h3>three</h3>",
    ),
    ("```py  extra\nprint(1)\n````\nafter", codeblock("py", "print(1)") + "<p>after</p>"),
    ("~~~\nopen fence still streaming", codeblock(None, "open fence still streaming")),
    (
        "- a\n- b\n  - nested *em*\n    1. deep\n\n- after blank\n\n3. three\n4) four",
        "<ul><li>a</li><li><p>b</p><ul><li><p>nested <em>em</em></p><ol><li>deep</li></ol></li></ul></li>"
        '<li>after blank</li></ul><ol start="3"><li>three</li><li>four</li></ol>',
    ),
    (
        "- item\n  continued\nlazy line\n- next",
        "<ul><li>item<br>continued<br>lazy line</li><li>next</li></ul>",
    ),
    (
        "> quote **b**\n> > inner\nlazy",
        "<blockquote><p>quote <strong>b</strong></p><blockquote><p>inner<br>lazy</p></blockquote></blockquote>",
    ),
    (
        "| Left | Mid | Right |\n|:-----|:---:|------:|\n| a \\| b | `c` | [d](https://d.example/) |",
        '<div class="table-wrap"><table><thead><tr><th class="align-left">Left</th>'
        '<th class="align-center">Mid</th><th class="align-right">Right</th></tr></thead><tbody><tr>'
        '<td class="align-left">a | b</td><td class="align-center"><code>c</code></td>'
        f'<td class="align-right"><a href="https://d.example/" {A}>d</a></td></tr></tbody></table></div>',
    ),
    ("***\n- - -\n_ _ _", "<hr><hr><hr>"),
    (
        "See https://example.com/a_(b)), http://x.com/path. and <https://auto.example/x> or www.not.",
        f'<p>See <a href="https://example.com/a_(b)" {A}>https://example.com/a_(b)</a>), '
        f'<a href="http://x.com/path" {A}>http://x.com/path</a>. and '
        f'<a href="https://auto.example/x" {A}>https://auto.example/x</a> or www.not.</p>',
    ),
    (
        "Visit http://[bad and then http://ok.example/.",
        f'<p>Visit http://[bad and then <a href="http://ok.example/" {A}>http://ok.example/</a>.</p>',
    ),
    (
        "`code` and ``a`b`` and ` padded ` and `unclosed",
        "<p><code>code</code> and <code>a`b</code> and <code>padded</code> and `unclosed</p>",
    ),
    (
        "**strong** __strong__ *em* _em_ ~~del~~ ***both*** snake_case_name 2*3*4",
        "<p><strong>strong</strong> <strong>strong</strong> <em>em</em> <em>em</em> <del>del</del> "
        "<strong><em>both</em></strong> snake_case_name 2<em>3</em>4</p>",
    ),
    ("\\*not em\\* \\[not link\\] \\`not code\\`", "<p>*not em* [not link] `not code`</p>"),
    (
        '[link](https://e.com/x "title") ![img](http://i.example/p.png) [bad](javascript:alert(1)) [rel](/x)',
        f'<p><a href="https://e.com/x" {A}>link</a> <a href="http://i.example/p.png" {A}>image: img</a> '
        "bad) rel</p>",
    ),
    ("line one\nline two  \n\nnew paragraph", "<p>line one<br>line two</p><p>new paragraph</p>"),
]


def test_markdown_constructs_render_as_before(ui) -> None:
    page = ui.page(connected=False)
    got = [page.evaluate(RENDER, [src, None]) for src, _ in CONSTRUCTS]
    assert [(src, html) for (src, _), html in zip(CONSTRUCTS, got, strict=True)] == CONSTRUCTS


def test_lines_past_the_cap_are_plain_text(ui) -> None:
    page = ui.page(connected=False)
    cap = page.evaluate("async () => (await import('/markdown.js')).MAX_LINE_LENGTH")
    assert cap == CAP  # the default docs/ui.md names
    line = "# **bold** [x](https://x.example/) <img src=x onerror=window.__pwned=1> "
    long = fill(line, cap + 1)
    # At the cap a line is still markdown; past it, one paragraph of its text, unparsed.
    assert page.evaluate(RENDER, [fill(line, cap), None]).startswith("<h1><strong>bold</strong>")
    html = page.evaluate(RENDER, ["- item\n" + long + "\n- next", None])
    text = long.strip().replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    assert html == f"<ul><li>item</li></ul><p>{text}</p><ul><li>next</li></ul>"
    # The cap is a setting of the renderer: smaller, or off.
    assert page.evaluate(RENDER, ["> *a*\n> *bb*", {"maxLineLength": 5}]) == (
        "<blockquote><p><em>a</em></p></blockquote><p>&gt; *bb*</p>"
    )
    assert page.evaluate(RENDER, [long, {"maxLineLength": float("inf")}]).startswith(
        "<h1><strong>bold</strong>"
    )
    assert page.evaluate("window.__pwned") is None


def test_a_list_item_of_many_lines_renders(ui) -> None:
    # The old renderer moved a tight item's nodes out of its <p> as spread call arguments,
    # and 200,000 of them overflowed the stack: the whole answer failed to render.
    page = ui.page(connected=False)
    html = page.evaluate(RENDER, ["- a\n" + "  b\n" * 100_000 + "- c", None])
    assert html == "<ul><li>a" + "<br>b" * 100_000 + "</li><li>c</li></ul>"
    ui.assert_no_errors(page)
