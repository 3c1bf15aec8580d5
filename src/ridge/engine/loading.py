"""A model's file opened, and its weights loaded as the engine runs them: dtype, quantization, kernels."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ridge.cluster.shards import ShardPlan, shard_model, shard_quantized
from ridge.config import POOLING_TYPES, EngineConfig, ModelConfig
from ridge.engine.native_memory import trim_heap
from ridge.hub import resolve
from ridge.kernels import batch_invariance
from ridge.linear import LinearTarget
from ridge.linear.dense import onednn_packs
from ridge.linear.select import int8_activation_layers, place_dense, place_quantized, share_prompt_scratch
from ridge.models.gguf_file import GGUFFile
from ridge.models.loader import DrawnQuantization, LoadedModel, load_model, open_gguf, random_model
from ridge.models.mmproj import Projector, with_projector
from ridge.models.random_weights import PREFIX, is_random, random_spec
from ridge.models.registry import check_supported, config_from_spec
from ridge.models.spec import ModelSpec, spec_from_gguf, spec_from_hf_config
from ridge.models.transformer import DecoderModel
from ridge.quant import mxfp4
from ridge.quant.gguf_blocks import GROUP_SIZES as GGUF_GROUPS
from ridge.quant.methods import CALIBRATED, METHODS, quantize_weight, quantize_weights
from ridge.quant.rtn import QuantizedWeight
from ridge.quantize.awq_layers import check_model as check_awq_layers
from ridge.quantize.calibration import (
    CALIBRATION_WINDOW,
    awq_layerwise,
    calibration_windows,
    input_importance,
    quantize_layerwise,
    windows_for,
)
from ridge.tokenizer import RidgeTokenizer, byte_level_tokenizer

log = logging.getLogger("ridge")

# a sentence-transformers Pooling module's flags, and the pooling each asks for
ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
              "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
              "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass
class ModelFile:
    """A model's file or directory, opened: its GGUF header parsed once (for tokenizer and weights), no weights
    loaded yet; its tokenizer read when first asked for (a tensor-parallel rank never asks, but to calibrate)."""

    path: Path
    gguf: GGUFFile | None
    random: ModelSpec | None = None  # `random:NAME`: a model of that shape with random weights, no file
    random_source: Path | None = None  # the folder of a random model's config.json: its tokenizer, if it has one
    projector: Projector | None = None  # a GGUF language model's vision tower (llama.cpp's mmproj file)

    @functools.cached_property
    def tokenizer(self) -> RidgeTokenizer:
        if self.random is None:
            return RidgeTokenizer.from_path(self.path, self.gguf)
        folder = self.random_source
        return (RidgeTokenizer.from_path(folder) if folder and (folder / "tokenizer.json").exists()
                else RidgeTokenizer(*byte_level_tokenizer(self.random.vocab_size)))

    @functools.cached_property
    def checkpoint_group_size(self) -> int:
        """The input columns a quantized checkpoint's scale groups span (GPTQ / AWQ, MXFP4's blocks); 1 for any other
        model (a scale per row, or none)."""
        if self.random is not None or self.gguf is not None:
            return 1
        quantization = json.loads((self.path / "config.json").read_text()).get("quantization_config") or {}
        method = quantization.get("quant_method")
        if method == "mxfp4":
            return mxfp4.GROUP
        return max(int(quantization.get("group_size") or 1), 1) if method in ("gptq", "awq") else 1

    @functools.cached_property
    def pooling(self) -> tuple[str, str] | None:
        """How the model says its embeddings pool ("last", "mean", "cls"...) and where it says so: a GGUF's
        {arch}.pooling_type, or a sentence-transformers folder's Pooling module; None where it says nothing."""
        if self.random is not None:
            return None
        if self.gguf is not None:
            key = f"{self.gguf.fields.get('general.architecture')}.pooling_type"
            kind = {1: "mean", 2: "cls", 3: "last", 4: "rank"}.get(self.gguf.fields.get(key))  # llama.cpp's enum
            return (kind, f"{key} in {self.path.name}") if kind else None
        modules = self.path / "modules.json"
        for module in json.loads(modules.read_text()) if modules.exists() else []:
            if str(module.get("type", "")).endswith(".Pooling"):
                where = Path(module.get("path", "")) / "config.json"
                modes = json.loads((self.path / where).read_text())
                return "+".join(name for flag, name in ST_POOLING.items() if modes.get(flag)) or "none", str(where)
        return None

    def pooling_for(self, config: EngineConfig) -> str | None:
        """How the engine pools embeddings (POOLING_TYPES; None: it generates): config.pooling_type where given,
        else the pooling the model declares, else cls for an encoder and last for a decoder (vLLM's defaults).
        ValueError for a pooling ridge does not run, or an encoder asked to generate; a warning where an embedding
        model is loaded to generate, or pools otherwise than it declares (its vectors are not the trained ones)."""
        model_config = self.config()
        declared, encoder = self.pooling, not model_config.causal
        if model_config.num_labels:  # a classifier's head reads the first token's state, as it was trained
            if config.runner == "pooling" and config.pooling_type not in (None, "cls"):
                raise ValueError(f"pooling_type: {self.path.name} is a classifier, whose head reads the first "
                                 "token's state (cls)")
            declared = None
        if config.runner == "generate":
            if encoder:
                raise ValueError(f"runner: {self.path.name} is an encoder (each token attends to the later ones too): "
                                 "it embeds prompts and generates nothing; start it with runner='pooling' (--runner "
                                 "pooling)")
            if declared is not None:
                log.warning("ridge: %s declares %s pooling (%s): an embedding model; serve it with --runner pooling",
                            self.path.name, *declared)
            return None
        if config.pooling_type is not None:
            if declared is not None and declared[0] != config.pooling_type:
                log.warning("ridge: pooling_type=%s, where %s declares %s pooling (%s): these embeddings are not the "
                            "ones the model was trained to give", config.pooling_type, self.path.name, *declared)
            return config.pooling_type
        if declared is None:
            return "cls" if encoder or model_config.num_labels else "last"
        kind, where = declared
        if kind not in POOLING_TYPES:
            raise ValueError(f"runner: this model's embeddings pool by {kind} ({where}); ridge's pooling runner pools "
                             f"by {', '.join(POOLING_TYPES)}")
        return kind

    def config(self) -> ModelConfig:
        """The model's config from its header alone, no weight read (to check what it asks for before loading)."""
        if self.random is not None:
            spec = self.random
        elif self.gguf is not None:
            spec = spec_from_gguf(self.gguf, self.path.stem, f"GGUF header of {self.path.name}")
            if self.projector is not None:
                spec = with_projector(spec, self.gguf, self.projector.gguf, self.projector.path.name)
        else:
            spec = spec_from_hf_config(json.loads((self.path / "config.json").read_text()), self.path.name,
                                       str(self.path / "config.json"))
        return config_from_spec(spec)

    @classmethod
    def open(cls, model: str, mmproj: str | None = None) -> ModelFile:
        """`model` (a path, an alias, `random:NAME`), with `mmproj`, a projector file for a GGUF one."""
        if mmproj is not None and (is_random(model) or not resolve(model).is_file()):
            raise ValueError(f"mmproj: a projector file goes with a GGUF language model (llama.cpp's layout); {model} "
                             "is not one (an HF folder holds its vision tower in its own checkpoint)")
        if is_random(model):
            spec = random_spec(model)
            check_supported(spec.architecture)
            source = Path(model.removeprefix(PREFIX).split(",")[0]).expanduser()
            folder = source if source.is_dir() else source.parent if source.is_file() else None
            return cls(Path(spec.name), None, random=spec, random_source=folder)
        path = resolve(model)
        gguf = open_gguf(path) if path.is_file() else None
        if gguf is not None:  # before the tokenizer or any weight is read
            check_supported(str(gguf.fields.get("general.architecture")))
        return cls(path, gguf, projector=Projector.open(mmproj) if mmproj is not None else None)


