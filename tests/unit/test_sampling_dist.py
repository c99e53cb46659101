"""The sampler draws exactly the distribution its parameters define (wsllm/kernels/sampling.py), on
every path: the native kernel on each ISA it can force, the torch reference, and the draw on the
logits' device (engine/device_draw.py).

- 20,000 draws per mode from a tiny model's logits at a fixed context fit the defined distribution
  (chi-square), and the tokens drawn are the kept set: none outside it, every kept token that is
  expected 30 times or more seen (one token too many or too few fails).
- On a real model's vocabulary width (49,152), the last token of the kept set (an unseeded draw at
  u -> 1 walks the kept tokens in rank order to the boundary) is the definition's.
- Seeded rows give what the earlier release's sampler gave for the same seed (a full sort, softmax,
  and the exponential race over the same noise), alone or in any batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from wsllm.kernels import quant, sampling

from wsllm.engine.sampler import Sampler
from wsllm.engine.sequence import Sequence
from wsllm.types import SamplingParams

DRAWS = 20_000
MODES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=0.9, top_k=12),
    "top_p": dict(temperature=0.7, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "top_k_top_p": dict(temperature=0.7, top_p=0.8, top_k=20),
}


def paths() -> list[str]:
    """The native ISA paths this machine runs, the torch reference, and the draw on the logits'
    device (engine/device_draw.py: every row ranked, no host read; run here on the CPU)."""
    found = ["torch", "device"]
    ok, _ = quant.native_status()
    if ok:
        found += [isa for isa in quant.ISAS if quant._cpu_has(isa)]
    return found


@pytest.fixture(params=paths())
def path(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Pin one path for the test: the native kernels on a forced ISA, or the reference."""
    if request.param in ("torch", "device"):
        from wsllm.engine.device_draw import draw_rows

        real = sampling.sample_rows
        sampling.sample_rows = sampling.sample_rows_ref  # type: ignore[assignment]
        import wsllm.engine.sampler as sampler_mod

        sampler_mod.sample_rows = sampling.sample_rows_ref if request.param == "torch" else draw_rows  # type: ignore[assignment]
        yield request.param
        sampler_mod.sample_rows = real  # type: ignore[assignment]
        sampling.sample_rows = real  # type: ignore[assignment]
        return
    quant.force_isa(request.param)
    yield request.param
    quant.force_isa(None)


@pytest.fixture(scope="module")
def context_logits(tiny_words_model_dir: Path) -> torch.Tensor:
    """The next-token logits of a tiny random-weight model (512 tokens) at a fixed context."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_words_model_dir), dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([[1, 40, 41, 42, 43, 44]])).logits[0, -1].contiguous()


def defined(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The definition's distribution over the vocabulary for one row, in float64."""
    one = torch.ones(1)
    row = logits[None].double()
    temp, top_p, min_p = (one.double() * v for v in (p.temperature, p.top_p, p.min_p))
    return sampling.kept_probs(row, temp, one.long() * p.top_k, top_p, min_p)[0]


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of `counts` to `probs`, the tokens expected fewer than 5 times pooled."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


