"""PNG plots of a bench run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from wsllm.loadgen.report import METRICS, NAMES, level_name


def write(runs: list[dict[str, Any]], out_dir: str, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [_latency_cdf(runs, out / "latency_cdf.png", title)]
    levels = [r["concurrency"] for r in runs]
    if len(runs) > 1 and None not in levels:
        paths.append(_throughput(runs, out / "throughput_vs_concurrency.png", title))
    return paths


def _values(run: dict[str, Any], metric: str) -> list[float]:
    reqs = [q for q in run["requests"] if q["ok"]]
    if metric == "itl":
        return [g for q in reqs for g in q["itl_ms"]]
    return [q[f"{metric}_ms"] for q in reqs if q[f"{metric}_ms"] is not None]


def _latency_cdf(runs: list[dict[str, Any]], path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, metric in zip(axes.flat, METRICS, strict=True):
        for run in runs:
            v = _values(run, metric)
            if v:
                ax.ecdf(v, label=level_name(run))
        ax.set_xscale("log")  # latencies span decades: one stall next to steady decode steps
        lo, hi = ax.get_xlim()
        narrow = hi / lo < 10**2.5  # few decades: label 1, 2 and 5 of each
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if narrow else (1.0,)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"{NAMES[metric]} (ms, log scale)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Latency CDF — {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _throughput(runs: list[dict[str, Any]], path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    conc = [r["concurrency"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(conc, [r["output_throughput"] for r in runs], "o-", color="tab:blue", label="output tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc, [str(c) for c in conc])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax.grid(alpha=0.3)
    right = ax.twinx()
    tpot = [np.nan if r["tpot_ms"]["p50"] is None else r["tpot_ms"]["p50"] for r in runs]
    right.plot(conc, tpot, "s--", color="tab:red", label="TPOT p50 (ms)")
    right.set_ylabel("TPOT p50 (ms)", color="tab:red")
    fig.suptitle(f"Throughput vs concurrency — {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
