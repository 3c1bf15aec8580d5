"""KV-cache formats (`--kv-cache-dtype`): how one token's K or V row of one head is stored.

`auto` keeps the model's dtype. The quantized formats store a row as codes plus float16 scales, one scale per
`group` values along the head dim, symmetric (value = code x scale, scale = the group's largest magnitude over
the code's largest):
  fp8   float8 e4m3 codes (vLLM's fp8), one scale per row (amax / 448)
  int8  one scale per row (amax / 127)
  int4  two codes a byte, one scale per 32 values (amax / 7)
A row is written once, when its token enters the cache, and its scales with it: a block that fills token by
token never requantizes what it holds. So the granularity is per token and head (per 32 values for int4), finer
than a scale per block and head would be, for 2 bytes a scale: an int8 row of 64 dims takes 66 bytes against
bf16's 128 (1.94x the tokens), an int4 row 36 (3.56x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class KVFormat:
    name: str
    bits: int  # per value
    group: int | None  # values per scale; None: one scale for the whole row
    code_max: float  # the largest magnitude a code holds

    def groups(self, head_dim: int) -> int:
        return 1 if self.group is None else -(-head_dim // self.group)

    def code_bytes(self, head_dim: int) -> int:
        return head_dim * self.bits // 8

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one token's row of one head: its codes and scales."""
        return self.code_bytes(head_dim) + self.groups(head_dim) * SCALE_DTYPE.itemsize

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
        if self.name == "fp8":
            codes = scaled.clamp_(-self.code_max, self.code_max).to(torch.float8_e4m3fn).view(torch.uint8)
        elif self.bits == 8:
            codes = scaled.round_().clamp_(-self.code_max, self.code_max).to(torch.int8).view(torch.uint8)
        else:  # two 4-bit codes a byte, offset to 1..15: the even dim in the low nibble
            nibbles = (scaled.round_().clamp_(-self.code_max, self.code_max) + 8).to(torch.uint8)
            pairs = nibbles.flatten(-2).unflatten(-1, (-1, 2))
            codes = pairs[..., 0] | (pairs[..., 1] << 4)
        return codes.reshape(*x.shape[:-1], self.code_bytes(d)), scales

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """codes [..., code_bytes], scales [..., groups] -> values [..., d] in dtype."""
        if self.name == "fp8":
            values = codes.view(torch.float8_e4m3fn).float()
        elif self.bits == 8:
            values = codes.view(torch.int8).float()
        else:
            values = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).float() - 8
        grouped = values.unflatten(-1, (scales.shape[-1], -1)) * scales.float().unsqueeze(-1)
        return grouped.flatten(-2).to(dtype)


KV_FORMATS = {
    "fp8": KVFormat("fp8", 8, None, 448.0),
    "int8": KVFormat("int8", 8, None, 127.0),
    "int4": KVFormat("int4", 4, 32, 7.0),
}
KV_CACHE_DTYPES = ("auto", *KV_FORMATS)


def kv_format(name: str) -> KVFormat | None:
    """The format of a --kv-cache-dtype (None: auto, the model's dtype)."""
    if name == "auto":
        return None
    if name not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype: {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_FORMATS[name]