def shard_plan(config: EngineConfig, model: ModelFile, rank: int) -> ShardPlan | None:
    """Rank `rank`'s part of the model under config.tensor_parallel_size (None: one process holds it all), checked
    from the model's header alone."""
    if config.tensor_parallel_size == 1:
        return None
    # the granule a row-parallel layer's columns are cut in: a quantization group (int8 / fp8: a scale per row,
    # columns cut freely; a GGUF file's blocks: groups of 16 or 32; a checkpoint's own groups)
    granule = {"int4": config.quantization_group_size, "gptq": config.quantization_group_size,
               "awq": config.quantization_group_size, "mxfp4": mxfp4.GROUP, "gguf": max(GGUF_GROUPS.values())}.get(
        config.quantization, model.checkpoint_group_size)
    return ShardPlan(model.config(), rank, config.tensor_parallel_size, granule,
                     expert_parallel=config.enable_expert_parallel)


def reads_its_part(config: EngineConfig) -> bool:
    """Whether each tensor-parallel rank reads (or draws) only its part of the weights, so that ranks can load side
    by side: not where weights are quantized at load (calibrated on the whole model's activations), which are made
    whole and then cut."""
    return config.tensor_parallel_size > 1 and config.quantization not in METHODS


def load_weights(model: ModelFile, config: EngineConfig, kernels: ModuleType | None, progress: bool,
                 plan: ShardPlan | None = None) -> LoadedModel:
    """A model's weights in the engine's dtype, each linear layer on the kernel linear/select.py picks for it,
    made once: as the file is read (natively quantized layers), as it is quantized, or, still dense, after.
    Under tensor parallelism, `plan`'s rank's shard of them (cluster/shards.py): read as its part of the file (or
    drawn, for a random model), or, where weights are quantized at load, made whole and then cut."""
    target = LinearTarget(config.torch_dtype, config.device, kernels, packed=config.packed_linear,
                          int8_activations=config.int8_activations, batch_invariant=config.batch_invariant)
    cut_after = plan is not None and not reads_its_part(config)
    if model.random is not None and config.quantization == "gguf":
        raise ValueError("quantization: gguf runs a GGUF file's blocks; a random model has no file")
    shard = plan.cut_model if plan is not None and not cut_after else None
    if model.random is not None:
        loaded = random_model(model.random, config.torch_dtype, config.device, config.seed, shard,
                              config.ignore_sliding_window, drawn_quantization(config, target, plan), progress,
                              config.max_model_len)
        trim_heap()  # the draws' and their quantization's freed temporaries
    else:
        loaded = load_model(model.path, config.torch_dtype, config.device, progress, model.gguf,
                            gguf_native=config.quantization == "gguf", target=target,
                            ignore_sliding_window=config.ignore_sliding_window, shard=shard,
                            max_model_len=config.max_model_len, projector=model.projector)
    quantized = _quantized_weights(loaded.model, model.tokenizer, config, progress) \
        if config.quantization in METHODS else iter(())
    if cut_after:
        quantized = list(quantized)  # made from the whole model, before its dense weights are cut
        cuts = shard_model(loaded.model, plan)
        quantized = [(key, shard_quantized(key, w, cuts, plan.vocab_shard)) for key, w in quantized if plan.keeps(key)]
    if plan is not None:
        loaded.weight_format += f", rank {plan.rank} of {plan.world}"
    if config.quantization in METHODS:
        place_quantized(loaded.model, quantized, target)
        loaded.weight_format += f" -> {config.quantization}" + (
            f" g{config.quantization_group_size}" if config.quantization not in ("int8", "fp8") else "")
    place_dense(loaded.model, target)
    if loaded.config.num_labels and loaded.config.type_vocab_size > 1:  # a cross-encoder reads a pair's token types
        separator = model.tokenizer.info.pair_separator
        if separator is None:
            raise ValueError(f"{model.path.name}: a classifier with token types needs its tokenizer's pair template "
                             "(tokenizer.json's post_processor) to tell a pair's two texts apart")
        loaded.model.segment_separator = separator
    if config.int8_activations:
        if not int8_activation_layers(loaded.model):
            raise ValueError("int8_activations: needs quantized weights (--quantization, or a quantized "
                             "checkpoint) and ridge's CPU kernels: built for AVX512-VNNI (float32 or bfloat16), "
                             "or for AVX2 (float32)")
        loaded.weight_format += ", int8 activations"
    packs = kernels is not None and onednn_packs(config.torch_dtype, config.device)
    if packs and (scratch_bytes := share_prompt_scratch(loaded.model.layers, kernels)):
        log.info("ridge: prompts multiply quantized weights on oneDNN's packed layout (%.0f MiB of scratch)",
                 scratch_bytes / 2**20)
    if config.device.startswith("cuda"):
        from ridge.triton_kernels import fused  # the CPU kernels' fused norm / rotary / activation, in Triton

        kernels = fused
    loaded.model.use_kernels(kernels)
    if config.batch_invariant:
        batch_invariance.verify(loaded.model, config.torch_dtype)
        loaded.weight_format += ", batch invariant"
    trim_heap()
    return loaded


