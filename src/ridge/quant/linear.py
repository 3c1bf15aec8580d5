"""Linear layers over quantized weights, and the swap that puts them into a model.

On the CPU each format runs on a weight-only kernel that streams the codes and dequantizes in registers:
- in bfloat16 on CPUs with AVX512-BF16, 4-bit codes per group (RTN int4, GGUF Q4_0 / Q4_1 / Q4_K) and 8-bit ones
  per channel, per group of 32s or of 16 (RTN int8, GGUF Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0; a tied embedding table
  then reads its rows from the head's layout): ridge's bf16_dot_linear (kernels/bf16_dot_linear.cpp, on bf16 dot
  products over pack_vnni's layout; exact, but for a decode batch's rows of 8-bit codes in groups, GGUF's, which
  multiply the weight rounded to bf16 as a bf16 model's) below BF16_DOT_TILED_MIN_ROWS rows; past them (prompts)
  the weight is dequantized to bf16 in oneDNN's packed form, a scratch shared by the layers of its shape
  (share_prompt_scratch), and multiplied on oneDNN's kernels as a bf16 model's packed weights are (else in tiles,
  as below);
- int8 per output channel elsewhere: ridge's grouped kernel with one group a row where ridge's kernels are built
  (faster than torch's at every row count measured), else torch's aten._weight_int8pack_mm (gpt-fast's, torchao's);
- 4-bit codes per group elsewhere: torch's aten._weight_int4pack_mm_for_cpu, on a tiled layout that torch converts
  to at load;
  both torch kernels dequantize again for every few rows and do not reach AMX: from TILED_MIN_ROWS rows on
  (large batches, prefill) ridge's kernels dequantize a tile of the weight once and multiply it by
  oneDNN's bf16 matmul instead (kernels/quant_linear.cpp; 2-2.6x faster at 32 rows);
- int8 codes per group otherwise (float32, a shape pack_vnni's layout does not take, ...): ridge's grouped_int8_linear
  (kernels/quant_linear.cpp), as torch has no kernel for grouped int8 scales; in float32, every int8 and
  4-bit format too (the 4-bit codes two a byte, pack_nibbles), as torch's two kernels are slow there;
- on request (EngineConfig.int8_activations), layers quantize their input to int8 per 32 values and multiply
  integers (llama.cpp's arithmetic), not exact (kernels/int8_dot_linear.cpp states the error bound). Where
  the CPU has AVX512-VNNI, every int8 / 4-bit / GGUF layer in float32 or bfloat16 moves onto an integer
  matrix kernel (kernels/vnni_linear.cpp, its own layout) at every row count: at batch 32 a bf16 matmul is
  bound by arithmetic, and integer products are what keep 4-bit weights ahead of it. On AVX2 the grouped
  kernel's float32 layers use an integer dot kernel (~2x faster at batch 1) for inputs of up to
  INT8_ACTIVATIONS_MAX_ROWS rows; prompts past it compute exactly, that kernel being slower there
  (`ridge eval ppl --int8-activations` lifts the limit, to score the integer arithmetic on its windows);
- fp8 e4m3 per output channel: the codes are widened to the activation dtype per call and the scale
  applied to the output. The CPU has no fp8 matmul; this halves weight memory against bfloat16, not
  decode time (fp8 is here for its quality and its checkpoints, which GPUs run natively).
Elsewhere (no compiler, not the CPU), a layer multiplies by its dequantized matrix: the same numbers at
the plain path's speed and memory.
"""

from __future__ import annotations

import logging
import math
import sys
from functools import cache
from types import ModuleType

import torch
from torch import nn
from tqdm import tqdm

from ridge.kernels import onednn_linear
from ridge.models.transformer import DecoderModel
from ridge.quant.awq import clipped_int4
from ridge.quant.gptq import gptq_quantize
from ridge.quant.rtn import QuantizedWeight, concatenate, dequantize, quantize_fp8, quantize_int4, quantize_int8

