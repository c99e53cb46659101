"""Perplexity of the quantized path against the de-quantized fp32 path of the same GGUF.

The text is Python's own LICENSE.txt (it ships with every CPython, beside the standard
library: English prose and some legal lists), continued by the language reference's help
topics (pydoc_data) to 6,000 tokens, since LICENSE.txt alone is 3,822. It is tokenized with the model's tokenizer
and scored in sliding windows: each window of `--window` tokens starts `--stride` tokens
after the last, and only the tokens a window adds are scored, each with the window's
tokens before it as context (the first window scores all but its first token). The
engine computes every prompt token's logprob itself (`prompt_logprobs`), so both paths go
through the whole serving model: paged KV, the CPU attention, and for the quantized path
the kernels over the GGUF's blocks.

    python bench/perplexity.py                       # the bundled SmolLM2 GGUF, all of LICENSE.txt
    python bench/perplexity.py --model x.Q4_K_M.gguf --dtype float32
    python bench/perplexity.py --no-write-docs       # print only

Writes its section of docs/benchmarks.md (the command, the date, the CPU's flags).
"""

from __future__ import annotations

import argparse
import datetime
import math
import shlex
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_report  # noqa: E402  (a sibling script: the docs section helpers)
from wsllm.kernels import quant  # noqa: E402

from wsllm.config import EngineConfig  # noqa: E402
from wsllm.engine.engine import LLMEngine  # noqa: E402
from wsllm.types import GenerateRequest, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TITLE = "Perplexity: quantized blocks against de-quantized fp32"


def license_text() -> Path:
    """CPython's LICENSE.txt: in the standard library's directory (pyenv, python.org builds)
    or one level up (some distributions)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for p in (stdlib / "LICENSE.txt", stdlib.parent / "LICENSE.txt", Path(f"/usr/lib/python3.{sys.version_info[1]}/LICENSE.txt")):  # fmt: skip
        if p.exists():
            return p
    raise SystemExit(f"no LICENSE.txt beside {stdlib}")


def reference_text() -> str:
    """English prose that ships with every CPython: the language reference's topics as
    `help()` shows them (pydoc_data, in the standard library everywhere), in key order.
    LICENSE.txt alone is 3,822 tokens for SmolLM2; this continues it past the 4,000 the
    issue asks for."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored) per window over n tokens; every token from 1 on is scored once."""
    out, start, scored = [], 0, 1
    while scored < n:
        end = min(start + window, n)
        out.append((start, end, scored))
        scored = end
        start = max(0, end - window + stride) if end < n else end
        start = min(start, scored - 1)  # a window always carries context for its first scored token
    return out


def score(
    engine: LLMEngine, ids: list[int], window: int, stride: int, label: str
) -> tuple[float, int, float]:
    """(mean negative log-likelihood per scored token, tokens scored, seconds)."""
    nll, count, t = 0.0, 0, time.time()
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    for i, (start, end, first) in enumerate(tqdm(windows(len(ids), window, stride), desc=label)):
        engine.add_request(GenerateRequest(f"w{i}", ids[start:end], params))
        got = None
        while engine.has_unfinished():
            for o in engine.step():
                got = o.prompt_logprobs if o.prompt_logprobs is not None else got
        assert got is not None
        lps = [got[j - start][0] for j in range(first, end)]  # entry k: token k given tokens < k
        nll -= sum(lps)
        count += len(lps)
    return nll / count, count, time.time() - t


def engine_for(args: argparse.Namespace, quantization: str, dtype: str) -> LLMEngine:
    cfg = EngineConfig(
        model=args.model,
        quantization=quantization,
        dtype=dtype,
        enable_prefix_caching=False,
        max_num_batched_tokens=max(2048, args.window),
        kv_cache_gb=0.25,
    )
    return LLMEngine.from_config(cfg)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf (default: the bundled SmolLM2 Q4_1)")
    p.add_argument("--dtype", default="auto", help="the quantized path's activations (the engine's choice)")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=6000, help="score the text's first N tokens")
    p.add_argument("--no-write-docs", dest="write_docs", action="store_false")
    args = p.parse_args(argv)
    command = shlex.join(["python", "bench/perplexity.py", *(sys.argv[1:] if argv is None else argv)])
    text_path = license_text()
    quantized = engine_for(args, "auto", args.dtype)
    from transformers import AutoTokenizer

    text = text_path.read_text() + "\n\n" + reference_text()  # LICENSE.txt first, then the reference
    ids = AutoTokenizer.from_pretrained(quantized.model_dir).encode(text)[: args.max_tokens]
    q_nll, n, q_s = score(quantized, ids, args.window, args.stride, "quantized")
    q_dtype = str(next(quantized.runner.model.parameters()).dtype).removeprefix("torch.")
    del quantized
    d_nll, _, d_s = score(engine_for(args, "none", "float32"), ids, args.window, args.stride, "de-quantized")
    q_ppl, d_ppl = math.exp(q_nll), math.exp(d_nll)
    rows = [
        "| path | perplexity | seconds |",
        "| --- | ---: | ---: |",
        f"| quantized blocks ({quant.kernel_path()} kernels, {q_dtype} activations) | {q_ppl:.4f} | {q_s:.1f} |",
        f"| de-quantized fp32 | {d_ppl:.4f} | {d_s:.1f} |",
    ]
    text = "\n".join(
        [
            f"## {TITLE}\n",
            f"`bench/perplexity.py`: {n} tokens of English text that ships with CPython: its `LICENSE.txt` "
            f"({text_path}, 3,822 tokens) followed by the language reference's help topics (`pydoc_data`), "
            "sliding windows of "
            f"{args.window} tokens moved by {args.stride}, each token scored once with the window before it as "
            f"context; model {args.model or 'the bundled SmolLM2-135M-Instruct Q4_1 GGUF'}.\n",
            f"```\n{command}\n```\n",
            f"{datetime.date.today().isoformat()}, {serving_report.cpu_model()}.\n",
            "\n".join(rows) + "\n",
            f"Quantized / de-quantized perplexity: **{q_ppl / d_ppl:.4f}** ({(q_ppl / d_ppl - 1) * 100:+.2f}%).\n",
            f"CPU (`grep -m1 flags /proc/cpuinfo`):\n\n```\n{serving_report.cpu_flags()}\n```",
        ]
    )
    print(text)
    if args.write_docs:
        path = ROOT / "docs" / "benchmarks.md"
        path.write_text(serving_report.replace_section(path.read_text(), TITLE, text))
        print(f"wrote the '{TITLE}' section of {path.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
