"""The two maps stay true to the tree: tests/README.md names every file under tests/,
docs/architecture.md names every module of wsllm/ and kernels/ in the row of its place,
and neither names a file that is gone. A file added, moved or removed without its line
fails here, so the maps cannot drift from the code they describe."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
TABLE = "## One sentence per place"
# the directories whose modules docs/architecture.md must name (kernels/ is wsllm.kernels)
SOURCES = ("wsllm", "kernels")

CODE = re.compile(r"`([^`]+)`")


def python_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts)


# -- tests/README.md --------------------------------------------------------------------


def test_the_readme_has_one_line_per_test_file_and_none_for_a_file_that_is_gone() -> None:
    readme = (TESTS / "README.md").read_text()
    # a file's line is a list item that starts with its path: "- `unit/test_x.py`: ..."
    lines = re.findall(r"^- `([^`]+\.py)`:", readme, flags=re.MULTILINE)
    files = {str(p.relative_to(TESTS)) for p in python_files(TESTS)}
    missing = sorted(files - set(lines))
    assert not missing, "tests/README.md has no line for:\n" + "\n".join(missing)
    twice = sorted({n for n in lines if lines.count(n) > 1})
    assert not twice, f"tests/README.md has several lines for {twice}"
    gone = sorted(set(lines) - files)  # a line left behind by a move
    assert not gone, "tests/README.md has lines for files that do not exist:\n" + "\n".join(gone)


# -- docs/architecture.md ---------------------------------------------------------------


def place_rows(text: str) -> list[tuple[list[str], str]]:
    """The rows of the table under TABLE as (places, whole row): a row's places are the
    paths under SOURCES written in its first cell, a directory ending in '/'."""
    section = text.split(TABLE, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = line.split("|")
        if not line.startswith("|") or len(cells) < 3:
            continue
        places = [c for c in CODE.findall(cells[1]) if c.startswith(tuple(f"{s}/" for s in SOURCES))]
        if places:
            rows.append((places, line))
    return rows


def needs_a_name(path: Path) -> bool:
    """Every module does, but a package's `__init__.py` that holds only its docstring."""
    if path.name != "__init__.py":
        return True
    body = ast.parse(path.read_text()).body
    return not all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def unnamed(module: str, rows: list[tuple[list[str], str]]) -> str | None:
    """Why `module` (a path from the root) is not named, or None when it is: the row whose
    place holds it most closely must be its own, or name it from its place, `styles/x.py`
    in the row of `wsllm/server/chat/`."""
    best: tuple[str, str] | None = None
    for places, row in rows:
        for place in places:
            holds = module == place or (place.endswith("/") and module.startswith(place))
            if holds and (best is None or len(place) > len(best[0])):
                best = (place, row)
    if best is None:
        return f"{module}: no row's place holds it"
    place, row = best
    if module == place or f"`{module[len(place) :]}`" in row:
        return None
    return f"{module}: the row of `{place}` does not name `{module[len(place) :]}`"


def test_the_architecture_names_every_module_in_the_row_of_its_place() -> None:
    rows = place_rows(ARCHITECTURE.read_text())
    modules = [str(p.relative_to(ROOT)) for s in SOURCES for p in python_files(ROOT / s) if needs_a_name(p)]
    assert "wsllm/server/gateway.py" in modules and "kernels/paged_decode.py" in modules
    missing = [why for m in modules if (why := unnamed(m, rows))]
    assert not missing, "docs/architecture.md, '" + TABLE[3:] + "':\n" + "\n".join(missing)


def test_every_place_in_the_architecture_exists() -> None:
    places = [p for ps, _ in place_rows(ARCHITECTURE.read_text()) for p in ps]
    assert "wsllm/server/" in places
    gone = [p for p in places if not (ROOT / p).exists()]
    assert not gone, f"docs/architecture.md names places that do not exist: {gone}"


def test_a_module_is_named_from_the_closest_place_only() -> None:
    rows = [
        (["wsllm/server/"], "| `wsllm/server/` | `app.py`, `chat/plan.py` |"),
        (["wsllm/server/chat/"], "| `wsllm/server/chat/` | `registry.py` |"),
        (["wsllm/types.py", "wsllm/wire.py"], "| `wsllm/types.py`, `wsllm/wire.py` | the wire |"),
    ]
    assert unnamed("wsllm/server/app.py", rows) is None
    assert unnamed("wsllm/server/chat/registry.py", rows) is None
    assert unnamed("wsllm/wire.py", rows) is None
    # named only in a wider place's row: the row of its own place must say it
    assert unnamed("wsllm/server/chat/plan.py", rows) is not None
    assert unnamed("wsllm/server/sse.py", rows) is not None
    assert unnamed("wsllm/engine/engine.py", rows) is not None
