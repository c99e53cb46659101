"""Phone and desktop widths in light and dark themes: nothing overflows sideways, and
screenshots land in tests/artifacts/ for a human to look at (issue 7, acceptance 5)."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

WIDE = [
    ("user", "Show me wide things: " + "x" * 120),
    (
        "assistant",
        "# Wide things\n\nA long URL: https://example.com/" + "a/" * 60 + "\n\n"
        "```python\nprint('" + "wide " * 60 + "')\n```\n\n"
        "| name | value | notes |\n|---|---:|---|\n| alpha | 1 | " + "long cell " * 20 + "|\n\n"
        "- a list item with **bold** and `inline code`\n- " + "y" * 150 + "\n\n> a quote",
    ),
]

SIZES = """() => {
  const m = document.getElementById('messages');
  return {doc: document.documentElement.scrollWidth, inner: innerWidth,
          msgs: m.scrollWidth, msgsClient: m.clientWidth};
}"""


@pytest.mark.parametrize("size", [(390, 844), (1280, 800)], ids=["phone", "desktop"])
def test_layout_fits_phone_and_desktop_in_both_themes(ui, size: tuple[int, int]) -> None:
    ui.ARTIFACTS.mkdir(parents=True, exist_ok=True)
    title = "A conversation with a rather long title that must not push anything off screen"
    conv = ui.conversation("cwide", title, WIDE)
    for scheme in ("light", "dark"):
        page = ui.page(size, scheme, convs=[conv])
        expect(page.locator(".msg.assistant table")).to_be_visible()
        name = f"ui-{size[0]}x{size[1]}-{scheme}"
        page.screenshot(path=str(ui.ARTIFACTS / f"{name}.png"))
        sizes = page.evaluate(SIZES)
        assert sizes["doc"] <= sizes["inner"], sizes
        assert sizes["msgs"] <= sizes["msgsClient"], sizes
        for sel in ["#send", "#prompt", "#open-settings", "#theme-toggle", "#conn-status"]:
            box = page.locator(sel).bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= size[0], (sel, box)
        if size[0] < 700:  # the conversation list is a drawer
            expect(page.locator("#sidebar")).not_to_be_in_viewport()
            page.click("#open-sidebar")
            expect(page.locator("#sidebar")).to_be_in_viewport()
            page.wait_for_timeout(250)  # the drawer's slide-in
            page.screenshot(path=str(ui.ARTIFACTS / f"{name}-sidebar.png"))
            page.keyboard.press("Escape")
            expect(page.locator("#sidebar")).not_to_be_in_viewport()
        page.click("#open-settings")
        page.screenshot(path=str(ui.ARTIFACTS / f"{name}-settings.png"))
        assert page.evaluate("document.documentElement.scrollWidth <= innerWidth")
        ui.assert_no_errors(page)
        page.context.close()


def test_controls_are_labelled_and_reachable_by_keyboard(ui) -> None:
    page = ui.page(convs=[ui.conversation("ckbd", "Keyboard", WIDE)])
    unlabelled = page.evaluate("""() => [...document.querySelectorAll('button, textarea, input, select')]
      .filter((el) => el.offsetParent !== null)
      .filter((el) => !(el.getAttribute('aria-label') || el.labels?.length || el.textContent.trim()))
      .map((el) => el.outerHTML.slice(0, 80))""")
    assert unlabelled == []
    seen = set()
    for _ in range(40):  # Tab walks through every control
        page.keyboard.press("Tab")
        seen.add(page.evaluate("document.activeElement.id || document.activeElement.dataset.action || ''"))
    assert {"new-chat", "theme-toggle", "open-settings", "prompt", "copy", "regenerate"} <= seen, seen