def rows(n: int, **kw: object) -> list[Sequence]:
    return [Sequence(f"r{i}", 0, [1, 2, 3], SamplingParams(**kw), 0.0) for i in range(n)]  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_draws_the_distribution_it_defines(
    path: str, mode: str, context_logits: torch.Tensor
) -> None:
    params = SamplingParams(**MODES[mode])  # type: ignore[arg-type]
    want = defined(context_logits, params)
    kept = want > 0
    assert int(kept.sum()) >= 3 and (mode == "temperature") == bool(kept.all()), "a choice kept, a cut made"
    sampler = Sampler(len(context_logits), eos_token_ids=[], seed=5)
    counts = torch.zeros(len(want), dtype=torch.float64)
    batch = rows(2_000, **MODES[mode])
    logits = context_logits.repeat(len(batch), 1)
    for _ in range(DRAWS // len(batch)):
        got = torch.tensor(sampler(logits, batch).token_ids)
        counts += torch.bincount(got, minlength=len(want)).double()
    assert counts[~kept].sum() == 0, (
        f"drawn outside the kept set: {(counts[~kept] > 0).nonzero().flatten().tolist()}"
    )
    often = kept & (want * DRAWS >= 30)
    assert bool((counts[often] > 0).all()), "a kept token was never drawn"
    assert chi_square_p(counts, want) > 1e-4


def earlier_release(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """The sampler as the release before this one drew seeded rows: sort, softmax, race."""
    vocab = logits.shape[1]
    scaled = logits / torch.tensor([s.params.temperature for s in seqs])[:, None]
    top_k = torch.tensor([min(s.params.top_k, vocab) if s.params.top_k > 0 else vocab for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs])
    min_p = torch.tensor([s.params.min_p for s in seqs])
    sorted_logits, idx = scaled.sort(dim=-1, descending=True)
    drop = torch.arange(vocab)[None, :] >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    drop |= probs.cumsum(dim=-1) - probs >= top_p[:, None]
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    scaled = torch.empty_like(scaled).scatter_(1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(dim=-1)
    q = torch.empty_like(probs)
    for i, s in enumerate(seqs):
        g = torch.Generator()
        g.manual_seed((s.params.seed * 1_000_003 + s.index * 7_919 + len(s.output_token_ids)) % 2**63)  # type: ignore[operator]
        q[i].exponential_(generator=g)
    return (probs / q).argmax(dim=-1).tolist()


def wide_logits(n: int, seed: int) -> torch.Tensor:
    """[n, 49152] logits shaped like a chat model's: a few strong candidates over a long tail."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 49152, generator=g) * 2.0
    top = torch.randint(0, 49152, (n, 8), generator=g)
    x.scatter_add_(1, top, torch.rand(n, 8, generator=g) * 12.0)
    return x


SEEDED = [
    dict(temperature=0.7),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=0.7, top_p=0.8, top_k=20),
    dict(temperature=1.3, min_p=0.02),
    dict(temperature=0.5, top_k=3),
]


def test_seeded_rows_give_what_the_earlier_release_gave_alone_or_in_any_batch(path: str) -> None:
    logits = wide_logits(len(SEEDED) * 8, seed=1)
    seqs = [
        Sequence(f"s{i}", i % 3, [1, 2, 3], SamplingParams(seed=100 + i, **SEEDED[i % len(SEEDED)]), 0.0)  # type: ignore[arg-type]
        for i in range(len(logits))
    ]
    for s in seqs[::2]:
        s.output_token_ids = [5, 6, 7]
    want = earlier_release(logits, seqs)
    sampler = Sampler(49152, eos_token_ids=[], seed=0)
    assert sampler(logits, seqs).token_ids == want
    # alone, and beside unseeded and greedy rows, a seeded row draws the same token
    others = rows(3, temperature=0.9, top_p=0.95) + rows(2, temperature=0.0)
    mixed = torch.cat([wide_logits(5, seed=2), logits[:4]])
    assert sampler(mixed, others + seqs[:4]).token_ids[5:] == want[:4]
    assert [sampler(logits[i : i + 1], [seqs[i]]).token_ids[0] for i in range(4)] == want[:4]


def test_the_kept_sets_boundary_is_the_definitions_on_a_real_vocabulary(path: str) -> None:
    """A race whose noise E = e^1.5 makes 1 / sqrt(e) each kept token's score is won by the kept
    set's last token in rank order: the definition's boundary, on 49,152-token rows."""
    cases = [
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=0.7, top_p=0.8, top_k=20),
        dict(temperature=1.0, top_p=0.99),
        dict(temperature=2.0, top_p=0.95),  # a flat row: the cut lies in the low bands
        dict(temperature=0.6, top_k=40),
        dict(temperature=1.0, top_p=0.5, min_p=0.3),
        dict(temperature=1.0, min_p=0.01),
    ]
    logits = wide_logits(24 * len(cases), seed=3)
    ps = [SamplingParams(**cases[i % len(cases)]) for i in range(len(logits))]  # type: ignore[arg-type]
    temp = torch.tensor([p.temperature for p in ps])
    top_k = torch.tensor([p.top_k for p in ps], dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in ps])
    min_p = torch.tensor([p.min_p for p in ps])
    scaled = logits / temp[:, None]
    noise = ((scaled - scaled.amax(dim=-1, keepdim=True)).double() * 1.5).exp().float()
    every = torch.arange(len(ps))
    got = sampling.sample_rows(logits, temp, top_k, top_p, min_p, torch.zeros(len(ps)), noise, every)
    e = (scaled - scaled.amax(dim=-1, keepdim=True)).double().exp()
    ranked = scaled.argsort(dim=-1, descending=True, stable=True)
    for i, p in enumerate(ps):
        r = int((ranked[i] == got[i]).nonzero())  # the drawn token's rank: the kept set's last
        lo, hi = kept_boundary(e[i, ranked[i]], p, -1e-5), kept_boundary(e[i, ranked[i]], p, 1e-5)
        assert lo <= r <= hi, (i, cases[i % len(cases)], lo, r, hi)


def kept_boundary(ranked_e: torch.Tensor, p: SamplingParams, tol: float) -> int:
    """The definition's last kept rank in float64, its top-p and min-p cuts moved by `tol` (relative):
    where float32's rounding leaves the cut open, any rank between -tol and +tol is the boundary."""
    ranks = torch.arange(len(ranked_e))
    ok = torch.ones(len(ranked_e), dtype=torch.bool)
    if p.top_k > 0:
        ok &= ranks < p.top_k
    if p.top_p < 1:
        ok &= ranked_e.cumsum(0) - ranked_e < p.top_p * float(ranked_e.sum()) * (1 + tol)
    if p.min_p > 0:
        ok &= ranked_e >= p.min_p * (1 - tol)
    ok[0] = True
    return int(ok.long().cumprod(0).sum()) - 1
