"""Imports flow one way: server -> broker -> types <- engine <- models <- kernels, and
no module of wsllm (kernels included, as wsllm.kernels) imports itself back through
another: the module-level import graph has no cycle, TYPE_CHECKING imports counted.
In the server, no API's wing imports another's and the WebSocket imports none; no
product file is over 400 lines; the distribution holds every package and its data."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = {
    "wsllm/server": ("torch", "wsllm.engine", "wsllm.models", "wsllm.kernels", "wsllm.llm", "triton"),
    "wsllm/broker": ("torch", "wsllm.engine", "wsllm.models", "wsllm.kernels", "wsllm.server", "triton"),
    "wsllm/bounds.py": ("torch", "wsllm."),
    # the types stand on their bounds alone
    "wsllm/types.py": (
        "torch",
        "wsllm.server",
        "wsllm.broker",
        "wsllm.engine",
        "wsllm.models",
        "wsllm.config",
    ),
    # the worker sees the broker only through the Protocol it declares (worker_contract.BrokerSide)
    "wsllm/engine": ("wsllm.server", "wsllm.broker", "asyncio"),
    "wsllm/models": ("wsllm.server", "wsllm.broker", "wsllm.engine"),
    "kernels": ("wsllm.server", "wsllm.broker", "wsllm.engine", "wsllm.models"),
}
# where the package's modules live: wsllm.kernels is the kernels/ directory (pyproject.toml)
PACKAGES = {"wsllm": ROOT / "wsllm", "wsllm.kernels": ROOT / "kernels"}


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_imports_flow_one_way() -> None:
    bad = []
    for place, banned in FORBIDDEN.items():
        target = ROOT / place
        files = [target] if target.is_file() else sorted(target.rglob("*.py"))
        assert files, place
        for f in files:
            rel = str(f.relative_to(ROOT))
            for name in imports(f):
                for b in banned:
                    if (
                        name == b
                        or name.startswith(b.rstrip(".") + ".")
                        or (b.endswith(".") and name.startswith(b))
                    ):
                        bad.append(f"{rel} imports {name}")
    assert not bad, "\n".join(bad)


# -- the import graph ---------------------------------------------------------------


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    out: dict[str, Path] = {}
    for package, directory in PACKAGES.items():
        for f in sorted(directory.rglob("*.py")):
            parts = list(f.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            out.setdefault(name, f)  # kernels/ wins over a stray wsllm/kernels/
    return out


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that run when the module is imported: those at module level and
    inside its if/try/with blocks (`if TYPE_CHECKING:` too) and class bodies, but
    not those inside functions (imported lazily, when called)."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        out.append(node)
        for field in ("body", "orelse", "finalbody"):
            out += _top_level(getattr(node, field, []) or [])
        for handler in getattr(node, "handlers", []) or []:
            out += _top_level(handler.body)
    return out


def module_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports at import time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _top_level(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle_through_three_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c"]]
    graph["c"] = {"d"}
    assert cycles(graph) == []


def test_the_import_graph_has_no_cycle() -> None:
    mods = modules()
    assert "wsllm.kernels.paged_attention" in mods and "wsllm.engine.worker" in mods
    graph = {name: module_imports(name, path, set(mods)) for name, path in mods.items()}
    assert "wsllm.types" in graph["wsllm.engine.worker"]  # the graph sees imports
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


# -- the server's wings and the sizes of files ----------------------------------------------

WINGS = ROOT / "wsllm" / "server" / "api"
MAX_LINES = 400  # a product file past it holds two ideas (STYLE.md)
# the step is the house's heart: speculation and the static step live in modules of their own
SMALLER = {"wsllm/server/gateway.py": 250, "wsllm/engine/engine.py": 350}


def every_import(path: Path, text: str | None = None) -> set[str]:
    """Every module the file at `path` (its `text`, when given) imports, anywhere in it
    (in functions too), relative ones resolved: a lazy import is an import."""
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def test_no_api_wing_imports_another() -> None:
    wings = sorted(p.name for p in WINGS.iterdir() if (p / "__init__.py").is_file())
    assert {"openai", "responses", "messages", "embeddings", "tokenize"} <= set(wings)
    bad = []
    for wing in wings:
        for f in sorted((WINGS / wing).rglob("*.py")):
            for name in every_import(f):
                other = name.removeprefix("wsllm.server.api.").split(".")[0]
                if name.startswith("wsllm.server.api.") and other != wing:
                    bad.append(f"{f.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_websocket_imports_no_route_module() -> None:
    """The WebSocket runs the wings' kinds (wing.WsKind, handed to it by the app), never
    their routes: no module of the transport imports a wing."""
    for f in (ROOT / "wsllm" / "server").glob("ws*.py"):
        wings = [n for n in every_import(f) if n == "wsllm.server.api" or n.startswith("wsllm.server.api.")]
        assert not wings, f"{f.name} imports {wings}"


def test_the_websocket_owns_only_the_socket() -> None:
    """ws.py runs every request as a wing's kind (its dispatch table, wing.WsKind): it imports
    no module of a request's own messages (the OpenAI wing's ws_kinds.py, once ws_chat.py) and
    the gateway has no path that starts a request for it (an admitted call starts its own:
    `Admission.start`)."""
    from wsllm.server.gateway import Gateway

    names = every_import(ROOT / "wsllm" / "server" / "ws.py")
    assert not [n for n in names if n.endswith(("ws_chat", "ws_kinds")) or n.startswith("wsllm.server.api")]
    assert not (ROOT / "wsllm" / "server" / "ws_chat.py").exists()
    assert not hasattr(Gateway, "start") and not hasattr(Gateway, "_submit")
    tree = ast.parse((ROOT / "wsllm" / "server" / "ws.py").read_text())
    called = {
        n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    assert "start" not in called and "resume" in called  # a kind's own resume, not the gateway's


def test_the_checks_above_see_an_import_they_forbid() -> None:
    text = "from wsllm.server.api.messages import render\ndef later():\n    from ..responses import run\n"
    names = every_import(WINGS / "openai" / "x.py", text)
    assert {"wsllm.server.api.messages.render", "wsllm.server.api.responses.run"} <= names


def test_no_product_python_file_is_too_long() -> None:
    long = []
    for directory in PACKAGES.values():
        for f in sorted(directory.rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            limit = SMALLER.get(rel, MAX_LINES)
            n = len(f.read_text().splitlines())
            if n > limit:
                long.append(f"{rel}: {n} lines (at most {limit})")
    assert not long, "\n".join(long)


def test_every_package_and_its_data_is_in_the_distribution() -> None:
    """pyproject.toml lists each package (a wheel has only those) and the data files its
    modules read (the broker's Lua scripts)."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    found = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert found == listed, f"not listed: {sorted(found - listed)}; gone: {sorted(listed - found)}"
    lua = sorted((ROOT / "wsllm" / "broker" / "lua").glob("*.lua"))
    globs = setup["package-data"]["wsllm.broker"]
    assert lua and all(any(p.relative_to(ROOT / "wsllm" / "broker").match(g) for g in globs) for p in lua)


_JS_OPENS = re.compile(
    r"^(\s*)(?:export\s+)?(?:async\s+)?(?:function\s*\*?\s*\w*\s*\(.*\)|(?!if\b|for\b|while\b|switch\b|catch\b)\w+\s*\(.*\))\s*\{$"
)


def js_function_lengths(text: str) -> dict[str, int]:
    """Lines of each function and method of a prettier-formatted ES module (its opening line
    to the closing brace at its indentation), by its first line."""
    lines = text.splitlines()
    found: dict[str, int] = {}
    for i, line in enumerate(lines):
        m = _JS_OPENS.match(line)
        if m is None:
            continue
        close = m.group(1) + "}"
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(close)), len(lines))
        found[line.strip()] = end - i + 1
    return found


def test_the_uis_entry_point_has_no_long_function() -> None:
    """frontend/app.js wires the page's parts; each concern is a function (or a module) of its
    own, none over 120 lines (its `main` was 382)."""
    lengths = js_function_lengths((ROOT / "frontend" / "app.js").read_text())
    assert lengths and max(lengths.values()) < 120, max(lengths.items(), key=lambda kv: kv[1])
    long = "function main() {\n" + "  x();\n" * 130 + "}\n"
    assert js_function_lengths(long)["function main() {"] == 132
