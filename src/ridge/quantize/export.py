"""`ridge quantize`: a model (GGUF file or HF directory) -> an HF-format directory of quantized safetensors
(quant/checkpoint.py's layouts) with its config.json and tokenizer, which ridge, vLLM and HF transformers
load like any quantized checkpoint.

The model is quantized in float32 from the weights as loaded (a GGUF file's are dequantized first). Only
the decoder layers' linear weights are quantized; embeddings, norms, biases and an untied vocabulary
projection are written as float16, as GPTQ / AWQ checkpoints leave them (quantization_config.lm_head false).
int4 zero points are integers (qzeros), where ridge's at-load int4 keeps float minimums (quant/rtn.py): a
checkpoint's int4 is the less accurate of the two.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ridge.config import ModelConfig
from ridge.models.loader import load_model
from ridge.models.transformer import DecoderModel
from ridge.quant import checkpoint
from ridge.quant.gptq import gptq_quantize
from ridge.quant.rtn import QuantizedWeight, check_group_size, quantize_fp8, quantize_int4, quantize_int8
from ridge.quantize.awq_layers import check_model as check_awq_layers
from ridge.quantize.calibration import (
    CALIBRATION_WINDOW,
    awq_layerwise,
    calibration_windows,
    quantize_layerwise,
    windows_for,
)
from ridge.tokenizer import RidgeTokenizer

# method -> (checkpoint layout, bit widths it writes)
METHODS: dict[str, tuple[str, tuple[int, ...]]] = {
    "rtn": ("gptq", (4, 8)), "gptq": ("gptq", (4, 8)), "awq": ("awq", (4,)), "fp8": ("fp8", (8,)),
}
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "chat_template.jinja", "chat_template.json")


@dataclass
class QuantizeReport:
    out: Path
    method: str
    layout: str
    bits: int
    group_size: int | None
    layers: int  # linear weights quantized
    bytes: int  # of the safetensors written
    seconds: float


def check_arguments(method: str, bits: int, group_size: int | None, fp8: bool = False) -> None:
    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not one of {', '.join(METHODS)}")
    if fp8 and method not in ("rtn", "gptq", "fp8"):
        raise ValueError(f"fp8: e4m3 codes come from rtn or gptq rounding, not {method}")
    widths = (8,) if fp8 else METHODS[method][1]
    if bits not in widths:
        raise ValueError(f"bits: {'fp8' if fp8 else method} writes {' or '.join(map(str, widths))}-bit weights, "
                         f"not {bits}")
    if bits == 4 and group_size is None:
        raise ValueError("group_size: 4-bit weights need one (32, 64 or 128)")


def quantize_to_dir(model_path: Path, method: str, bits: int, group_size: int | None, out: Path,
                    num_windows: int | None = None, progress: bool = True, fp8: bool = False,
                    damp: float | None = None) -> QuantizeReport:
    """Quantize every decoder-layer linear weight of the model at `model_path` and write the checkpoint to
    `out` (created; an existing config.json there is refused). group_size is ignored at 8 bits (per channel).
    fp8: e4m3 codes, rounded by `method` (rtn or gptq; method fp8 is rtn with fp8). damp: GPTQ's dampening
    (None: quant/gptq.py's default for the format). num_windows: calibration windows (None: the method's own)."""
    fp8 = fp8 or method == "fp8"
    check_arguments(method, bits, group_size, fp8)
    group_size = group_size if bits == 4 else None
    if (out / "config.json").exists():
        raise ValueError(f"out: {out} already holds a model (config.json); choose an empty directory")
    start = time.perf_counter()
    loaded = load_model(model_path, torch.float32, progress=progress)
    model, cfg = loaded.model, loaded.config
    if cfg.architecture not in _HF_ARCHITECTURES:  # the names and config written below are these families'
        raise ValueError(f"model: `ridge quantize` writes {', '.join(_HF_ARCHITECTURES)} checkpoints; "
                         f"{cfg.architecture} models quantize at load instead (--quantization)")
    if group_size is not None:
        for name, module in model.layers[0].named_modules():
            if isinstance(module, torch.nn.Linear):
                check_group_size(module.in_features, group_size, f" of {name}")
    tokenizer = RidgeTokenizer.from_path(model_path)
    fitted: dict[str, QuantizedWeight] = {}
    if method == "awq":
        check_awq_layers(model.layers)
    if method in ("gptq", "awq"):
        windows = calibration_windows(tokenizer, windows_for(method, num_windows), CALIBRATION_WINDOW, progress)
    if method == "gptq":
        fitted = quantize_layerwise(
            model, windows,
            lambda _key, w, h: gptq_quantize(w, h, bits, group_size, act_order=True, damp=damp, integer_zeros=True,
                                             fp8=fp8),
            torch.float32, "cpu", progress)
    if method == "awq":  # the scales folded into the norms and up rows, which _hf_tensors writes as they are now
        fitted = awq_layerwise(model, windows, group_size, integer_zeros=True, dtype=torch.float32, device="cpu",
                               progress=progress)

    def quantize(weight: torch.Tensor, key: str) -> QuantizedWeight:
        if key in fitted:
            return fitted[key]
        if fp8:
            return quantize_fp8(weight)
        return quantize_int4(weight, group_size, integer_zeros=True) if bits == 4 else quantize_int8(weight)

    layout = "fp8" if fp8 else METHODS[method][0]
    pack = {"gptq": checkpoint.pack_gptq, "awq": checkpoint.pack_awq, "fp8": checkpoint.pack_fp8}[layout]
    tensors, layers = _checkpoint_tensors(model, cfg, quantize, pack, progress)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = _hf_config(model_path, cfg, tokenizer)
    config["quantization_config"] = checkpoint.quantization_config(layout, bits, group_size, method == "gptq")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer(model_path, tokenizer, out)
    return QuantizeReport(out, method, layout, bits, group_size, layers, (out / "model.safetensors").stat().st_size,
                          time.perf_counter() - start)


def _checkpoint_tensors(model: DecoderModel, cfg: ModelConfig, quantize, pack,
                        progress: bool) -> tuple[dict[str, torch.Tensor], int]:
    """The checkpoint's tensors: quantized weights in the layout's packed parts, the rest in float16; and the
    number of quantized layers."""
    tensors: dict[str, torch.Tensor] = {}
    layers = 0
    for name, value in tqdm(list(_hf_tensors(model, cfg, quantize)), desc="write", unit="tensor",
                            disable=not progress, leave=False):
        if isinstance(value, QuantizedWeight):
            module = name.removesuffix(".weight")
            tensors.update({f"{module}.{part}": t for part, t in pack(value).items()})
            layers += 1
        else:
            tensors[name] = value.to(torch.float16).contiguous()
    return tensors, layers


def _hf_tensors(model: DecoderModel, cfg: ModelConfig,
                quantize) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The model's weights under HF transformers' names, fused projections split again; quantize(weight,
    calibration key) is applied to the decoder layers' linear weights (fused ones before the split: every
    format here quantizes rows independently, and AWQ shares one input scale across the fused parts)."""
    yield "model.embed_tokens.weight", model.embed_tokens.weight
    yield "model.norm.weight", model.norm.weight
    if model.lm_head is not None:
        yield "lm_head.weight", model.lm_head.weight
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i, layer in enumerate(model.layers):
        prefix, attn = f"model.layers.{i}", layer.attn
        yield f"{prefix}.input_layernorm.weight", layer.input_norm.weight
        yield f"{prefix}.post_attention_layernorm.weight", layer.post_attn_norm.weight
        qkv = quantize(attn.qkv.weight, f"layers.{i}.attn.qkv")
        bounds = {"q_proj": (0, q_size), "k_proj": (q_size, q_size + kv_size),
                  "v_proj": (q_size + kv_size, q_size + 2 * kv_size)}
        for name, (lo, hi) in bounds.items():
            yield f"{prefix}.self_attn.{name}.weight", _rows(qkv, lo, hi)
            if attn.qkv.bias is not None:
                yield f"{prefix}.self_attn.{name}.bias", attn.qkv.bias[lo:hi]
        yield f"{prefix}.self_attn.o_proj.weight", quantize(attn.o_proj.weight, f"layers.{i}.attn.o_proj")
        for norm in ("q_norm", "k_norm"):
            if getattr(attn, norm) is not None:
                yield f"{prefix}.self_attn.{norm}.weight", getattr(attn, norm).weight
        gate_up = quantize(layer.mlp.gate_up.weight, f"layers.{i}.mlp.gate_up")
        f = cfg.intermediate_size
        yield f"{prefix}.mlp.gate_proj.weight", _rows(gate_up, 0, f)
        yield f"{prefix}.mlp.up_proj.weight", _rows(gate_up, f, 2 * f)
        yield f"{prefix}.mlp.down_proj.weight", quantize(layer.mlp.down.weight, f"layers.{i}.mlp.down")


