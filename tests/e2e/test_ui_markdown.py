"""The chat UI's markdown renderer (frontend/markdown.js) in Chromium: what it draws for each
construct it knows, pinned before the parser was rewritten to run in linear time, and its
line-length cap (issue 12, item 8).
"""

from __future__ import annotations

CAP = 10_000  # the renderer's default line-length cap (MAX_LINE_LENGTH, checked below)


def fill(unit: str, n: int) -> str:
    """`unit` repeated to exactly n characters."""
    return (unit * (n // len(unit) + 1))[:n]


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
