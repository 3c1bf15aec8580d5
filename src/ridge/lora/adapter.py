"""A PEFT LoRA directory read into ridge's projections: each adapted projection's A and scaled B.

PEFT names the modules of HF's model (`model.layers.0.self_attn.q_proj`); ridge fuses q / k / v into one qkv and
gate / up into one gate_up (models/tensor_names.py says where each HF weight goes). A fused projection's adapter is
one pair: the parts' A matrices stacked ([sum of ranks, in]) and a B that places each part's rows at its slot's
output rows and its columns at its own A's rows, zero elsewhere, so that x @ A.T @ B.T is every part's product side
by side. B carries the scaling (alpha / r, or alpha / sqrt(r) with rsLoRA).

What an adapter holds that ridge does not run is refused by name: DoRA, LoRA biases, whole modules to save, the
embedding or the vocabulary projection, a mixture's experts, GPT-2's transposed Conv1D weights.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from ridge.config import ModelConfig
from ridge.lora.request import LoRARequest
from ridge.models.tensor_names import LANGUAGE_MODEL_PREFIXES, hf_names, map_name

log = logging.getLogger("ridge")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's saved keys: the wrapper's prefix, HF's module name, which factor
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<factor>[AB])\.weight")


@dataclass
class LoRAWeights:
    """One adapted projection: y += x @ a.T @ b.T, b scaled."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]


@dataclass
class Adapter:
    request: LoRARequest
    modules: dict[str, LoRAWeights]  # by ridge module path (`layers.0.attn.qkv`)
    rank: int  # the largest of its (HF) modules'

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())


def read_adapter(request: LoRARequest, model: nn.Module, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 max_rank: int) -> Adapter:
    """The adapter at request.lora_path over `model` (cfg's), its factors in `dtype` on `device`; ValueError naming
    what does not fit: a missing file, a setting ridge does not run, a module the model lacks, a shape, a rank over
    max_rank."""
    folder = Path(request.lora_path).expanduser()
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"lora_path: {folder} has no {CONFIG_FILE} (a PEFT LoRA adapter's directory)")
    settings = json.loads((folder / CONFIG_FILE).read_text())
    _check_settings(settings, cfg)
    if not (folder / WEIGHTS_FILE).is_file():
        found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise ValueError(f"lora_path: {folder} has no {WEIGHTS_FILE} (found {found}); save the adapter with "
                         "safetensors (PEFT's default)")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(folder / WEIGHTS_FILE).items():
        match = _KEY.fullmatch(key)
        if re.search(r"(^|\.)(lm_head|embed_tokens)\.", key):  # PEFT saves those layers whole beside their factors
            raise ValueError(f"lora_path: {key}: adapters on the embedding or the vocabulary projection are not "
                             "supported (ridge adapts the decoder layers' projections)")
        if match is None:
            raise ValueError(f"lora_path: tensor {key!r} is not a LoRA factor ridge runs (DoRA magnitudes, LoRA "
                             "biases, embedding adapters and saved modules are not supported)")
        factors.setdefault(match["module"], {})[match["factor"]] = tensor
    parts: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}  # ridge path -> (slot, A, scaled B)
    for module, pair in factors.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"lora_path: {module} has lora_{next(iter(pair))} but not its partner")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise ValueError(f"lora_path: {module}'s lora_A has rank {rank}, its lora_B {b.shape[1]}")
        if rank > max_rank:
            raise ValueError(f"max_lora_rank: {request.lora_name}'s {module} has rank {rank}, over the engine's "
                             f"max_lora_rank={max_rank}; start it with a larger one")
        path, slot = _ridge_module(module, cfg)
        layer = int(path.split(".")[1])
        if slot in (1, 2) and path.endswith(".qkv") and cfg.kv_source(layer) != layer:
            # a KV-shared layer (Gemma 4's) attends to an earlier layer's cache: its k / v projections never run, in
            # HF's model as in ridge's, and neither do their factors
            log.info("ridge: %s's %s: layer %d reads layer %d's cache; its factors have nothing to change",
                     request.lora_name, module, layer, cfg.kv_source(layer))
            continue
        alpha = _pattern_value(settings.get("alpha_pattern") or {}, module, settings["lora_alpha"])
        scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
        parts.setdefault(path, []).append((slot, a, b * scaling))
    if not parts:
        raise ValueError(f"lora_path: {folder / WEIGHTS_FILE} holds no LoRA factors")
    modules = {path: _join(path, slots, model, dtype, device) for path, slots in parts.items()}
    return Adapter(request, modules, max(a.shape[0] for slots in parts.values() for _, a, _ in slots))