def drawn_quantization(config: EngineConfig, target: LinearTarget,
                       plan: ShardPlan | None) -> DrawnQuantization | None:
    """How a random model's layers are quantized as they are drawn (so that its dense weights are never whole in
    memory): a method that needs no calibration text, in one process; None otherwise (quantized after the draw)."""
    method = config.quantization
    if method not in METHODS or method in CALIBRATED or windows_for(method, config.calibration_windows) or plan:
        return None
    group_size = config.quantization_group_size
    return DrawnQuantization(lambda w: quantize_weight(w, method, group_size),
                             1.0 if method in ("int8", "fp8") else 0.6, target)


def _quantized_weights(model: DecoderModel, tokenizer: RidgeTokenizer, config: EngineConfig,
                       progress: bool) -> Iterator[tuple[str, QuantizedWeight]]:
    """The model's weights in config.quantization's format, calibrated first where the method needs text:
    gptq and awq one decoder layer at a time, int8 and fp8 weighing each row's scale by its columns'
    importance, in one pass."""
    fitted = importance = None
    method, group_size = config.quantization, config.quantization_group_size
    dtype, device = config.torch_dtype, config.device
    num_windows = windows_for(method, config.calibration_windows)  # 0 for int4, plain RTN
    if num_windows and model.cfg.ssm_layers:
        raise ValueError(f"quantization: {method} calibrates on text run layer by layer, which state-space layers "
                         "do not support yet; int4, or int8 / fp8 with calibration_windows=0, quantize them without")
    if method == "awq":
        check_awq_layers(model.layers)
    # windows no longer than the model's context (its rotary table's length)
    window = min(CALIBRATION_WINDOW, model.cfg.max_position_embeddings)
    windows = calibration_windows(tokenizer, num_windows, window, progress) if num_windows else []
    if method == "awq":
        fitted = awq_layerwise(model, windows, group_size, integer_zeros=False, dtype=dtype, device=device,
                               progress=progress)
    elif method in CALIBRATED:
        fitted = quantize_layerwise(model, windows, lambda _key, w, h: quantize_weight(w, method, group_size, h),
                                    dtype, device, progress)
    elif windows:
        importance = input_importance(model, windows, dtype, device, progress)
    return quantize_weights(model, method, group_size, fitted=fitted, importance=importance, progress=progress)
