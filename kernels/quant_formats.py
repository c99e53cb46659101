"""GGUF block formats in torch: their fields, the kernels' packed layout, dequantization.

A GGUF tensor of N rows x K values is N rows of K / block_size blocks, each `type_size`
bytes. `pack_raw` splits every block into its fields (scales, quant bytes) and stores them
for groups of ROWS output rows side by side, so that a vector lane of the kernels is an
output row (16 rows: one AVX-512 vector of int32, two of AVX2):

    packed: uint8 [groups, blocks, ROWS * bytes_per_row_block]

Inside one (group, block) the fields follow each other in the order of `FIELDS`; a field
of L bytes per row, cut in units of u bytes, is stored as [L / u][ROWS][u]: fp16 scales
(u = 2) become 16 scales in a row, quant bytes (u = 4) become 64-byte units that hold
4 bytes of each of the 16 rows (one `vpdpbusd` lane each), per-sub-block scales (u = 1) a
byte per row. The only field not copied as is: the 12 bytes of 6-bit scales and mins of
Q4_K / Q5_K, unpacked to 8 + 8 bytes (148 and 180 bytes per 256 values instead of 144 and
176, +2.8%) so that the kernels read them with one widening load. MXFP4 (gpt-oss's experts:
an E8M0 exponent byte and 16 bytes of E2M1 nibbles per 32 values) keeps its exponent as a
byte per row, made a float scale 2 ** (e - 128) as the kernels read it. Rows past N (the last
group's padding) are zero bytes: zero scales, so they compute zeros.

`dequantize_*` follow gguf.quants' numpy arithmetic operation for operation, so that the
results are equal bit for bit (tests/unit/test_quant_kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS = 16  # output rows per group: the int32 lanes of an AVX-512 vector

# qtype -> (values per block, bytes per block)
BLOCK = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "MXFP4": (32, 17),
}
QTYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
# MXFP4's E2M1 values, doubled (as gguf and ggml keep them: 2 ** (e - 128) scales them back)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

# qtype -> the packed fields in order: (name, bytes per row and block, unit bytes)
FIELDS: dict[str, tuple[tuple[str, int, int], ...]] = {
    "Q4_0": (("d", 2, 2), ("qs", 16, 4)),
    "Q4_1": (("d", 2, 2), ("m", 2, 2), ("qs", 16, 4)),
    "Q8_0": (("d", 2, 2), ("qs", 32, 4)),
    "Q4_K": (("d", 2, 2), ("dmin", 2, 2), ("sc", 8, 1), ("mn", 8, 1), ("qs", 128, 4)),
    "Q5_K": (("d", 2, 2), ("dmin", 2, 2), ("sc", 8, 1), ("mn", 8, 1), ("qh", 32, 4), ("qs", 128, 4)),
    "Q6_K": (("d", 2, 2), ("sc", 16, 1), ("ql", 128, 4), ("qh", 64, 4)),
    "MXFP4": (("e", 1, 1), ("qs", 16, 4)),
}
# qtype -> where each field sits in a GGUF block (byte offset, length); "scales" holds sc and mn
_RAW: dict[str, dict[str, tuple[int, int]]] = {
    "Q4_0": {"d": (0, 2), "qs": (2, 16)},
    "Q4_1": {"d": (0, 2), "m": (2, 2), "qs": (4, 16)},
    "Q8_0": {"d": (0, 2), "qs": (2, 32)},
    "Q4_K": {"d": (0, 2), "dmin": (2, 2), "scales": (4, 12), "qs": (16, 128)},
    "Q5_K": {"d": (0, 2), "dmin": (2, 2), "scales": (4, 12), "qh": (16, 32), "qs": (48, 128)},
    "Q6_K": {"ql": (0, 128), "qh": (128, 64), "sc": (192, 16), "d": (208, 2)},
    "MXFP4": {"e": (0, 1), "qs": (1, 16)},
}


def packed_block_bytes(qtype: str) -> int:
    """Bytes of one (group, block) of the packed layout."""
    return ROWS * sum(size for _, size, _ in FIELDS[qtype])


def check_shape(qtype: str, shape: tuple[int, int]) -> tuple[int, int]:
    if qtype not in BLOCK:
        raise ValueError(f"unsupported quantization type {qtype!r}; supported: {', '.join(QTYPES)}")
    n, k = int(shape[0]), int(shape[1])
    if n <= 0 or k <= 0 or k % BLOCK[qtype][0]:
        raise ValueError(f"{qtype} needs rows of a multiple of {BLOCK[qtype][0]} values, got shape {shape}")
    return n, k


# -- fields of GGUF blocks ------------------------------------------------------------------------


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # scales: [..., 12] uint8, six bits per scale and min (gguf Q4_K.get_scale_min)
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def raw_fields(qtype: str, raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """raw: uint8 [R, blocks, type_size] -> {field: uint8 [R, blocks, bytes]} in FIELDS' terms."""
    out: dict[str, torch.Tensor] = {}
    for name, (off, size) in _RAW[qtype].items():
        part = raw[..., off : off + size]
        if name == "scales":
            out["sc"], out["mn"] = _k_scales(part)
        else:
            out[name] = part
    return out


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % ROWS
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t


