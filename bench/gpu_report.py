"""Peak HBM bandwidths, and the markdown table of bench/gpu_throughput.py's cells (one JSON
object per model x mode), shared by bench/kernels.py, bench/gpu_throughput.py and
bench/gpu_suite.sh.

    python bench/gpu_report.py DIR   # the throughput table of DIR/gpu_throughput.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# Peak HBM bandwidth in GB/s, matched against torch.cuda.get_device_name() (first hit wins).
PEAK_GBPS: dict[str, float] = {
    "H200": 4800.0,
    "GH200": 4000.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,  # SXM5, "NVIDIA H100 80GB HBM3"
    "H800": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,  # 40 GB SXM4 and PCIe
    "L40S": 864.0,
    "A10G": 600.0,
    "L4": 300.0,
    "RTX 4090": 1008.0,
}


def peak_gbps(name: str, override: float | None = None) -> float | None:
    if override:
        return override
    return next((gbps for key, gbps in PEAK_GBPS.items() if key in name), None)


def _num(v: float | None, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def render(cells: list[dict[str, Any]]) -> str:
    """One row per model: wsllm with graphs and with --enforce-eager, HF, their ratios, and the
    batch-1 step (ms and MBU). A cell that failed or ran over says so in the last column."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for c in cells:
        by.setdefault(c["model"], {})[c["mode"]] = c  # a later run of a cell replaces the earlier
    lines = [
        "| model | weights | graphs tok/s | eager tok/s | HF tok/s (requests) | graphs / HF | graphs / eager "
        "| batch-1 step ms, graphs | eager | MBU, graphs | engine start s | notes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for model, modes in by.items():
        g, e, h = (modes.get(m, {}) for m in ("graphs", "eager", "hf"))
        gt, et, ht = (x.get("tok_s") or None for x in (g, e, h))
        notes = "; ".join(f"{m}: {x['error']}" for m, x in modes.items() if x.get("error"))
        weights = next((x["weights"] for x in (g, e, h) if x.get("weights")), "")
        hf = f"{ht:.0f} ({h['requests']})" if ht else ""
        lines.append(
            f"| {model} | {weights} | {_num(gt, '.0f')} | {_num(et, '.0f')} | {hf} "
            f"| {_num(gt / ht if gt and ht else None, '.1f')} | {_num(gt / et if gt and et else None, '.1f')} "
            f"| {_num(g.get('step_b1_ms'), '.2f')} | {_num(e.get('step_b1_ms'), '.2f')} "
            f"| {_num(100 * g['mbu'] if g.get('mbu') else None, '.0f')}{'%' if g.get('mbu') else ''} "
            f"| {_num(g.get('start_s'), '.1f')} | {notes} |"
        )
    device = next((c["device_name"] for c in cells if c.get("device_name")), "")
    return "\n".join(lines) + (f"\n\ndevice: {device}" if device else "")


if __name__ == "__main__":
    path = Path(sys.argv[1]) / "gpu_throughput.jsonl"
    print(render([json.loads(line) for line in path.read_text().splitlines()]))
