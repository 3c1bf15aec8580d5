"""A model's file opened, and its weights loaded as the engine runs them: dtype, quantization, kernels."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from ridge.config import EngineConfig
from ridge.hub import resolve
from ridge.kernels import batch_invariance, dense_linear, onednn_linear
from ridge.models.gguf_file import GGUFFile
from ridge.models.loader import LoadedModel, load_model, open_gguf
from ridge.quant.calibration import (
    CALIBRATION_WINDOW,
    awq_layerwise,
    calibration_windows,
    input_importance,
    quantize_layerwise,
    windows_for,
)
from ridge.quant.linear import (
    CALIBRATED,
    METHODS,
    quantize_model,
    quantize_weight,
    share_prompt_scratch,
    use_int8_activations,
)
from ridge.tokenizer import RidgeTokenizer

log = logging.getLogger("ridge")


@dataclass
class ModelFile:
    """A model's file or directory, opened: its GGUF header parsed once (for tokenizer and weights), its
    tokenizer read, no weights loaded yet."""

    path: Path
    gguf: GGUFFile | None
    tokenizer: RidgeTokenizer

    @classmethod
    def open(cls, model: str) -> ModelFile:
        path = resolve(model)
        gguf = open_gguf(path) if path.is_file() else None
        return cls(path, gguf, RidgeTokenizer.from_path(path, gguf))



def load_weights(model: ModelFile, config: EngineConfig, kernels: ModuleType | None, progress: bool) -> LoadedModel:
    """A model's weights in the engine's dtype, packed for the CPU's matmuls, on ridge's kernels."""
    native = config.quantization == "gguf"
    loaded = load_model(model.path, config.torch_dtype, config.device, progress, model.gguf, gguf_native=native,
                        ops=kernels)
    if config.quantization in METHODS:
        fitted = importance = None
        method, group_size = config.quantization, config.quantization_group_size
        num_windows = windows_for(method, config.calibration_windows)  # 0 for int4, plain RTN
        windows = calibration_windows(model.tokenizer, num_windows, CALIBRATION_WINDOW, progress) if num_windows else []
        if method in CALIBRATED:  # calibrated here, one decoder layer at a time
            if method == "awq":
                fitted = awq_layerwise(loaded.model, windows, group_size, integer_zeros=False, dtype=config.torch_dtype,
                                       device=config.device, progress=progress)
            else:
                fitted = quantize_layerwise(loaded.model, windows,
                                            lambda _key, w, h: quantize_weight(w, method, group_size, h),
                                            config.torch_dtype, config.device, progress)
        elif windows:  # int8 and fp8: each row's scale weighed by its columns' importance, in one pass
            importance = input_importance(loaded.model, windows, config.torch_dtype, config.device, progress)
        quantize_model(loaded.model, method, group_size, config.torch_dtype, fitted=fitted, importance=importance,
                       progress=progress, ops=kernels)
        loaded.weight_format += f" -> {config.quantization}" + (
            f" g{config.quantization_group_size}" if config.quantization not in ("int8", "fp8") else "")
    elif config.packed_linear and onednn_linear.available(config.torch_dtype, config.device):
        # natively quantized layers are left as they are; batch invariance keeps oneDNN off its single-row path
        onednn_linear.pack_linears(loaded.model, min_rows=2 if config.batch_invariant else 1)
    if config.int8_activations:
        if kernels is None or not use_int8_activations(loaded.model):
            raise ValueError("int8_activations: needs quantized weights (--quantization, or a quantized "
                             "checkpoint) and ridge's CPU kernels: built for AVX512-VNNI (float32 or bfloat16), "
                             "or for AVX2 (float32)")
        loaded.weight_format += ", int8 activations"
    if kernels is not None and config.torch_dtype == torch.float32:
        dense_linear.use_kernel(loaded.model, kernels, every_row=config.batch_invariant)  # the layers still dense
    packs = kernels is not None and onednn_linear.available(config.torch_dtype, config.device)
    if packs and (scratch_bytes := share_prompt_scratch(loaded.model.layers, kernels)):
        log.info("ridge: prompts multiply quantized weights on oneDNN's packed layout (%.0f MiB of scratch)",
                 scratch_bytes / 2**20)
    loaded.model.use_kernels(kernels)
    if config.batch_invariant:
        batch_invariance.verify(loaded.model, config.torch_dtype)
        loaded.weight_format += ", batch invariant"
    return loaded
