"""wsllm serve against the CPU servers a user would pick instead: vLLM's CPU build and llama.cpp's
llama-server, on the same machine, in the same run.

Each server is started, waited for, measured and stopped in turn; never two at once (on a 2-core
machine two servers measure each other). Each is driven by the project's own load generator,
`wsllm bench`, over SSE on /v1/chat/completions: the same chat prompts for every server (made
from a fixed seed; a fresh set per concurrency level and sampling setting, so no run reuses
another's prefixes), 64 output tokens each, `ignore_eos`, under each sampling setting of
serving_report.SAMPLINGS (greedy; temperature 0.7 with top_p 0.9; Qwen's 0.7 / 0.8 / top_k 20). The table (output tokens/s per level, TTFT p50 at
the first level, ratios of wsllm to each peer) goes into its own section of docs/benchmarks.md,
replaced on each run, with the command, the date and the CPU's flags.

The peers are built once, outside the repo, by bench/peers_setup.py. The model is SmolLM2-135M-
Instruct for all three: wsllm's default (the Q4_1 GGUF computed in its blocks); for vLLM the HF
directory that wsllm's loader writes (the GGUF de-quantized), at its best dtype on this CPU (bf16
where the CPU has AVX512_BF16 or AMX, else fp32); for llama-server the GGUF itself.

Resident memory (RSS of the server's process tree) is read once it is ready and again after one
request. wsllm gets the same KV capacity as llama-server's context (`-c`) unless --wsllm-args
names one; the table says both.

    python bench/serving_peers.py                                # all three, 32 requests per level
    python bench/serving_peers.py --servers wsllm,vllm --wsllm-args="--dtype bfloat16"
    python bench/serving_peers.py --smoke                        # 4 requests per level; docs say so
    python bench/serving_peers.py --servers wsllm,llamacpp --sampling greedy,qwen
    python bench/serving_peers.py --no-write-docs                # print the table only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_setup  # noqa: E402  (a sibling script, not a package)
import procmem  # noqa: E402
import serving_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("wsllm", "vllm", "llamacpp")
PEER_MODEL_NAME = "SmolLM2-135M-Instruct"

# Short, realistic user questions: every template with every topic, shuffled with the seed.
_TOPICS = (
    "photosynthesis", "the water cycle", "compound interest", "black holes", "the French Revolution",
    "machine learning", "vaccines", "plate tectonics", "the stock market", "recycling", "jazz",
    "the Roman Empire", "electric cars", "sleep", "coffee", "the internet", "climate change", "DNA",
    "the Moon landing", "volcanoes", "democracy", "solar panels", "the immune system", "Shakespeare",
    "chess", "baking bread", "rainbows", "earthquakes", "honey bees", "the printing press", "gravity",
    "inflation", "meditation", "Python programming", "the Olympic Games", "ocean tides", "antibiotics",
    "the Great Wall of China", "hurricanes", "renewable energy",
)  # fmt: skip
_TEMPLATES = (
    "What is {t}?", "Can you explain {t} in simple terms?", "Give me three interesting facts about {t}.",
    "Why does {t} matter?", "How does {t} work?", "Write a short poem about {t}.",
    "What are the pros and cons of {t}?", "Summarize the history of {t} in a few sentences.",
    "How would you explain {t} to a ten-year-old?", "What is a common misconception about {t}?",
)  # fmt: skip


def chat_prompts(n: int, seed: int) -> list[list[dict[str, str]]]:
    """`n` distinct one-turn chats (at most len(_TOPICS) * len(_TEMPLATES)), the same for a seed."""
    import random

    pool = [tpl.format(t=t) for tpl in _TEMPLATES for t in _TOPICS]
    if n > len(pool):
        raise ValueError(f"at most {len(pool)} distinct prompts, asked for {n}")
    random.Random(seed).shuffle(pool)
    return [[{"role": "user", "content": q[0].upper() + q[1:]}] for q in pool[:n]]


# -- servers ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Server:
    name: str  # wsllm | vllm | llamacpp
    label: str  # how the table names it
    argv: list[str]
    ready_path: str  # answers 200 once it serves
    ready_timeout_s: float
    env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_context(args: argparse.Namespace) -> tuple[int, int]:
    """llama-server's slots and its whole context (-c, shared by the slots), in tokens."""
    slots = max(args.levels)
    per_slot = max(512, -(-(args.output_len + 256) // 256) * 256)
    return slots, per_slot * slots


def vllm_dtype(args: argparse.Namespace) -> str:
    if args.vllm_dtype != "auto":
        return str(args.vllm_dtype)
    flags = serving_report.cpu_flags().split()
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def make_server(name: str, port: int, args: argparse.Namespace) -> Server:
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "wsllm":
        extra = shlex.split(args.wsllm_args)
        if "--model" not in extra:  # the one-time conversion, repack and build are not "ready in"
            warm = "from wsllm.config import EngineConfig; from wsllm.models.build import build_model; build_model(EngineConfig())"
            subprocess.run([sys.executable, "-c", warm], check=True)
        if not {"--num-kv-blocks", "--kv-cache-gb"} & set(extra):
            extra += ["--num-kv-blocks", str(-(-llama_context(args)[1] // 16))]  # 16-token blocks
        label = "`wsllm serve`" + (f" `{args.wsllm_args}`" if args.wsllm_args else " (defaults)")
        argv = [str(Path(sys.executable).parent / "wsllm"), "serve", *host, "--no-frontend", *extra]
        return Server(name, label, argv, "/ready", args.ready_timeout_s or 300)
    if name == "vllm":
        from wsllm.models.loader import resolve_model_dir

        py = peers_setup.vllm_python(args.peers_dir)
        if not py.exists():
            raise SystemExit(f"vLLM is not built: {py} is missing; run python bench/peers_setup.py")
        argv = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model_dir(None)),
                "--dtype", vllm_dtype(args), "--max-model-len", "2048", "--served-model-name", PEER_MODEL_NAME, *host]  # fmt: skip
        env = {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{_last_cpu()}",
            # its processes talk over ZMQ on the host's own address unless told the loopback one
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_LOOPBACK_IP": "127.0.0.1",
        }
        # torch.compile of the model at every start: 2 to 3 minutes on 2 cores, more when busy
        return Server(name, f"vLLM CPU {_version(py, 'vllm')} ({vllm_dtype(args)})", argv, "/v1/models",
                      args.ready_timeout_s or 900, env)  # fmt: skip
    from wsllm.models.loader import default_gguf_path

    binary = peers_setup.llama_server_path(args.peers_dir)
    if not binary.exists():
        raise SystemExit(f"llama-server is not built: {binary} is missing; run python bench/peers_setup.py")
    slots, ctx = llama_context(args)
    argv = [str(binary), "-m", str(default_gguf_path()), *host, "-np", str(slots),
            "-c", str(ctx), "-t", str(os.cpu_count() or 2), "--alias", PEER_MODEL_NAME]  # fmt: skip
    label = f"llama-server (Q4_1 GGUF, -np {slots} -t {os.cpu_count() or 2})"
    return Server(name, label, argv, "/health", args.ready_timeout_s or 300)


def _last_cpu() -> int:
    return (os.cpu_count() or 1) - 1


def _version(py: Path, module: str) -> str:
    r = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version('{module}-cpu'))"],
                       capture_output=True, text=True)  # fmt: skip
    return r.stdout.strip() or "?"


def _wait_ready(server: Server, proc: subprocess.Popen[bytes], base: str, log: Path) -> float:
    start = time.monotonic()
    while time.monotonic() - start < server.ready_timeout_s:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{server.name} exited with {proc.returncode} before it was ready:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + server.ready_path, timeout=5).status_code == 200:
                return time.monotonic() - start
        time.sleep(1)
    raise RuntimeError(f"{server.name} was not ready within {server.ready_timeout_s:.0f} s (log: {log})")


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 60) -> None:
    """SIGTERM to the server's own process group (vLLM's engine core is a child), then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            print(f"  pid {proc.pid} ignored SIGTERM for {grace_s:.0f} s: SIGKILL", file=sys.stderr)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group is left
    proc.wait()


@contextlib.contextmanager
def running(server: Server, port: int, log: Path) -> Iterator[tuple[float, int]]:
    """Start `server`, yield the seconds it took to become ready and its pid, stop it (and its
    children)."""
    print(f"starting {server.name}: {shlex.join(server.argv)}", file=sys.stderr)
    with open(log, "wb") as out:
        proc = subprocess.Popen(server.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **server.env}, cwd=ROOT)  # fmt: skip
    try:
        ready_s = _wait_ready(server, proc, f"http://127.0.0.1:{port}", log)
        print(f"  {server.name} ready in {ready_s:.1f} s", file=sys.stderr)
        yield ready_s, proc.pid
    finally:
        t = time.monotonic()
        _stop(proc)
        print(
            f"  {server.name} stopped (exit {proc.returncode}) in {time.monotonic() - t:.1f} s",
            file=sys.stderr,
        )


# -- load ---------------------------------------------------------------------------------------


def sampling_flags(setting: str) -> list[str]:
    """`wsllm bench`'s flags for a setting of serving_report.SAMPLINGS."""
    return [
        a
        for k, v in serving_report.SAMPLINGS[setting].items()
        for a in (f"--{k.replace('_', '-')}", f"{v:g}")
    ]