def pack_raw(qtype: str, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """GGUF bytes of an [n, k] tensor -> packed uint8 [groups, blocks, packed_block_bytes]."""
    bs, ts = BLOCK[qtype]
    nb = k // bs
    raw = raw.reshape(-1).view(torch.uint8)
    if raw.numel() != n * nb * ts:
        raise ValueError(f"{qtype} [{n}, {k}] needs {n * nb * ts} bytes, got {raw.numel()}")
    fields = raw_fields(qtype, raw.reshape(n, nb, ts))
    parts = []
    for name, size, unit in FIELDS[qtype]:
        f = _pad_rows(fields[name]).reshape(-1, ROWS, nb, size // unit, unit)
        parts.append(f.permute(0, 2, 3, 1, 4).reshape(-1, nb, ROWS * size))
    return torch.cat(parts, dim=-1).contiguous()


def packed_fields(qtype: str, packed: torch.Tensor) -> dict[str, torch.Tensor]:
    """packed [groups, blocks, B] -> {field: uint8 [groups * ROWS, blocks, bytes]} (pack_raw undone)."""
    g, nb, _ = packed.shape
    out: dict[str, torch.Tensor] = {}
    off = 0
    for name, size, unit in FIELDS[qtype]:
        f = packed[..., off : off + ROWS * size].reshape(g, nb, size // unit, ROWS, unit)
        out[name] = f.permute(0, 3, 1, 2, 4).reshape(g * ROWS, nb, size)
        off += ROWS * size
    return out


# -- values --------------------------------------------------------------------------------------


def _f16(b: torch.Tensor) -> torch.Tensor:
    # b: uint8 [..., 2] little-endian fp16 -> float32 [...]
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """MXFP4's exponent bytes uint8 [..., 1] -> float32 2 ** (e - 128) [...], exactly (ggml's
    e8m0_to_fp32_half: below 2 a subnormal)."""
    e = e.squeeze(-1).to(torch.int32)
    bits = torch.where(e < 2, (e + 1) << 21, (e - 1) << 23)
    return bits.view(torch.float32)


def _scale(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """The block scale as float32 [R, blocks]: fp16 d, or MXFP4's exponent."""
    return _e8m0_half(f["e"]) if "e" in f else _f16(f["d"])


def quant_values(qtype: str, f: dict[str, torch.Tensor]) -> torch.Tensor:
    """The integer quant of every value, [R, blocks, block_size] int16: Q4_0 and Q6_K with their
    offsets (-8, -32) applied, Q4_1 / Q4_K / Q5_K unsigned (their mins are separate terms)."""
    if qtype == "Q8_0":
        return f["qs"].contiguous().view(torch.int8).to(torch.int16)
    if qtype == "MXFP4":  # value j: low nibble of byte j, value 16 + j: its high nibble
        nibbles = torch.cat([f["qs"] & 0x0F, f["qs"] >> 4], dim=-1).long()
        return torch.tensor(MXFP4_VALUES, dtype=torch.int16)[nibbles]
    if qtype in ("Q4_0", "Q4_1"):
        q = torch.cat([f["qs"] & 0x0F, f["qs"] >> 4], dim=-1).to(torch.int16)
        return q - 8 if qtype == "Q4_0" else q
    r, nb = f["d"].shape[:2]
    if qtype in ("Q4_K", "Q5_K"):
        qs = f["qs"].reshape(r, nb, 4, 1, 32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(r, nb, 8, 32).to(torch.int16)
        if qtype == "Q5_K":
            shifts = torch.arange(8, dtype=torch.uint8).reshape(8, 1)
            q = q | (((f["qh"].reshape(r, nb, 1, 32) >> shifts) & 1).to(torch.int16) << 4)
        return q.reshape(r, nb, 256)
    # Q6_K: the low nibbles of two 64-byte halves, two bits each from 32-byte qh halves
    ql = f["ql"].reshape(r, nb, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(2, 1)
    ql = (ql & 0x0F).reshape(r, nb, 8, 32)
    qh = f["qh"].reshape(r, nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)
    qh = (qh & 0x03).reshape(r, nb, 8, 32)
    return ((ql | (qh << 4)).to(torch.int16) - 32).reshape(r, nb, 256)


def dequantize_fields(qtype: str, f: dict[str, torch.Tensor]) -> torch.Tensor:
    """-> float32 [R, K], in gguf.quants' order of float operations."""
    q = quant_values(qtype, f).float()
    r, nb, bs = q.shape
    d = _scale(f)[..., None]  # [R, blocks, 1]
    if qtype in ("Q4_0", "Q8_0", "MXFP4"):
        out = q * d if qtype == "Q8_0" else d * q
    elif qtype == "Q4_1":
        out = (d * q) + _f16(f["m"].reshape(r, nb, 1, 2))
    elif qtype in ("Q4_K", "Q5_K"):
        ds = (d * f["sc"].float()).reshape(r, nb, 8, 1)
        dm = (_f16(f["dmin"].reshape(r, nb, 1, 2)) * f["mn"].float()).reshape(r, nb, 8, 1)
        out = ds * q.reshape(r, nb, 8, 32) - dm
    else:
        ds = (d * f["sc"].contiguous().view(torch.int8).float()).reshape(r, nb, 16, 1)
        out = ds * q.reshape(r, nb, 16, 16)
    return out.reshape(r, nb * bs)


@dataclass(frozen=True, slots=True)
class BlockParts:
    """A weight's quantized numbers in plain tensors, as the reference computes with them."""

    q: torch.Tensor  # int16 [N, blocks, block_size] (see quant_values)
    d: torch.Tensor  # float32 [N, blocks]: the block scale (MXFP4: 2 ** (e - 128))
    m: torch.Tensor | None  # float32 [N, blocks]: Q4_1's min, Q4_K/Q5_K's dmin
    sc: torch.Tensor | None  # int32 [N, blocks, 8 or 16]: K-quants' sub-block scales
    mn: torch.Tensor | None  # int32 [N, blocks, 8]: Q4_K/Q5_K's sub-block mins


def block_parts(qtype: str, f: dict[str, torch.Tensor]) -> BlockParts:
    d = _scale(f)
    m = _f16(f["m"]) if "m" in f else _f16(f["dmin"]) if "dmin" in f else None
    sc = mn = None
    if qtype == "Q6_K":
        sc = f["sc"].contiguous().view(torch.int8).to(torch.int32)
    elif "sc" in f:
        sc, mn = f["sc"].to(torch.int32), f["mn"].to(torch.int32)
    return BlockParts(quant_values(qtype, f), d, m, sc, mn)