def _rows(qw: QuantizedWeight, lo: int, hi: int) -> QuantizedWeight:
    return dataclasses.replace(qw, qweight=qw.qweight[lo:hi], scales=qw.scales[lo:hi],
                               minimums=None if qw.minimums is None else qw.minimums[lo:hi])


def _hf_config(model_path: Path, cfg: ModelConfig, tokenizer: RidgeTokenizer) -> dict[str, Any]:
    """The source's own config.json where it has one; else one written from the GGUF header's fields."""
    if model_path.is_dir():
        config = json.loads((model_path / "config.json").read_text())
        config.pop("quantization_config", None)
        config["torch_dtype"] = "float16"
        return config
    config: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURES[cfg.architecture]], "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": "float16", "bos_token_id": tokenizer.info.bos_token_id,
        "eos_token_id": tokenizer.info.eos_token_id,
    }
    if cfg.architecture == "llama":
        config["attention_bias"] = cfg.qkv_bias
    if (scaling := cfg.rope_scaling) is not None:
        if scaling.frequency_divisors:
            raise ValueError(f"{model_path.name}: its rotary scaling is stored as divisors (rope_freqs), which an "
                             "HF config cannot say; export from the HF checkpoint instead")
        config["rope_scaling"] = {"rope_type": scaling.kind, "factor": scaling.factor,
                                  "original_max_position_embeddings": scaling.original_max_positions}
        if scaling.kind == "yarn":
            config["rope_scaling"].update(beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow)
    return config


def _write_tokenizer(model_path: Path, tokenizer: RidgeTokenizer, out: Path) -> None:
    if model_path.is_dir():
        for name in _TOKENIZER_FILES:
            if (model_path / name).exists():
                shutil.copy(model_path / name, out / name)
        return
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    info = tokenizer.info

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.tokenizer.id_to_token(token_id)

    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text(info.bos_token_id),
        "eos_token": text(info.eos_token_id), "add_bos_token": info.add_bos, "chat_template": info.chat_template,
    }, indent=2) + "\n")
