"""Quantized weights on CUDA: every format (int8, int4, GPTQ, AWQ, fp8) on the Triton kernels of
kernels/quant_matmul.py, which read the codes and dequantize them in registers.

Scales and minimums are held in float16, as GPTQ / AWQ checkpoints and llama.cpp's blocks hold them: at
int4 per 32 weights, float32 ones would add half a byte per weight to the 4 bits a decode step reads.
"""

from __future__ import annotations

import logging
from functools import cached_property

import torch

from ridge.linear.base import KernelLinear
from ridge.quant.rtn import QuantizedWeight

log = logging.getLogger("ridge")


class TritonQuantLinear(KernelLinear):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        from ridge.triton_kernels import quant_matmul  # Triton comes with CUDA torch; only on this path

        super().__init__(*weight.shape, bias, dtype)
        self.ops = quant_matmul
        if weight.group_size is None and weight.minimums is not None:
            raise ValueError("quantization: per-channel codes with a minimum have no CUDA kernel")
        self.group_size = weight.group_size or 0
        codes = weight.qweight
        if codes.dtype == torch.float8_e4m3fn:
            self.kind, self.kernel = quant_matmul.FP8, "triton_fp8"
            codes = codes.view(torch.uint8)
        elif weight.bits == 4 and quant_matmul.fits(quant_matmul.NIBBLES, self.in_features, self.group_size):
            self.kind, self.kernel = quant_matmul.NIBBLES, "triton_int4"
            codes = quant_matmul.pack_nibbles(codes.to(torch.uint8))
        else:
            if weight.bits == 4:
                log.warning("ridge: a %d-column int4 layer in groups of %d holds a byte per code on CUDA (its halves "
                            "do not start groups): twice the bytes of packed nibbles", self.in_features,
                            self.group_size)
            self.kind, self.kernel = quant_matmul.BYTES, f"triton_int{weight.bits}"
        self.register_buffer("codes", codes.contiguous(), persistent=False)
        self.register_buffer("scales", weight.scales.half().contiguous(), persistent=False)
        minimums = None if weight.minimums is None else weight.minimums.half().contiguous()
        self.register_buffer("minimums", minimums, persistent=False)

    @cached_property
    def multiprocessors(self) -> int:
        return torch.cuda.get_device_properties(self.codes.device).multi_processor_count

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.quant_matmul(x.contiguous(), self.codes, self.kind, self.scales, self.minimums,
                                     self.group_size, self.out_features, self.multiprocessors)