def _check_settings(settings: dict[str, Any], cfg: ModelConfig) -> None:
    refused = {
        "use_dora": "DoRA's magnitude vectors",
        "modules_to_save": "whole modules saved beside the adapter",
        "fan_in_fan_out": "transposed (Conv1D) weights",
        "lora_bias": "LoRA biases",
        "target_parameters": "adapters on raw parameters (a mixture's experts)",
        "use_qalora": "QA-LoRA's pooled inputs",
    }
    if settings.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora_path: peft_type {settings['peft_type']!r} is not LORA")
    for name, what in refused.items():
        if settings.get(name):
            raise ValueError(f"lora_path: {name}={settings[name]!r}: {what} are not supported")
    if settings.get("bias", "none") != "none":
        raise ValueError(f"lora_path: bias={settings['bias']!r}: adapters that train biases are not supported")
    if "lora_alpha" not in settings:
        raise ValueError(f"lora_path: {CONFIG_FILE} has no lora_alpha")
    # a model whose rows ridge reorders at load, or splits apart, would need each adapter's rows moved the same way
    if cfg.rope_interleave or cfg.index_rope_interleave:
        raise ValueError(f"lora_path: LoRA on {cfg.architecture} (its rotary rows are reordered at load) is not "
                         "supported")
    if cfg.attention_output_gate:
        raise ValueError(f"lora_path: LoRA on {cfg.architecture} (its q_proj holds the output gate's rows, split at "
                         "load) is not supported")


def _ridge_module(module: str, cfg: ModelConfig) -> tuple[str, int | None]:
    """Where HF's `module` is in ridge's model: a module path, and its slot in a fused projection (None: whole)."""
    name = module
    for prefix, plain in LANGUAGE_MODEL_PREFIXES:  # a multimodal checkpoint's language model
        name = re.sub("^" + prefix, plain, name)
    try:
        target, slot = map_name(name + ".weight", hf_names(cfg))
    except ValueError:
        raise ValueError(f"lora_path: {module} has no place in a {cfg.architecture} model") from None
    if not target.startswith("layers.") or not target.endswith(".weight"):
        raise ValueError(f"lora_path: LoRA on {module} is not supported (ridge adapts the decoder layers' "
                         "projections, not the embedding or the vocabulary projection)")
    if ".experts." in target:
        raise ValueError(f"lora_path: LoRA on {module} (a mixture's expert) is not supported")
    return target.removesuffix(".weight"), slot


def _slot_rows(path: str, model: nn.Module) -> list[int]:
    """The output rows of each slot of the fused projection at `path`, in slot order."""
    owner = model.get_submodule(path.rpartition(".")[0])
    if path.endswith(".qkv"):
        q, kv = owner.num_heads * owner.head_dim, owner.num_kv_heads * owner.head_dim
        return [q] if owner.kv_shared else [q, kv] if owner.values_from_keys else [q, kv, kv]
    if path.endswith(".gate_up"):
        return [owner.intermediate_size] * (2 if owner.gated else 1)
    raise ValueError(f"lora_path: {path} is not a fused projection ridge knows the parts of")


def _join(path: str, slots: list[tuple[int | None, torch.Tensor, torch.Tensor]], model: nn.Module,
          dtype: torch.dtype, device: torch.device) -> LoRAWeights:
    """One projection's parts as one pair (see the module's note)."""
    try:
        projection = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"lora_path: this model has no {path} to adapt") from None
    in_features, out_features = projection.in_features, projection.out_features
    rows = [out_features] if any(slot is None for slot, _, _ in slots) else _slot_rows(path, model)
    if len(slots) > 1 and any(slot is None for slot, _, _ in slots):
        raise ValueError(f"lora_path: {path} is adapted whole and in parts")
    starts = [sum(rows[:i]) for i in range(len(rows))]
    rank = sum(a.shape[0] for _, a, _ in slots)
    a_all = torch.zeros(rank, in_features, dtype=dtype, device=device)
    b_all = torch.zeros(out_features, rank, dtype=dtype, device=device)
    column = 0
    for slot, a, b in sorted(slots, key=lambda part: part[0] or 0):
        width = rows[slot or 0]
        if a.shape[1] != in_features or b.shape[0] != width:
            raise ValueError(f"lora_path: {path}{'' if slot is None else f' slot {slot}'} takes [{in_features}] to "
                             f"[{width}], the adapter's factors [{a.shape[1]}] to [{b.shape[0]}]: an adapter of "
                             "another model?")
        r = a.shape[0]
        a_all[column:column + r] = a
        start = starts[slot or 0]
        b_all[start:start + width, column:column + r] = b
        column += r
    return LoRAWeights(a_all, b_all)


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override (alpha_pattern): the value of the first pattern that ends `module`'s name."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?(?:{pattern})", module):
            return value
    return default
