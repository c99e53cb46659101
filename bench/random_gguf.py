"""What the random-weight GGUF benchmarks share (bench/moe.py, bench/families.py): the file and the
one-server-at-a-time measurement of it.

A file is a list of tensor specs `(GGUF name, format, shape in row order)`, written once and
streamed tensor by tensor (`write_gguf`), so a model larger than the memory is written in the
memory of its largest tensor. Formats: Q4_0 (random nibbles, an fp16 scale putting the weights near
N(0, 0.02)), MXFP4 (GGML type 39: random E2M1 nibbles under one E8M0 exponent, near N(0, 0.02)
too), F32 (norms, routers, biases, sinks: whatever the caller's `fill` gives). The tokenizer is
the bundled SmolLM2's, padded with unused tokens to the shape's vocabulary (`add_tokenizer`), so
both servers read the prompts alike; a check that only loads a tiny file takes the 256 bytes and
ChatML's markers instead (`add_byte_tokenizer`: parsing SmolLM2's 49k tokens takes seconds).

Each server is started alone on the file, measured at each concurrency level under each sampling
setting of serving_report.SAMPLINGS with `wsllm bench` (chat prompts, `ignore_eos`) and stopped,
its process tree's peak resident memory sampled all the while (`measure`)."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_setup  # noqa: E402  (sibling scripts, not a package)
import procmem  # noqa: E402
import serving_peers  # noqa: E402
import serving_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: format -> (values, bytes) of one block; F32 is a "block" of one value
BLOCKS = {"Q4_0": (32, 18), "MXFP4": (32, 17), "F32": (1, 4)}
Spec = tuple[str, str, tuple[int, ...]]  # GGUF name, format, shape in row order
Fill = Callable[[np.random.Generator, str, tuple[int, ...]], np.ndarray]


def nbytes(qtype: str, shape: Sequence[int]) -> int:
    values, size = BLOCKS[qtype]
    return int(np.prod(shape)) // values * size


def random_q4_0(rng: np.random.Generator, n_values: int) -> np.ndarray:
    """Random Q4_0 blocks whose values lie near N(0, 0.02): w = d * (q - 8), q uniform in 0..15."""
    raw = rng.integers(0, 256, size=(n_values // 32, 18), dtype=np.uint8)
    raw[:, 0:2] = np.frombuffer(np.float16(0.02 / 4.6).tobytes(), np.uint8)
    return raw.reshape(-1)


# E8M0 exponent of the MXFP4 blocks: uniform E2M1 codes have an RMS of about 2.9 (values 0..6 and
# their negatives), so 2 ** (120 - 127) puts the weights at an RMS of about 0.023
_MXFP4_E8M0 = 120


def random_mxfp4(rng: np.random.Generator, n_values: int) -> np.ndarray:
    """Random MXFP4 blocks (ggml's layout: one E8M0 byte, then 16 bytes of E2M1 nibbles)."""
    raw = rng.integers(0, 256, size=(n_values // 32, 17), dtype=np.uint8)
    raw[:, 0] = _MXFP4_E8M0
    return raw.reshape(-1)


_RANDOM = {"Q4_0": random_q4_0, "MXFP4": random_mxfp4}


def add_tokenizer(w: Any, vocab: int, tokenizer_gguf: Path | None = None) -> None:
    """The bundled SmolLM2 tokenizer (or `tokenizer_gguf`'s), padded with unused tokens to `vocab`."""
    import gguf

    from wsllm.models.loader import default_gguf_path

    f = gguf.GGUFReader(str(tokenizer_gguf or default_gguf_path())).fields
    tokens = list(f["tokenizer.ggml.tokens"].contents())
    pad = vocab - len(tokens)
    if pad < 0:
        raise ValueError(f"a vocabulary of {vocab} is smaller than the tokenizer's {len(tokens)} tokens")
    w.add_tokenizer_model(f["tokenizer.ggml.model"].contents())
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"].contents())
    w.add_token_list(tokens + [f"[unused{i}]" for i in range(pad)])
    w.add_token_types(list(f["tokenizer.ggml.token_type"].contents()) + [gguf.TokenType.UNUSED] * pad)
    w.add_token_merges(f["tokenizer.ggml.merges"].contents())
    for key, add in (
        ("bos", "add_bos_token_id"),
        ("eos", "add_eos_token_id"),
        ("padding", "add_pad_token_id"),
    ):
        getattr(w, add)(int(f[f"tokenizer.ggml.{key}_token_id"].contents()))
    w.add_add_bos_token(False)
    w.add_chat_template(f["tokenizer.chat_template"].contents())


def _byte_units() -> list[str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte 0..255."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add_byte_tokenizer(w: Any, vocab: int) -> None:
    """A byte-level BPE of the 256 bytes, one merge and ChatML's markers, padded to `vocab`: it
    reads in milliseconds (for a check that loads a tiny file, not for a measurement)."""
    import gguf

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*specials, *_byte_units(), "Ġt"]
    pad = vocab - len(tokens)
    if pad < 0:
        raise ValueError(f"a vocabulary of {vocab} is smaller than the byte tokenizer's {len(tokens)} tokens")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens + [f"[unused{i}]" for i in range(pad)])
    types = [gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.NORMAL] * (len(tokens) - len(specials))
    w.add_token_types(types + [gguf.TokenType.UNUSED] * pad)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(_CHATML)


def write_gguf(
    path: Path,
    arch: str,
    title: str,
    metadata: Callable[[Any], None],
    specs: list[Spec],
    fill: Fill,
    seed: int = 0,
) -> Path:
    """A random-weight GGUF of `arch` at `path`, written once (an existing file is kept), tensor by
    tensor: `metadata(writer)` adds the keys, `fill(rng, name, shape)` gives each F32 tensor."""
    import gguf
    from tqdm import tqdm

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(title)
    metadata(w)
    for name, qtype, shape in specs:
        if qtype == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(qtype, shape))
        else:
            values, size = BLOCKS[qtype]
            byte_shape = (*shape[:-1], shape[-1] // values * size)
            w.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), nbytes(qtype, shape), gguf.GGMLQuantizationType[qtype]
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, qtype, shape in tqdm(specs, desc=f"writing {path.name}"):
        if qtype == "F32":
            w.write_tensor_data(np.ascontiguousarray(fill(rng, name, shape), dtype=np.float32))
        else:
            w.write_tensor_data(_RANDOM[qtype](rng, int(np.prod(shape))))
    w.close()
    tmp.rename(path)
    return path


# -- servers --------------------------------------------------------------------------------------


def server_argv(
    name: str,
    gguf_path: Path,
    port: int,
    args: argparse.Namespace,
    ctx: int | None = None,
    slots: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`wsllm serve` or llama-server on the file, holding `ctx` tokens of KV (default `args.ctx`)
    for `slots` requests at once (default the highest level)."""
    ctx, slots = ctx or args.ctx, slots or max(args.levels)
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "wsllm":
        return [str(Path(sys.executable).parent / "wsllm"), "serve", "--model", str(gguf_path), *host,
                "--no-frontend", "--num-kv-blocks", str(-(-ctx // 16)), "--max-num-seqs", str(slots),
                *extra, *shlex.split(args.wsllm_args)]  # fmt: skip
    binary = peers_setup.llama_server_path(args.peers_dir)
    if not binary.exists():
        raise SystemExit(f"llama-server is not built: {binary} is missing; run python bench/peers_setup.py")
    return [str(binary), "-m", str(gguf_path), *host, "-np", str(slots), "-c", str(ctx),
            "-t", str(args.threads), "--alias", gguf_path.stem, *extra, *shlex.split(args.llama_args)]  # fmt: skip


def server(name: str, argv: list[str]) -> serving_peers.Server:
    return serving_peers.Server(name, name, argv, "/ready" if name == "wsllm" else "/health", 1800)


def measure(
    name: str, gguf_path: Path, args: argparse.Namespace, work: Path, settings: Sequence[str] = ("greedy",)
) -> dict[str, Any]:
    """`name` alone on the file: `wsllm bench` at each of `args.levels` under each sampling setting
    (serving_report.SAMPLINGS; setting j at level i reads prompts-{j * levels + i}.jsonl in `work`,
    as serving_peers.write_prompts writes them), its ready time and its process tree's peak
    resident MB. `runs[setting][level]` is the run's JSON."""
    port = serving_peers.free_port()
    runs: dict[str, dict[int, Any]] = {s: {} for s in settings}
    with serving_peers.running(server(name, server_argv(name, gguf_path, port, args)), port,
                               work / f"{name}-{gguf_path.stem}.log") as (ready_s, pid):  # fmt: skip
        with procmem.PeakSampler(pid) as sampler:
            if getattr(args, "probe", False):
                serving_peers.probe(
                    port, work / "prompts-0.jsonl", work / f"{name}-{gguf_path.stem}-probe.json"
                )
            for j, setting in enumerate(settings):
                for i, level in enumerate(args.levels):
                    print(
                        f"  {name}: {setting}, concurrency {level}, {args.num_requests} requests",
                        file=sys.stderr,
                    )
                    prompts = work / f"prompts-{j * len(args.levels) + i}.jsonl"
                    out = work / f"{name}-{gguf_path.stem}-{setting}-c{level}.json"
                    runs[setting][level] = serving_peers.bench_level(port, level, prompts, args, out, setting)
        peak = max(sampler.peak_mb, procmem.tree_hwm_mb(pid))
    return {"name": name, "ready_s": ready_s, "runs": runs, "peak_mb": peak}


def ratios(
    rows: list[dict[str, Any]], levels: list[int], setting: str = "greedy"
) -> tuple[list[float], float] | None:
    """wsllm's tokens/s over llama-server's at each level under `setting`, and its peak resident
    memory over llama-server's; None unless both were measured."""
    by = {r["name"]: r for r in rows}
    if not {"wsllm", "llamacpp"} <= set(by):
        return None
    ws, lc = by["wsllm"], by["llamacpp"]
    tps = [
        serving_report.tokens_per_s(ws["runs"][setting][c])
        / serving_report.tokens_per_s(lc["runs"][setting][c])
        for c in levels
    ]
    return tps, ws["peak_mb"] / lc["peak_mb"]


def warm(gguf_path: Path) -> None:
    """wsllm's one-time config, tokenizer and repack of the file (cached), not counted as its start."""
    code = ("from wsllm.config import EngineConfig; from wsllm.models.build import build_model; "
            f"build_model(EngineConfig(model={str(gguf_path)!r}, num_kv_blocks=16))")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


def write_docs_section(title: str, text: str) -> None:
    """`text` as docs/benchmarks.md's section `title` (replaced where it is, else added)."""
    doc = ROOT / "docs" / "benchmarks.md"
    doc.write_text(serving_report.replace_section(doc.read_text(), title, text))
    print(f"wrote the '{title}' section of {doc.relative_to(ROOT)}", file=sys.stderr)
