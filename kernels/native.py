"""Build and load the C++ kernels of kernels/cpu/ (once, cached), never failing an import.

The build goes through `torch.utils.cpp_extension.load` (g++ and ninja) into

    $WSLLM_CACHE_DIR/ext/<hash of the sources, torch's and Python's versions, the compiler's>/

(default ~/.cache/wsllm; $WSLLM_KERNELS_DIR replaces the ext/ directory). Flags: -O3 and no -march: the sources pick AVX-512 VNNI, AVX2 or
scalar code per function at run time (`__attribute__((target))` + `__builtin_cpu_supports`),
so one build runs on any x86-64 CPU. -ffp-contract=off keeps the float operations in the
order kernels/quant_ref.py writes them (no fused multiply-adds), so results equal the
reference's bits. A built module is loaded from the cache directly, without the compiler.

A failed build (no compiler, no ninja, a compile error) leaves `extension()` None and
`failure()` saying why; it is logged once. `python -m wsllm.kernels.native` builds now
(`make install` runs it, so the first `wsllm serve` does not compile).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "cpu"
# -fopenmp: at::parallel_for is OpenMP pragmas inlined from torch's headers; without the flag
# they compile to a serial loop (the kernels ran on one core whatever torch's thread count).
# The module then needs libgomp.so.1, which resolves to the copy torch has already loaded:
# one thread pool, torch's.
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict[str, object] = {}  # "module": ModuleType | None, "failure": str


def cache_root() -> Path:
    """$WSLLM_KERNELS_DIR (an image builds there, outside the cache volume), else the cache's ext/."""
    if os.environ.get("WSLLM_KERNELS_DIR"):
        return Path(os.environ["WSLLM_KERNELS_DIR"])
    return Path(os.environ.get("WSLLM_CACHE_DIR") or Path.home() / ".cache" / "wsllm") / "ext"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _build_key(cxx: str | None) -> str:
    h = hashlib.sha256()
    for path in sorted(SOURCES.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(f"{torch.__version__} {sys.version_info[:2]} {platform.machine()} {' '.join(CFLAGS)}".encode())
    if cxx is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            h.update(subprocess.run([cxx, "--version"], capture_output=True, timeout=30).stdout)
    return h.hexdigest()[:16]


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    so = build_dir / f"{name}.so"
    if not so.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _find_built() -> tuple[str, Path] | None:
    """A build of these sources and this torch made by any compiler (the compiler may be gone)."""
    root = cache_root()
    key = _build_key(None)
    if root.is_dir():
        for d in sorted(root.iterdir()):
            marker = d / "sources.key"
            if marker.is_file() and marker.read_text().strip() == key:
                return f"wsllm_qkernels_{d.name}", d
    return None


def _build() -> ModuleType:
    found = _find_built()
    if found is not None:
        try:
            module = _import_built(*found)
        except Exception as e:  # a broken or foreign build: make a new one
            logger.info("cannot load the cached kernels in %s (%s); building again", found[1], e)
            module = None
        if module is not None:
            return module
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(
            f"no C++ compiler: {os.environ.get('CXX', 'c++')!r} (g++) is not on PATH; install g++ and ninja-build"
        )
    if shutil.which("ninja") is None:
        raise RuntimeError("ninja is not on PATH (torch builds C++ extensions with it); install ninja-build")
    key = _build_key(cxx)
    build_dir = cache_root() / key
    build_dir.mkdir(parents=True, exist_ok=True)
    name = f"wsllm_qkernels_{key}"
    from torch.utils import cpp_extension

    logger.info("building the quantized CPU kernels into %s (once, about a minute)", build_dir)
    module = cpp_extension.load(
        name=name,
        sources=[str(p) for p in sorted(SOURCES.glob("*.cpp"))],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        build_directory=str(build_dir),
        verbose=False,
    )
    (build_dir / "sources.key").write_text(_build_key(None) + "\n")
    return module


def extension() -> ModuleType | None:
    """The loaded kernels, or None when they cannot be built here (see failure())."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    with _lock:
        if "module" not in _state:
            try:
                _state["module"] = _build()
                if os.environ.get("WSLLM_DECODE_TEAM") == "0":  # A/B runs: the stack's loops as before
                    _state["module"].set_teams(False)
            except Exception as e:  # a failed build must never fail the caller
                text = str(e).strip() or type(e).__name__
                _state["failure"] = f"quantized CPU kernels unavailable: {text.splitlines()[-1]}"
                _state["module"] = None
                detail = f"\n{text[-3000:]}" if len(text.splitlines()) > 1 else ""
                logger.warning("%s; using the torch reference path%s", _state["failure"], detail)
    return _state["module"]  # type: ignore[return-value]


def failure() -> str | None:
    return _state.get("failure")  # type: ignore[return-value]


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = extension()
    if module is None:
        print(failure(), file=sys.stderr)
        return 1
    print(f"quantized CPU kernels ready: {module.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