def bench_level(
    port: int, level: int, prompts: Path, args: argparse.Namespace, out: Path, setting: str = "greedy"
) -> dict[str, Any]:
    """One `wsllm bench` run at one concurrency level under one sampling setting; its JSON's only run."""
    cmd = [str(Path(sys.executable).parent / "wsllm"), "bench", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "chat", "--prompts", str(prompts), "--num-requests", str(args.num_requests),
           "--concurrency", str(level), "--output-len", str(args.output_len), "--ignore-eos",
           *sampling_flags(setting), "--seed", str(args.seed), "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=_bench_env())
    if r.returncode not in (0, 1) or not out.exists():  # 1: some requests failed; the table says so
        raise RuntimeError(f"wsllm bench failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return dict(json.loads(out.read_text())["runs"][0])


def _bench_env() -> dict[str, str]:
    # only the flags above decide what the load generator sends
    return {k: v for k, v in os.environ.items() if not k.startswith("WSLLM_")}


def probe(port: int, prompts: Path, out: Path) -> None:
    """One greedy answer to the first prompt, kept beside the logs: how the server templated the chat
    (its prompt_tokens) and what it says, to set beside the other servers' answers."""
    messages = json.loads(prompts.read_text().splitlines()[0])["messages"]
    body = {"messages": messages, "max_tokens": 24, "temperature": 0}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120).json()
    out.write_text(json.dumps(r, indent=1))
    text = r["choices"][0]["message"]["content"] if r.get("choices") else r
    print(f"  probe: prompt_tokens {r.get('usage', {}).get('prompt_tokens')}: {text!r}", file=sys.stderr)


def measure(name: str, args: argparse.Namespace, work: Path) -> serving_report.Row:
    port = free_port()
    server = make_server(name, port, args)
    load_before = os.getloadavg()[0]
    with running(server, port, work / f"{name}.log") as (ready_s, pid):
        time.sleep(2)  # let a server that warms up after /ready settle
        rss_load = procmem.tree_rss_mb(pid)
        probe(port, work / "prompts-0.jsonl", work / f"{name}-probe.json")
        rss_request = procmem.tree_rss_mb(pid)
        print(
            f"  {name}: resident {rss_load:.0f} MB loaded, {rss_request:.0f} MB after one request",
            file=sys.stderr,
        )
        runs: dict[str, dict[int, dict[str, Any]]] = {}
        for j, setting in enumerate(args.samplings):
            runs[setting] = {}
            for i, level in enumerate(args.levels):
                print(
                    f"  {name}: {setting}, concurrency {level}, {args.num_requests} requests", file=sys.stderr
                )
                prompts = work / f"prompts-{j * len(args.levels) + i}.jsonl"
                out = work / f"{name}-{setting}-c{level}.json"
                runs[setting][level] = bench_level(port, level, prompts, args, out, setting)
    kv = llama_context(args)[1] if name in ("wsllm", "llamacpp") else None
    return serving_report.Row(
        name, server.label, ready_s, runs, load_before, os.getloadavg()[0], (rss_load, rss_request), kv
    )


def write_prompts(args: argparse.Namespace, work: Path, sets: int = 1) -> None:
    """`prompts-{k}.jsonl`, one per level of each of `sets` runs (k = set * levels + level), each its own
    slice of one seeded pool: the same files for every server, and no run reuses another's prefixes."""
    n = args.num_requests
    chats = chat_prompts(n * len(args.levels) * sets, args.seed)
    for i in range(len(args.levels) * sets):
        lines = [json.dumps({"messages": m}) for m in chats[i * n : (i + 1) * n]]
        (work / f"prompts-{i}.jsonl").write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--servers", default=",".join(SERVERS), help="comma list, run in this order: wsllm,vllm,llamacpp"
    )
    p.add_argument("--concurrency", default="1,8,32", help="comma list of levels")
    p.add_argument("--num-requests", type=int, default=None, help="per level (default 32; 4 with --smoke)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--sampling",
        default=",".join(serving_report.SAMPLINGS),
        help=f"comma list of settings, each run at every level: {', '.join(serving_report.SAMPLINGS)}",
    )
    p.add_argument("--seed", type=int, default=0, help="picks the prompts")
    p.add_argument(
        "--wsllm-args", default="", help='extra args for wsllm serve, e.g. --wsllm-args="--dtype bfloat16"'
    )
    p.add_argument(
        "--vllm-dtype", default="auto", help="auto (bf16 where the CPU has it natively) | float32 | bfloat16"
    )
    p.add_argument("--ready-timeout-s", type=float, default=None, help="per server (default 300; vLLM 900)")
    p.add_argument("--peers-dir", type=Path, default=None, help="where bench/peers_setup.py built the peers")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="keep server logs and bench JSON here (default: a temp dir)",
    )
    p.add_argument(
        "--smoke", action="store_true", help="few requests; the docs section says it is no measurement"
    )
    p.add_argument("--no-write-docs", dest="write_docs", action="store_false", help="print the table only")
    args = p.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not args.servers or set(args.servers) - set(SERVERS):
        p.error(f"--servers takes a comma list of {', '.join(SERVERS)}")
    try:
        args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrency takes a comma list of integers, got {args.concurrency!r}")
    if not args.levels or min(args.levels) < 1:
        p.error("--concurrency levels must be >= 1")
    args.samplings = [x.strip() for x in args.sampling.split(",") if x.strip()]
    if not args.samplings or set(args.samplings) - set(serving_report.SAMPLINGS):
        p.error(f"--sampling takes a comma list of {', '.join(serving_report.SAMPLINGS)}")
    args.num_requests = args.num_requests or (4 if args.smoke else 32)
    if args.num_requests * len(args.levels) * len(args.samplings) > len(_TOPICS) * len(_TEMPLATES):
        p.error(
            f"--num-requests × levels × settings may be at most {len(_TOPICS) * len(_TEMPLATES)} (distinct prompts)"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = shlex.join(["python", "bench/serving_peers.py", *(sys.argv[1:] if argv is None else argv)])
    with contextlib.ExitStack() as stack:
        work = args.out_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="serving-peers-")))
        work.mkdir(parents=True, exist_ok=True)
        write_prompts(args, work, len(args.samplings))
        rows = [measure(name, args, work) for name in args.servers]
    text = serving_report.section(rows, args, command, datetime.date.today().isoformat())
    print(text)
    if args.write_docs:
        path = ROOT / "docs" / "benchmarks.md"
        path.write_text(serving_report.replace_section(path.read_text(), serving_report.TITLE, text))
        print(f"wrote the '{serving_report.TITLE}' section of {path.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