log = logging.getLogger("ridge")

METHODS = ("int8", "int4", "gptq", "awq", "fp8")  # quantize_model's methods
CALIBRATED = ("gptq", "awq")  # methods that need X^T X statistics (quant/calibration.py)
FLOAT32_KERNEL_MAX_ROWS = 16  # float32 int8 / int4 inputs with more rows go through the dequantized weight
TILED_MIN_ROWS = 16  # bf16 int8 / int4 inputs with this many rows go through ridge's tiled kernels (measured
                     # crossover on a 1536 x 576 layer: int4 16 rows 0.17 ms either way, int8 0.18 vs 0.12 ms)
# int8 activations up to this many rows; past it the exact grouped kernel, which ran as fast at 48 rows and 1.5x
# faster at 512 (int4 g32, 3072 x 576 and 576 x 1536, AVX2): the integer kernel is built for decode's few rows,
# as llama.cpp hands large batches to float BLAS. So prompts compute exactly, decodes on integers
INT8_ACTIVATIONS_MAX_ROWS = 32
# bf16_dot layers multiply inputs of this many rows (prompts) by tiles of the weight dequantized to bf16 on oneDNN's
# matmul (kernels/quant_linear.cpp's vnni_tiled_linear): SmolLM2's 30 layers' shapes against oneDNN's packed bf16,
# bf16_dot 1.07-1.13x at 256 rows, 1.12x at 512, 1.12-1.22x at 2048; the tiles 1.16-1.19x, 1.08-1.09x, 0.99-1.10x
# (2-core Zen 4). 8-bit codes in groups of 32 (4864 x 896, 576 x 1536): bf16_dot 1.13-1.19x at 512 rows, 1.13-1.21x
# at 2048; the tiles 1.05-1.13x, 1.04-1.12x; per channel (the int8 heads) both about 1.05x at 512. Decode batches
# (max_num_seqs 128) stay below it, on the exact kernel
BF16_DOT_TILED_MIN_ROWS = 512


