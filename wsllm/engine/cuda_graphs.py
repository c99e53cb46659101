"""Capture and replay of static decode steps on CUDA (static_step.py builds the step).

Without graphs a decode step of a small model is host-bound: ~600 kernel launches from
Python (SmolLM2 at batch 1 took 14 ms a step on an H100, 1% of its bandwidth;
docs/benchmarks.md). A graph launches them all in one call.

At engine start, after the KV cache exists: for each batch bucket, largest first, the
step runs eagerly over all-padding inputs (Triton compiles and cuBLAS picks its kernels
outside the capture; padding writes no KV), then is captured. All graphs share one memory
pool: a graph's intermediates are dead when it ends and the buckets replay one at a time
on one stream, so the pool needs about the largest bucket's activations (measured before
the KV cache was sized, StaticStep._measure_activations). Every bucket writes its logits
into the step's one static output, so no graph keeps an output of its own alive.

Replaying is all that is CUDA's own; what the graph reads (buckets, padding, buffer
filling) is shared with the CPU's plain call and tested there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_WARMUP = 2  # eager runs per bucket before its capture (the first compiles; the second settles)


class CudaGraphs:
    def __init__(self) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None  # the memory pool every graph shares (torch's handle)

    @classmethod
    def capture(
        cls, forward: Callable[[int], torch.Tensor], pad_all: Callable[[int], None], buckets: list[int]
    ) -> CudaGraphs:
        """One graph per bucket of `forward(bucket)`, the largest captured first (the pool's
        blocks are sized by it, and the smaller ones reuse them)."""
        self = cls()
        started = time.perf_counter()
        before = torch.cuda.memory_reserved()
        side = torch.cuda.Stream()  # warm-up off the default stream, as torch's capture wants
        with torch.inference_mode():
            for b in sorted(buckets, reverse=True):
                pad_all(b)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(_WARMUP):
                        forward(b)
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    forward(b)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info(
            "captured %d decode graphs (batch %s) in %.1fs, %.0f MiB",
            len(self.graphs),
            ",".join(map(str, sorted(self.graphs))),
            time.perf_counter() - started,
            (torch.cuda.memory_reserved() - before) / 2**20,
        )
        return self

    def replay(self, bucket: int) -> None:
        """Run the bucket's step over what the static buffers hold now."""
        self.graphs[bucket].replay()
