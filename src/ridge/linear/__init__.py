"""Linear layers: one small module per weight format and kernel, and one function that picks among them
(select.make_linear) for a weight on a target (dtype, device, CPU kernels and features, options)."""

from ridge.linear.base import ConcatLinear, KernelLinear, model_weight_bytes, native_linear, weight_bytes
from ridge.linear.dense import FewRowsLinear, PackedLinear
from ridge.linear.embedding import QuantizedEmbedding
from ridge.linear.quantized import DequantizedLinear, Fp8Linear, GroupedInt8Linear, Int4Linear, Int8Linear
from ridge.linear.select import LinearTarget, fused_linear, make_linear
from ridge.linear.vnni import Bf16DotLinear, VnniLinear

__all__ = ["Bf16DotLinear", "ConcatLinear", "DequantizedLinear", "FewRowsLinear", "Fp8Linear", "GroupedInt8Linear",
           "Int4Linear", "Int8Linear", "KernelLinear", "LinearTarget", "PackedLinear", "QuantizedEmbedding",
           "VnniLinear", "fused_linear", "make_linear", "model_weight_bytes", "native_linear", "weight_bytes"]
