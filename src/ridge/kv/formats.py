"""KV-cache formats (`--kv-cache-dtype`): how one head's K and V of a token are stored.

`auto` keeps the model's dtype. The quantized formats store a row as codes plus float16 scales, one scale per
`group` values along the head dim, symmetric (value = code x scale, scale = the group's largest magnitude over
the code's largest):
  fp8   float8 e4m3 codes (vLLM's fp8), one scale per row (amax / 448)
  int8  one scale per row (amax / 127) for values; keys per channel (below)
  int4  two codes a byte, one scale per 32 values (amax / 7) for values; keys per channel (below)
  int2  four codes a byte, levels +-0.5 and +-1.5 times the scale, around a midrange (below): for values a scale and
        a midrange per 32 values; keys per channel (below); experimental (KIVI): a block is quantized when full
A row is written once, when its token enters the cache, and its scales with it, so the granularity is per token
and head (per 32 values for int4), for 2 bytes a scale: an int8 value row of 64 dims takes 66 bytes.

int8 and int4 keys are scaled per channel of a block instead (KIVI's observation: keys vary by channel, values by
token; one scale per row is set by the row's largest channel and leaves the others a few levels): one scale per
channel over the block's keys, in a byte (2^(e/8 - 20), rounded up, so nothing clips). fp8 keeps a scale per row:
its rounding is relative to each value already. A block fills a token at a time, so its channel scales grow as
keys arrive: a key beyond a scale at least doubles it, and the block's earlier keys in that channel are requantized
to the new scale (attention/quantized_kv.py); a block written whole rounds once. Bytes for 64 dims and blocks of
16: an int8 key 64 codes plus 4 bytes of its block's scales (1.91x bf16's tokens with the value rows), an int4
key 32 + 4, a value row 36 (3.56x), an int2 key 16 + 4 + 8 (its block's midranges), a value row 24 (4.9x).

int2 keeps a sequence's last, partly filled block in the model's dtype (its tail, a slot per running sequence:
attention/quantized_kv.py), as KIVI keeps its most recent tokens in full precision: two bits cannot absorb the
regrowth of a block's channel scales as its keys arrive, and the newest tokens are the ones attention weighs most.
The block is quantized whole, once, when its last row arrives. Four levels and no zero: a symmetric grid of 2 bits
either wastes a level on zero or has none; centered keys and values rarely sit at exactly zero. Its keys and values
are stored less their midrange ((max + min) / 2, a float16 per channel of a block for keys, per group of a row for
values; value = code x scale + midrange), so that the four levels span max - min rather than -amax..amax (KIVI's
asymmetric grid; the scale is half the range over 1.5): rotary turns a key channel slowly, so over 16 tokens a
channel is often an offset plus a little, which a symmetric grid rounds to the one level nearest the offset
(what each step cost in perplexity: docs/notes/kv-compression.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16
CHANNEL_SCALE_STEPS = 8  # a channel scale byte e > 0 holds 2^(e / 8 - 20): steps of 9%, 1e-6 to 3,800; 0 holds 0
CHANNEL_SCALE_BIAS = 20


# 2^(e / 8 - 20) for every byte e (0 holds 0), each rounded once from float64, as the C++ write's table is
# (kernels/quantized_attention.cpp): torch's float32 exp2 is an ulp off at some e (and its vector and scalar paths
# disagree), and a value at a rounding tie would then take another code in one write than in the other.
CHANNEL_SCALE_TABLE = torch.exp2(torch.arange(256, dtype=torch.float64) / CHANNEL_SCALE_STEPS
                                 - CHANNEL_SCALE_BIAS).float()
CHANNEL_SCALE_TABLE[0] = 0.0


def encode_channel_scales(wanted: torch.Tensor) -> torch.Tensor:
    """Scales (float, >= 0) -> bytes of the smallest scale a byte holds that is >= wanted (so that no value clips;
    past the largest, the largest)."""
    table = CHANNEL_SCALE_TABLE.to(wanted.device)
    return torch.searchsorted(table, wanted.float().contiguous()).clamp_(max=255).to(torch.uint8)


def decode_channel_scales(e: torch.Tensor) -> torch.Tensor:
    return CHANNEL_SCALE_TABLE.to(e.device)[e.long()]


@dataclass(frozen=True)
class KVFormat:
    name: str
    bits: int  # per value
    group: int | None  # values per scale; None: one scale for the whole row
    code_max: float  # the largest magnitude a code holds
    key_channels: bool = False  # keys scaled per channel over a block, one byte a scale (above)
    tail: bool = False  # a block is quantized when full; until then its rows wait in the sequence's tail (above)
    mids: bool = False  # keys and values stored less their midranges (per channel of a block, per group), float16

    def groups(self, head_dim: int) -> int:
        return 1 if self.group is None else -(-head_dim // self.group)

    def code_bytes(self, head_dim: int) -> int:
        return head_dim * self.bits // 8

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one token's row of one head: its codes and scales (and midranges)."""
        return self.code_bytes(head_dim) + self.groups(head_dim) * SCALE_DTYPE.itemsize * (1 + self.mids)

    def block_bytes(self, head_dim: int, block_size: int) -> int:
        """Bytes of one KV head's block: block_size tokens' K and V codes and their scales."""
        keys = (block_size * self.code_bytes(head_dim) + head_dim * (1 + self.mids * SCALE_DTYPE.itemsize)
                if self.key_channels else block_size * self.row_bytes(head_dim))
        return keys + block_size * self.row_bytes(head_dim)

    def check(self, head_dim: int) -> None:
        if self.group is not None and head_dim % self.group:
            raise ValueError(f"kv_cache_dtype: {self.name} scales groups of {self.group} values; the model's head "
                             f"dim ({head_dim}) is not a multiple of it")

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., d] -> codes uint8 [..., code_bytes(d)], scales float16 [..., groups(d)]."""
        d = x.shape[-1]
        grouped = x.float().unflatten(-1, (self.groups(d), -1))  # [..., groups, values]
        # the scale as stored (float16), so that codes are made against the scale dequantization will use
        scales = (grouped.abs().amax(-1) / self.code_max).to(SCALE_DTYPE).clamp_(min=torch.finfo(SCALE_DTYPE).tiny)
        scaled = grouped / scales.float().unsqueeze(-1)
        return self.encode(scaled.flatten(-2)), scales

    def encode(self, scaled: torch.Tensor) -> torch.Tensor:
        """Values already divided by their scales [..., d] -> codes [..., code_bytes(d)]."""
        if self.name == "fp8":
            return scaled.clamp(-self.code_max, self.code_max).to(torch.float8_e4m3fn).view(torch.uint8)
        if self.bits == 8:
            return scaled.round().clamp_(-self.code_max, self.code_max).to(torch.int8).view(torch.uint8)
        if self.bits == 2:  # the nearest of -1.5, -0.5, 0.5, 1.5 as 0..3, four a byte: dim 4i + j in bits 2j
            levels = (scaled.floor().clamp_(-2, 1) + 2).to(torch.uint8).unflatten(-1, (-1, 4))
            return levels[..., 0] | levels[..., 1] << 2 | levels[..., 2] << 4 | levels[..., 3] << 6
        # two 4-bit codes a byte, offset to 1..15: the even dim in the low nibble
        pairs = (scaled.round().clamp_(-self.code_max, self.code_max) + 8).to(torch.uint8).unflatten(-1, (-1, 2))
        return pairs[..., 0] | (pairs[..., 1] << 4)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [..., code_bytes] -> the values they hold before scaling [..., d], float32."""
        if self.name == "fp8":
            return codes.view(torch.float8_e4m3fn).float()
        if self.bits == 8:
            return codes.view(torch.int8).float()
        if self.bits == 2:
            return torch.stack([codes >> shift & 3 for shift in (0, 2, 4, 6)], dim=-1).flatten(-2).float() - 1.5
        return torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).float() - 8

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """codes [..., code_bytes], scales [..., groups] -> values [..., d] in dtype."""
        grouped = self.decode(codes).unflatten(-1, (scales.shape[-1], -1)) * scales.float().unsqueeze(-1)
        return grouped.flatten(-2).to(dtype)


KV_FORMATS = {
    "fp8": KVFormat("fp8", 8, None, 448.0),
    "int8": KVFormat("int8", 8, None, 127.0, key_channels=True),
    "int4": KVFormat("int4", 4, 32, 7.0, key_channels=True),
    "int2": KVFormat("int2", 2, 32, 1.5, key_channels=True, tail=True, mids=True),
}
KV_CACHE_DTYPES = ("auto", *KV_FORMATS)


def kv_format(name: str) -> KVFormat | None:
    """The format of a --kv-cache-dtype (None: auto, the model's dtype)."""
    if name == "auto":
        return None
    if name not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype: {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_FORMATS[name]