@cache
def int4pack_block_width() -> int:
    """Output channels per block of torch's CPU int4 layout, which ridge's tiled kernel reads back: 64 where
    torch's kernels run AVX512, 32 on AVX2 (torch picks at run time). Asked of torch itself: channel 32's
    code lands in the first byte only when a block holds 64 channels."""
    codes = torch.zeros(64, 64, dtype=torch.int32)
    codes[32, 0] = 1
    return 64 if torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)[0, 0].item() else 32


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (K in 32s) -> uint8 [N, K / 2], two a byte in the order kernels/vec.h states: byte i of
    each 32 columns holds column i (low nibble) and column i + 16 (high)."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).view(n, k // 32, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse: uint8 [N, K / 2] -> codes uint8 [N, K]."""
    n, half = packed.shape
    blocks = packed.view(n, half // 16, 1, 16)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).reshape(n, half * 2)


def unpack_int4pack(packed: torch.Tensor, n: int, k: int, width: int) -> torch.Tensor:
    """The codes uint8 [N, K] of torch's CPU int4 layout, as kernels/quant_linear.cpp's dequantize_int4pack
    states it (full blocks of `width` channels: byte j of a column holds channel j low and j + width / 2
    high; the last N % width channels: 2 j low, 2 j + 1 high)."""
    flat, full = packed.reshape(-1), n // width * width
    parts = []
    if full:
        block = flat[:full * k // 2].view(full // width, k, width // 2)
        parts.append(torch.cat([block & 0x0F, block >> 4], dim=2).transpose(1, 2).reshape(full, k))
    if n > full:
        block = flat[full * k // 2:].view(k, (n - full) // 2)
        parts.append(torch.stack([block & 0x0F, block >> 4], dim=2).reshape(k, n - full).T)
    return torch.cat(parts).contiguous()


def pack_vnni(codes: torch.Tensor, bits: int, scales: torch.Tensor, minimums: torch.Tensor | None,
              group: int) -> tuple[torch.Tensor, float]:
    """Codes [N, K] (N in 16s, K in 32s; unsigned bytes: signed int8 codes plus 128) with their scales and
    minimums [N, K / group] -> (uint8 [N / 16, K / max(group, 32), record bytes], unit): kernels/vnni_linear.cpp's
    records, each a header of float16 scales (and minimums), in `unit`s, padded to 64 bytes, then the codes in
    64-byte chunks, byte 4 n + j holding channel n's code at k0 + j and, 4-bit codes, at k0 + 4 + j in its high
    nibble."""
    n, k = codes.shape
    blocks, span = n // 16, max(group, 32)
    quads = codes.to(torch.uint8).view(blocks, 16, k // 4, 4).transpose(1, 2)  # [N / 16, K / 4, 16, 4]
    if bits == 4:
        pairs = quads.reshape(blocks, k // 8, 2, 16, 4)
        quads = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
    chunks = quads.reshape(blocks, k // span, -1)
    values = [scales] if minimums is None else [scales, minimums]
    top = max(float(v.abs().max()) for v in values)
    unit = 2.0 ** (math.frexp(top)[1] - 15) if top > 0 else 1.0  # the largest value lands in [2^14, 2^15)
    header = torch.cat([(v.float() / unit).reshape(blocks, 16, k // span, -1).permute(0, 2, 3, 1).half()
                        .reshape(blocks, k // span, -1).contiguous().view(torch.uint8) for v in values], dim=-1)
    header = nn.functional.pad(header, (0, -header.shape[-1] % 64))
    return torch.cat([header, chunks], dim=-1).contiguous(), unit


class QuantizedLinear(nn.Module):
    """y = x @ dequantize(weight).T + bias, computed by the format's kernel where one runs.

    The buffers are not persistent: they are a kernel's layout, not a checkpoint's."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 ops: ModuleType | None = None, use_kernel: bool = True, bf16_dot: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits, self.group_size = weight.bits, weight.group_size
        self.dtype = dtype
        self.bias = bias
        self.prompt_scratch: torch.Tensor | None = None  # share_prompt_scratch's, for bf16_dot at a prompt's rows
        # float32 on torch's int4 / int8 kernels (ridge's not built): the codes again, for inputs of many
        # rows. Those kernels are built for decode: at 512 rows the int4 one ran 50x slower than in bf16
        # (1.4 s for a 576x3072 layer); past a few rows, multiply by the dequantized weight.
        self.unpacked: QuantizedWeight | None = None
        on_cpu = use_kernel and weight.qweight.device.type == "cpu"
        self.ops = ops if on_cpu else None
        # ridge's tiled kernels for many bf16 rows (the grouped-int8 one needs K in 16s)
        self.tiled_ops = ops if on_cpu and dtype == torch.bfloat16 and self.in_features % 16 == 0 else None
        # ridge's grouped kernel: for grouped int8 scales, which torch has no kernel for, and in float32 for
        # every format, as torch's int8 / int4 kernels are built for bf16: in float32 they ran 1.6x / 7x
        # slower than the dense float32 matmul at batch 1 (3072 x 576, AVX2), the grouped kernel 2.3x faster than
        # it. 4-bit codes go two a byte (0.75 bytes a weight with float32 scales and minimums): as fast as a byte
        # each in the exact kernel, 1.1x faster in the integer one (SmolLM2 Q4_1 decode), and 1.16x the file
        grouped = on_cpu and ops is not None and (
            (dtype == torch.float32 and self.in_features % 16 == 0)
            or (weight.bits != 4 and weight.group_size is not None))  # GGUF Q5_0 / Q6_K / Q8_0 ... codes
        # exact on AVX512-BF16 dot products over pack_vnni's layout (kernels/bf16_dot_linear.cpp), the weight's own
        # scales in float16: 4-bit codes per group (torch's layout holds them in bf16); 8-bit ones per channel or per
        # group of 32s or of 16 (Q6_K). Against torch's int4 kernel and ridge's tiles (SmolLM2's 30 layers' shapes
        # streamed from memory, 2-core Zen 4): 1.4x faster at 1 row, 1.5-1.9x at 8-32 rows, even at 128-512 (prompts);
        # at 32 rows 1.1x faster than the dense bf16 matmul. Int8 vocabulary projections against the grouped kernel's
        # float path: 1.5x (SmolLM2) and 1.9x (Qwen2.5-0.5B) at 1 row, 1.3x at 4-8, even at 16; Q6_K (its codes each
        # one bf16, seven_bit): 1.45x at 1 row, 2.6x at 4, 1.39x at 32 on Qwen's 896 x 4864 in 0.9x the bytes
        # (docs/benchmarks.md)
        layout_group = weight.group_size or self.in_features
        bf16_dot_fits = (bf16_dot and on_cpu and ops is not None and dtype == torch.bfloat16
                         and weight.qweight.dtype != torch.float8_e4m3fn and ops.bf16_dot_available()
                         and self._vnni_shape_fits()
                         and (layout_group % 32 == 0 or (layout_group == 16 and weight.bits != 4)))
        if weight.qweight.dtype == torch.float8_e4m3fn:
            self.kernel = "fp8"
            self.register_buffer("qweight", weight.qweight.contiguous(), persistent=False)
            self.register_buffer("scales", weight.scales.to(dtype), persistent=False)
        elif bf16_dot_fits:
            self.kernel = "bf16_dot"
            codes = weight.qweight if weight.bits == 4 else weight.qweight.to(torch.int8)
            signed = weight.bits != 4 and bool((codes < 0).any())
            self._hold_vnni(codes, signed, weight.scales, weight.minimums, weight.group_size or self.in_features,
                            nibbles=weight.bits == 4)
        elif grouped:
            self.kernel = "grouped_int8"
            self.group_size = weight.group_size or self.in_features  # int8: one group per output channel
            if weight.bits == 4 and self.group_size % 32 == 0:
                codes, self.signed_codes = pack_nibbles(weight.qweight), False
            else:
                codes = weight.qweight.to(torch.int8).contiguous()
                self.signed_codes = bool((codes < 0).any())  # the integer kernel's two forms
            self.register_buffer("qweight", codes, persistent=False)
            self.int8_activations = False  # use_int8_activations, for inputs of up to int8_activation_max_rows
            self.int8_activation_max_rows = INT8_ACTIVATIONS_MAX_ROWS
            self.register_buffer("scales", weight.scales.float().reshape(self.out_features, -1).contiguous(),
                                 persistent=False)
            minimums = weight.minimums if weight.minimums is not None else torch.empty(0)
            self.register_buffer("minimums", minimums.float().contiguous(), persistent=False)
        elif on_cpu and weight.group_size is None:
            self.kernel = "int8"
            self.register_buffer("qweight", weight.qweight.contiguous(), persistent=False)
            self.register_buffer("scales", weight.scales.to(dtype), persistent=False)
            # ridge's grouped kernel's form of the same scales: one group spanning the row, in float32
            self.register_buffer("channel_scales", weight.scales.float()[:, None].contiguous(), persistent=False)
            self.register_buffer("no_minimums", torch.empty(0), persistent=False)
            self.unpacked = weight if dtype == torch.float32 else None
        elif on_cpu and weight.bits == 4:
            self.kernel = "int4"
            # the kernel packs rows by 16: pad with zero rows, whose outputs forward() drops
            pad = -self.out_features % 16
            codes = nn.functional.pad(weight.qweight.to(torch.int32), (0, 0, 0, pad)).contiguous()
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1),
                                 persistent=False)
            self.block_width = int4pack_block_width()
            # its zero point is the value of code 8: w = (q - 8) * scale + zero
            zeros = weight.minimums + 8 * weight.scales
            pairs = nn.functional.pad(torch.stack([weight.scales, zeros], dim=-1), (0, 0, 0, 0, 0, pad))
            self.register_buffer("scales_and_zeros", pairs.transpose(0, 1).contiguous().to(dtype),  # [G, N, 2]
                                 persistent=False)
            self.unpacked = weight if dtype == torch.float32 else None
        else:
            self.kernel = None
            self.register_buffer("dense", dequantize(weight).to(dtype), persistent=False)

    def use_vnni(self) -> bool:
        """Move the layer onto kernels/vnni_linear.cpp (int8 activations, at every row count: the integer
        matrix kernel is the faster one at prompts' rows too, and llama.cpp's CPU backend quantizes a prompt's
        activations as well) where ridge's kernels have it and its layout fits (N in 16s, K in 32s, groups of
        16 or 32s); returns whether it did."""
        if self.ops is None or not self.ops.vnni_available():
            return False
        if self.kernel != "bf16_dot" and not self._repack_vnni():  # bf16_dot: the layout is there already
            return False
        self.kernel = "vnni"
        self.int8_activations, self.int8_activation_max_rows = True, sys.maxsize
        return True

    def _repack_vnni(self) -> bool:
        """The codes, scales and minimums into pack_vnni's layout (self.vnni), replacing the layer's own buffers:
        the layer holds only the new layout. False, and nothing changed, where the layout does not fit."""
        if not self._vnni_shape_fits():
            return False
        group = self.group_size or self.in_features
        nibbles = self.qweight.dtype == torch.uint8  # grouped_int8's 4-bit codes two a byte
        if self.kernel == "grouped_int8" and (group % 32 == 0 or (group == 16 and not nibbles)):
            codes = unpack_nibbles(self.qweight) if nibbles else self.qweight
            scales, minimums, signed = self.scales, self.minimums if self.minimums.numel() else None, self.signed_codes
        elif self.kernel == "int8":  # one group spanning each row
            codes, scales, minimums, signed, nibbles = self.qweight, self.channel_scales, None, True, False
        elif self.kernel == "int4" and self.scales_and_zeros.shape[1] == self.out_features and group % 32 == 0:
            codes, nibbles, signed = unpack_int4pack(self.qweight, self.out_features, self.in_features,
                                                     self.block_width), True, False
            scale, zero = self.scales_and_zeros.float().unbind(-1)  # [G, N] each: w = (code - 8) * scale + zero
            scales, minimums = scale.T, (zero - 8 * scale).T
        else:
            return False
        for name in ("scales_and_zeros", "channel_scales", "no_minimums", "scales", "minimums"):
            self._buffers.pop(name, None)
        self._hold_vnni(codes, signed, scales, minimums, group, nibbles)
        return True

    def _vnni_shape_fits(self) -> bool:
        """pack_vnni's layout takes output channels in blocks of 16 and inputs in chunks of 32 columns."""
        return self.out_features % 16 == 0 and self.in_features % 32 == 0

    def _hold_vnni(self, codes: torch.Tensor, signed: bool, scales: torch.Tensor, minimums: torch.Tensor | None,
                   group: int, nibbles: bool) -> None:
        """Codes [N, K] (4-bit ones where nibbles) with their scales and minimums [N, K / group], as the layer's
        only weight: pack_vnni's layout (self.qweight, self.vnni)."""
        stored = codes.to(torch.int16) + 128 if signed else codes  # vpdpbusd's unsigned operand
        packed, unit = pack_vnni(stored, 4 if nibbles else 8, scales.reshape(self.out_features, -1),
                                 None if minimums is None else minimums.reshape(self.out_features, -1), group)
        self.register_buffer("qweight", packed, persistent=False)  # the bytes; self.vnni refers to the same tensor
        # GGUF's 5- and 6-bit codes fit 7 bits: bf16_dot_linear takes each as one bf16, not as two nibbles
        low, high = (-64, 63) if signed else (0, 127)
        seven_bit = not nibbles and low <= int(codes.min()) and int(codes.max()) <= high
        self.vnni = self.ops.VnniWeight(packed, group, nibbles, signed, minimums is not None, unit, seven_bit)
        self.group_size, self.signed_codes, self.unpacked = group, signed, None

    @property
    def weight_bytes(self) -> int:
        """Bytes a forward pass streams from memory for the weight (as held, padding aside)."""
        if self.kernel is None:
            return self.dense.nbytes
        # channel_scales: int8's scales again in the grouped kernel's form, read instead of `scales`
        return sum(b.nbytes for name, b in self.named_buffers() if name != "channel_scales")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode step calls this ~120 times: skip the reshapes, casts and slices that would be no-ops
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        many_rows = self.tiled_ops is not None and x2.shape[0] >= TILED_MIN_ROWS
        if self.kernel == "bf16_dot":
            if x2.shape[0] < BF16_DOT_TILED_MIN_ROWS:
                out = self.ops.bf16_dot_linear(x2, self.vnni)
            elif self.prompt_scratch is not None:
                self.ops.vnni_dequantize_onednn_(self.prompt_scratch, self.vnni)
                out = torch.ops.mkldnn._linear_pointwise(x2, self.prompt_scratch, None, "none", [], "")
            else:
                out = self.ops.vnni_tiled_linear(x2, self.vnni)
        elif self.kernel == "vnni":
            out = self.ops.vnni_linear(x2, self.vnni)
        elif self.kernel == "int4" and (many_rows or self.unpacked is None or x2.shape[0] <= FLOAT32_KERNEL_MAX_ROWS):
            out = (self.tiled_ops.int4pack_linear(x2, self.qweight, self.scales_and_zeros, self.group_size,
                                                  self.block_width)
                   if many_rows else
                   torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.scales_and_zeros))
            if out.shape[1] != self.out_features:  # the rows padded to 16 at load
                out = out[:, :self.out_features]
        elif self.kernel == "int8" and self.tiled_ops is not None:
            # ridge's kernel at every row count: its register path is faster than torch's at decode's few
            # rows too (Qwen2.5-0.5B's 151936 x 896 head, one row: 7.6 against 9.0 ms, Zen 4)
            out = self.tiled_ops.grouped_int8_linear(x2, self.qweight, self.channel_scales, self.no_minimums,
                                                     self.in_features)
        elif self.kernel is None:
            out = x2 @ self.dense.T
        elif self.unpacked is not None and x2.shape[0] > FLOAT32_KERNEL_MAX_ROWS:
            out = x2 @ dequantize(self.unpacked).T
        elif self.kernel == "fp8":
            out = (x2 @ self.qweight.to(self.dtype).T) * self.scales
        elif self.kernel == "int8":
            out = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        elif self.int8_activations and x2.shape[0] <= self.int8_activation_max_rows:
            out = self.ops.int8_dot_linear(x2, self.qweight, self.scales, self.minimums, self.group_size,
                                           self.signed_codes)
        else:
            out = self.ops.grouped_int8_linear(x2, self.qweight, self.scales, self.minimums, self.group_size)
        if self.bias is not None:
            out = out + self.bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)


class ConcatLinear(nn.Module):
    """A fused projection (q|k|v, gate|up) whose parts come in different formats (a GGUF file may store v
    at more bits than q and k): each part on its own kernel, outputs side by side."""

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = bias
        self.out_features = sum(p.out_features for p in parts)

    @property
    def weight_bytes(self) -> int:
        return sum(p.weight_bytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([p(x) for p in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias


def fused_linear(parts: list[QuantizedWeight], bias: torch.Tensor | None, dtype: torch.dtype,
                 ops: ModuleType | None) -> nn.Module:
    """One QuantizedLinear over the stacked parts where their formats allow it, else a ConcatLinear."""
    merged = concatenate(parts)
    if merged is not None:
        return QuantizedLinear(merged, bias, dtype, ops)
    groups: list[list[QuantizedWeight]] = []
    for part in parts:  # consecutive parts that stack, stacked
        if groups and concatenate([*groups[-1], part]) is not None:
            groups[-1].append(part)
        else:
            groups.append([part])
    return ConcatLinear([QuantizedLinear(concatenate(g), None, dtype, ops) for g in groups], bias)


class QuantizedEmbedding(nn.Module):
    """Token embeddings looked up from codes: a lookup reads a row per token, so it dequantizes those rows
    and nothing else. A tied output projection shares the codes: where it holds them in pack_vnni's layout
    (its own copy), the rows are read from that layout (kernels/quant_linear.cpp's vnni_rows, the layout's
    float16 scales) and `weight` is not kept."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, tied: QuantizedLinear | None = None) -> None:
        super().__init__()
        self.dtype = dtype
        vnni = tied is not None and tied.kernel in ("bf16_dot", "vnni")
        # the tied layer's weight and kernels, not the layer: a submodule would be the head twice in the model
        self.tied = (tied.vnni, tied.ops, tied.in_features) if vnni else None
        self.weight_q = None if vnni else weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.tied is not None:
            vnni, ops, k = self.tied
            return ops.vnni_rows(vnni, flat, k).to(self.dtype).view(*ids.shape, -1)
        w = self.weight_q
        # index_select, not w.qweight[flat]: advanced indexing cost ~30 us a tensor, three per decode step
        rows = QuantizedWeight(w.qweight.index_select(0, flat), w.scales.index_select(0, flat),
                               None if w.minimums is None else w.minimums.index_select(0, flat), w.bits, w.group_size)
        return dequantize(rows).to(self.dtype).view(*ids.shape, -1)


def share_prompt_scratch(layers: nn.Module, ops: ModuleType) -> int:
    """Give each linear of the decoder layers on bf16 dot products a scratch in oneDNN's packed bf16 form, one per
    shape, shared by the linears of that shape (they run one at a time), into which its weight is dequantized at a
    prompt's rows. At 2,048 rows Qwen2.5-0.5B's four shapes multiplied 1.06-1.10x faster on it than on plain tiles,
    near the bf16 model's packed weights (docs/benchmarks.md). The output projection is not among them: it sees a
    prompt's rows only where the prompt is scored, and its scratch would be the largest. Returns the scratch bytes."""
    scratches: dict[tuple[int, int], torch.Tensor | None] = {}
    for module in layers.modules():
        if isinstance(module, QuantizedLinear) and module.kernel == "bf16_dot":
            shape = (module.out_features, module.in_features)
            if shape not in scratches:
                scratches[shape] = onednn_linear.prompt_scratch(*shape, ops)
            module.prompt_scratch = scratches[shape]
    return sum(2 * n * k for (n, k), scratch in scratches.items() if scratch is not None)


def use_int8_activations(model: nn.Module, max_rows: int = INT8_ACTIVATIONS_MAX_ROWS) -> int:
    """Put the model's quantized layers on int8 activations; returns how many layers that is. Where the CPU
    has AVX512-VNNI, every layer whose layout fits moves onto the integer matrix kernel, in float32 and
    bfloat16, at every row count; elsewhere the grouped-kernel layers (float32, K in 32s, groups of 16 or 32s)
    go onto the AVX2 integer kernel for inputs of up to max_rows rows."""
    switched = 0
    for layer in model.modules():
        if isinstance(layer, QuantizedLinear) and (layer.kernel == "vnni" or layer.use_vnni()):
            switched += 1
        elif (isinstance(layer, QuantizedLinear) and layer.kernel == "grouped_int8" and layer.dtype == torch.float32
                and layer.in_features % 32 == 0 and (layer.group_size == 16 or layer.group_size % 32 == 0)
                and layer.ops.int8_dot_available()):
            layer.int8_activations, layer.int8_activation_max_rows = True, max_rows
            switched += 1
    return switched


def quantize_weight(weight: torch.Tensor, method: str, group_size: int,
                    hessian: torch.Tensor | None = None, importance: torch.Tensor | None = None) -> QuantizedWeight:
    """One [out, in] matrix in `method`'s format. awq: the weight and hessian must already carry their AWQ
    scales (quant/awq.py's scale_layer); what is left is int4 with each group's range clipped. int4 at load
    has float minimums: no checkpoint constrains it (quant/rtn.py). int8 / fp8: `importance`, if given, the
    mean x^2 of each input column, by which each row's scale is chosen (quant/rtn.py)."""
    if method == "int8":
        return quantize_int8(weight, importance)
    if method == "int4":
        return quantize_int4(weight, group_size)
    if method == "awq":
        if hessian is None:
            raise ValueError("quantization: awq needs calibration statistics (quant/calibration.py)")
        return clipped_int4(weight, group_size, hessian, integer_zeros=False)
    if method == "fp8":
        return quantize_fp8(weight, importance)
    if method == "gptq":
        if hessian is None:
            raise ValueError("quantization: gptq needs calibration statistics (quant/calibration.py)")
        return gptq_quantize(weight, hessian, 4, group_size, act_order=True)  # see quant/gptq.py
    raise ValueError(f"quantization: {method!r} is not one of {', '.join(METHODS)}")


# The vocabulary projection's format under every method: int8 per channel. llama.cpp's Q4 files keep it at
# Q6_K / Q8_0 and GPTQ / AWQ / fp8 checkpoints leave it unquantized, for it is the layer whose errors reach
# the logits directly; but on a small model it is a fifth of the weights, too many bytes to leave at 16 bits.
# At one byte a weight, int8 with a scale per row is the more accurate of the two 8-bit formats for it
# (SmolLM2 under fp8: +1.6% perplexity with the head at int8, +2.4% with it at fp8; docs/benchmarks.md).
HEAD_METHOD = "int8"
HEAD = "output_projection"  # the vocabulary projection's key among the layers' (its input: the final norm's output)


def quantize_model(model: DecoderModel, method: str, group_size: int, dtype: torch.dtype,
                   use_kernel: bool = True, fitted: dict[str, QuantizedWeight] | None = None,
                   importance: dict[str, torch.Tensor] | None = None, progress: bool = False,
                   ops: ModuleType | None = None) -> DecoderModel:
    """Swap every nn.Linear of the decoder layers, and the output projection, for a QuantizedLinear in place.
    gptq and awq need the layers' weights as quant/calibration.py's quantize_layerwise `fitted` them (keyed
    as it names the layers; for awq, the model already holds the scales folded in); `importance`, keyed the
    same way (and HEAD), quant/calibration.py's input_importance: the int8 and fp8 weights' rows, and the
    head's, get the scales it weighs best; `ops`: ridge's CPU kernels (kernels/cpu_ops.py), for the tiled
    many-row path. The embedding table stays as it is: a lookup reads one row per token, not the whole table."""
    if method not in METHODS:
        raise ValueError(f"quantization: {method!r} is not one of {', '.join(METHODS)}")
    if method in CALIBRATED and not fitted:
        raise ValueError(f"quantization: {method} needs calibration (quant/calibration.py)")
    fitted, importance = fitted or {}, importance or {}
    model.output_projection = QuantizedLinear(
        quantize_weight(model.output_weight.data, HEAD_METHOD, group_size, importance=importance.get(HEAD)), None,
        dtype, ops, use_kernel=use_kernel)
    for i, layer in enumerate(tqdm(model.layers, desc=method, unit="layer", disable=not progress)):
        for parent_name, parent in list(layer.named_modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    key = ".".join(part for part in ("layers", str(i), parent_name, name) if part)
                    qw = fitted[key] if key in fitted else quantize_weight(child.weight.data, method, group_size,
                                                                           importance=importance.get(key))
                    setattr(parent, name, QuantizedLinear(qw, child.bias, dtype, ops, use_kernel))
    return model
