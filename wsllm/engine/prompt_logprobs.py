"""The logprobs of prompt tokens (`SamplingParams.prompt_logprobs`), on the device.

The row of position p predicts prompt token p + 1, so a chunk over positions [start, end) gives
the entries of tokens start + 1 .. end (those in the prompt). They are reduced on the device, a
slice of rows at a time, to the chosen token's logprob and the top N: a [prompt, vocab] logits
tensor is never held whole, and what the step copies back is [rows, 1 + N] values and [rows, N]
ids, read into entries on the host (`entries`).
"""

from __future__ import annotations

from typing import Any

import torch

from wsllm.engine.sequence import Sequence

# Rows of [rows, vocab] fp32 logits reduced at once: 2**21 floats (8 MiB, 42 rows of a 49k
# vocabulary) per slice. The slice stays in the last-level cache through its passes (gather,
# top-k, max, exp, sum), is reused from the heap rather than mapped afresh, and is still
# wide enough that the LM head's kernel reads its weights once for many rows.
_LOGPROB_SLICE_FLOATS = 1 << 21
_LOGPROB_SLICE_MIN_ROWS = 16  # a large vocabulary: fewer rows would read the LM head too often


def prompt_logprob_parts(
    model: Any, hidden: torch.Tensor, scheduled: list[tuple[Sequence, int]], want: dict[int, int]
) -> tuple[list[torch.Tensor], list[tuple[Sequence, int, int]]]:
    """The prompt logprobs this step computes for the sequences in `want` (seq_id -> top N), on
    the device: their tensors (per chunk its values, and with N > 0 its ids) and per chunk
    (sequence, the prompt position of its first entry, N). `hidden`: [num_tokens, hidden]."""
    parts: list[torch.Tensor] = []
    chunks: list[tuple[Sequence, int, int]] = []
    offset = 0  # the sequence's first row in the packed batch
    for seq, n in scheduled:
        top = want.get(seq.seq_id)
        start = seq.num_computed_tokens
        stop = min(start + n, len(seq.prompt_token_ids) - 1)  # rows that predict a prompt token
        if top is not None and stop > start:
            targets = seq.prompt_token_ids[start + 1 : stop + 1]
            top = min(top, model.config.vocab_size)
            parts += token_logprobs(model, hidden[offset : offset + stop - start], targets, top)
            chunks.append((seq, start + 1, top))
        offset += n
    return parts, chunks


def token_logprobs(model: Any, hidden: torch.Tensor, targets: list[int], top: int) -> list[torch.Tensor]:
    """For each row of hidden [rows, hidden]: [logprob of targets[i], top `top` logprobs]
    [rows, 1 + top] and the top ids [rows, top] (when top > 0), on the device.

    A row's cost is its LM-head row (a decode's logits; the rest of the forward is the
    row's own token) and a few passes over its logits: logprob = logit - logsumexp, so
    the chosen token's logit is gathered and the top N taken from the logits themselves
    (log_softmax is monotonic in a row), then the logsumexp is computed in place
    (max, exp, sum: no [rows, vocab] copy)."""
    vocab = model.config.vocab_size
    step = max(_LOGPROB_SLICE_MIN_ROWS, _LOGPROB_SLICE_FLOATS // vocab)
    tgt = torch.tensor(targets, dtype=torch.long)
    tgt = (
        tgt.pin_memory().to(hidden.device, non_blocking=True) if hidden.is_cuda else tgt.to(hidden.device)
    )[:, None]
    values: list[torch.Tensor] = []
    ids: list[torch.Tensor] = []
    for a in range(0, len(targets), step):
        logits = model.compute_logits(hidden[a : a + step])[:, :vocab]  # [s, vocab] fp32
        picked = logits.gather(1, tgt[a : a + step])  # [s, 1]
        if top:
            top_v, top_i = logits.topk(top, dim=-1)  # [s, top]
            picked = torch.cat([picked, top_v], dim=1)  # [s, 1 + top]
            ids.append(top_i)
        peak = logits.amax(dim=-1, keepdim=True)  # [s, 1]
        lse = logits.sub_(peak).exp_().sum(dim=-1, keepdim=True).log_().add_(peak)  # logits spent
        values.append(picked.sub_(lse))
    return [torch.cat(values)] + ([torch.cat(ids)] if top else [])


def entries(values: list[list[float]], ids: list[list[int]] | None) -> list[Any]:
    """Prompt logprob entries from the host's copies: (logprob, ((tok, lp), ... top N)) per row.

    Each row is a tuple of numbers and tuples: the collector stops tracking those at its
    first pass over them, where lists (21 per row) stay tracked for as long as the table
    lives, the request's whole prefill and reply. 1,500 rows of a top 20 were 33,000
    tracked objects as lists, 3,300 as tuples after one collection, and every full
    collection of a server under such requests walks them all (bench/amplification.py's
    trace: generation-2 collections of up to 108 ms that freed nothing)."""
    if ids is None:
        return [(v[0], ()) for v in values]
    return [(v[0], tuple(zip(i, v[1:], strict=True))) for v, i in zip(values, ids, strict=True)]
