"""Load the Triton implementations on first use.

The reference modules (paged_attention, kv_store, norms, rotary, activation) answer
`<op>_triton` through a module `__getattr__` that imports the Triton module only
then. Two reasons: importing `wsllm.kernels` stays cheap and works where triton is
not installed, and `triton.jit` reads TRITON_INTERPRET when a kernel is defined, so
a test that sets it before its first kernel call gets the interpreter.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_MISSING: set[str] = set()


def triton_op(package: str, module: str, name: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    """Return `name` from `package.module` and cache it in the caller's namespace.

    Raises AttributeError (so `getattr(mod, name, None)` falls back to the
    reference) when triton itself is not installed; any other import error is a
    bug in the kernel module and propagates.
    """
    if name in _MISSING:
        raise AttributeError(f"{name} needs triton, which is not installed")
    try:
        mod = importlib.import_module(f"{package}.{module}")
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "triton":
            raise
        _MISSING.add(name)
        raise AttributeError(f"{name} needs triton, which is not installed") from e
    fn = getattr(mod, name)
    namespace[name] = fn
    return fn
