"""Imports flow one way: server -> broker -> types <- engine <- models <- kernels."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = {
    "wsllm/server": ("torch", "wsllm.engine", "wsllm.models", "wsllm.kernels", "wsllm.llm", "triton"),
    "wsllm/broker": ("torch", "wsllm.engine", "wsllm.models", "wsllm.kernels", "wsllm.server", "triton"),
    "wsllm/types.py": ("torch", "wsllm."),
    "wsllm/engine": ("wsllm.server", "wsllm.broker", "asyncio"),
    "wsllm/models": ("wsllm.server", "wsllm.broker", "wsllm.engine"),
    "kernels": ("wsllm.server", "wsllm.broker", "wsllm.engine", "wsllm.models"),
}
# The worker is the one engine module that talks to a broker, through the contract.
ALLOWED = {("wsllm/engine/worker.py", "wsllm.broker")}


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
                    ) and (rel, b) not in ALLOWED:
                        bad.append(f"{rel} imports {name}")
    assert not bad, "\n".join(bad)
