"""GGUF and safetensors files (plain or quantized checkpoints) -> a DecoderModel with fused q/k/v and gate/up
weights.

Both formats are mapped onto ridge's parameter names (models/tensor_names.py); a fused parameter's slots are
concatenated along the output dimension.
GGUF tensors are dequantized to the requested dtype, or, with gguf_native, kept as their blocks' codes
and scales (quant/gguf_blocks.py) for layers that multiply by them in place (linear/).
Every tensor is found before any is read, then read weight by weight; a tensor-parallel rank reads only its rows
of each (ShardCuts), into a model cut to its part on the meta device.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import os
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open
from tqdm import tqdm

from ridge.config import ModelConfig
from ridge.linear import LinearTarget, QuantizedEmbedding, fused_linear, make_linear
from ridge.models.gguf_file import GGUFFile, read_gguf
from ridge.models.mmproj import Projector, with_projector
from ridge.models.random_weights import random_tensors
from ridge.models.registry import config_from_spec
from ridge.models.spec import (
    ModelSpec,
    decoder_layers,
    gguf_nemotron_h_kinds,
    gguf_value,
    nemotron_h_layers,
    spec_from_gguf,
    spec_from_hf_config,
)
from ridge.models.tensor_names import (
    DENSE_UNDER_NATIVE,
    ENCODER_PREFIX,
    LANGUAGE_MODEL_PREFIXES,
    NOT_ENCODER,
    NOT_LANGUAGE_MODEL,
    UNREAD_VISION,
    VISION_TOWER,
    gguf_names,
    hf_names,
    map_name,
    mmproj_names,
)
from ridge.models.transformer import DecoderModel
from ridge.multimodal.vision_config import VisionConfig
from ridge.quant import checkpoint, gguf_blocks, mxfp4
from ridge.quant.methods import quantizable
from ridge.quant.rtn import QuantizedWeight, cut_quantized, dequantize, pad_rows

log = logging.getLogger("ridge")

@dataclass
class LoadedModel:
    config: ModelConfig
    spec: ModelSpec  # the shape the planner's arithmetic counts bytes and FLOPs of
    model: DecoderModel
    path: Path
    weight_format: str  # e.g. "gguf Q4_1 (dequantized to bfloat16)" or "safetensors float32"


# the tables a tensor-parallel rank holds by rows of the vocabulary, the last rank's padded to as many rows
VOCABULARY_TABLES = ("embed_tokens", "lm_head", "embed_per_layer")


@dataclass(frozen=True)
class ShardCuts:
    """A tensor-parallel rank's part of the weights (cluster/shards.py), read as the file is: by module path, or a
    parameter's own, the dim cut (0: rows, 1: columns) and the indices kept, the vocabulary's tables padded with
    zero rows to `vocab_rows`; `keeps`: whether the rank holds a weight at all (its experts only, under expert
    parallelism)."""

    cuts: dict[str, tuple[int, torch.Tensor]]
    vocab_rows: int
    keeps: Callable[[str], bool]

    def of(self, key: str) -> tuple[int, torch.Tensor] | None:
        """The cut of the parameter at `key`: a cut module's weight or bias (a row-parallel one's bias whole), or a
        parameter cut by its own path."""
        cut = self.cuts.get(key) or self.cuts.get(key.rpartition(".")[0])
        return None if cut is not None and cut[0] == 1 and key.endswith(".bias") else cut

    def pad_to(self, key: str) -> int | None:
        return self.vocab_rows if key.removesuffix(".weight") in VOCABULARY_TABLES else None


@dataclass(frozen=True)
class _Stored:
    """A tensor as the file holds it, read only when asked, and then only the rows asked for (a tensor-parallel
    rank reads and dequantizes its rows of a weight, not the whole). quantized: read() gives a QuantizedWeight
    (the file's GGUF blocks under gguf_native, a quantized checkpoint's layer; or, for a checkpoint layer whose
    layout no kernel here runs, its dequantized matrix), placed once the dense weights are."""

    shape: tuple[int, ...]
    read: Callable[[torch.Tensor | None], np.ndarray | torch.Tensor | QuantizedWeight]  # rows (None: all)
    quantized: bool = False

    @classmethod
    def of(cls, value: np.ndarray | torch.Tensor | QuantizedWeight) -> _Stored:
        """A tensor already read."""
        if isinstance(value, QuantizedWeight):
            return cls(tuple(value.shape), lambda rows: value if rows is None else cut_quantized("", value, 0, rows),
                       quantized=True)
        if isinstance(value, np.ndarray):
            return cls(value.shape, lambda rows: value if rows is None else value[rows.numpy()])
        return cls(tuple(value.shape),
                   lambda rows: value if rows is None else value.index_select(0, rows.to(value.device)))

    def reordered(self, order: torch.Tensor) -> _Stored:
        """The tensor of the stored rows `order` (a permutation of them, or a part): its row i is the stored row
        order[i]."""
        return dataclasses.replace(self, shape=(len(order), *self.shape[1:]),
                                   read=lambda rows: self.read(order if rows is None else order[rows]))

    def mapped(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> _Stored:
        """The tensor with `fn` applied to its values (row by row: fn must not mix rows)."""
        return dataclasses.replace(self, read=lambda rows: fn(self.read(rows)))


_FLOAT_TYPES = {"F32", "F16", "BF16"}


def _gguf_stored(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, ...], ops: ModuleType | None,
                 native: bool, name: str) -> _Stored:
    """A GGUF tensor's data (a view of the mapped file): its rows dequantized when read, or under `native`
    unpacked to their blocks' codes and scales."""
    def rows_of(rows: torch.Tensor | None) -> np.ndarray:
        return data if rows is None else data[rows.numpy()]

    if native:
        return _Stored(shape, lambda rows: gguf_blocks.unpack(part := rows_of(rows), kind, (len(part), shape[1]), name),
                       quantized=True)
    return _Stored(shape, lambda rows: gguf_blocks.dequantize(part := rows_of(rows), kind, (len(part), *shape[1:]),
                                                              ops))


def _gguf_tensors(gguf: GGUFFile, cfg: ModelConfig, native: bool,
                  ops: ModuleType | None) -> Iterator[tuple[str, _Stored]]:
    kv_b_halves: dict[str, dict[str, np.ndarray]] = defaultdict(dict)
    predicting = decoder_layers(gguf)  # the first multi-token prediction layer's block, where the file has them
    for t in gguf.tensors:
        if (block := re.match(r"blk\.(\d+)\.", t.name)) and int(block.group(1)) >= predicting:
            continue  # a drafter's layer (Qwen3.5's MTP block), which ridge does not run
        quantized = native and t.tensor_type.name not in _FLOAT_TYPES and not DENSE_UNDER_NATIVE.match(t.name)
        if match := re.fullmatch(r"blk\.(\d+)\.attn_([kv])_b\.weight", t.name):
            # llama.cpp's kv_b split for its absorbed form: k_b [heads, rank, nope] (W_UK transposed per head),
            # v_b [heads, v_head_dim, rank]; joined back to kv_b's [heads * (nope + v_head_dim), rank]
            halves = kv_b_halves[match.group(1)]
            halves[match.group(2)] = gguf_blocks.dequantize(t.data, t.tensor_type, t.shape, ops)
            if len(halves) == 2:
                joined = np.concatenate([halves["k"].transpose(0, 2, 1), halves["v"]], axis=1)
                yield f"blk.{match.group(1)}.attn_kv_b.weight", _Stored.of(joined.reshape(-1, joined.shape[-1]))
            continue
        if len(t.shape) == 3 or t.name.endswith("_exps.bias"):
            # a mixture's experts stacked, [experts, rows, columns] (their biases [experts, rows]): one tensor each
            for expert in range(t.shape[0]):
                yield f"{t.name}.{expert}", _gguf_stored(t.data[expert], t.tensor_type, t.shape[1:], ops, quantized,
                                                         f"{t.name}.{expert}")
            continue
        if match := re.fullmatch(r"blk\.\d+\.(ssm_a|ssm_d|ssm_norm\.weight)", t.name):
            # a Mamba-2 mixer's vectors, stored [heads, 1] / [groups, width a group]; A itself, where the mixer
            # holds A_log (HF's form, A = -exp(A_log))
            vector = gguf_blocks.dequantize(t.data, t.tensor_type, t.shape, ops).reshape(-1)
            yield t.name, _Stored.of(np.log(-vector) if match.group(1) == "ssm_a" else vector)
            continue
        if t.name.endswith("ffn_gate_inp_shexp.weight"):  # a vector in GGUF, the gate's one row here
            vector = gguf_blocks.dequantize(t.data, t.tensor_type, t.shape, ops)
            yield t.name, _Stored.of(vector.reshape(1, -1))
            continue
        stored = _gguf_stored(t.data, t.tensor_type, t.shape, ops, quantized, t.name)
        permuted = cfg.architecture in ROTARY_PERMUTED or cfg.architecture == "granitemoehybrid" and cfg.rotary_dim
        if permuted and re.search(r"attn_[qk]\.", t.name):
            # llama.cpp's converter permutes whole heads; ridge's writer (bench/random_gguf.py) a Bamba's rotary
            # dims alone, and marks its files so
            rotary_dim = cfg.rotary_dim if gguf.fields.get(PARTIAL_ROTARY_ROWS) else None
            stored = stored.reordered(_rotary_order(t.shape[0], cfg.num_heads if ".attn_q." in t.name
                                                    else cfg.num_kv_heads, rotary_dim))
        yield t.name, stored


def _mmproj_tensors(projector: GGUFFile, tower: VisionConfig,
                    ops: ModuleType | None) -> Iterator[tuple[str, _Stored]]:
    """A projector file's tensors, dequantized as read (the tower runs dense), in the checkpoint's form: Qwen2-VL's
    patch kernel, which the converter cut into its two frames, joined again; Gemma 3's projector norm, stored as the
    1 + w it multiplies by, back to w; Pixtral's q / k rows, permuted by the converter as llama's are, put back.
    Pixtral's `v.token_embd.img_break`, a copy of the language model's [IMG_BREAK] embedding, is not read: ridge's
    layout places the token, which the language model embeds."""
    frames: dict[str, np.ndarray] = {}
    for t in projector.tensors:
        if t.name.startswith("v.token_embd.img_break"):
            continue
        if tower.family == "pixtral" and re.fullmatch(r"v\.blk\.\d+\.attn_[qk]\.weight", t.name):
            stored = _gguf_stored(t.data, t.tensor_type, t.shape, ops, False, t.name)
            yield t.name, stored.reordered(_rotary_order(t.shape[0], tower.num_heads))
            continue
        if tower.family == "qwen" and t.name in _PATCH_FRAMES:
            frames[t.name] = gguf_blocks.dequantize(t.data, t.tensor_type, t.shape, ops)
            if len(frames) == len(_PATCH_FRAMES):  # [width, channels, frames, pixels, pixels]
                yield "visual.patch_embed.proj.weight", _Stored.of(np.stack([frames[n] for n in _PATCH_FRAMES], 2))
            continue
        stored = _gguf_stored(t.data, t.tensor_type, t.shape, ops, False, t.name)
        yield t.name, stored.mapped(lambda w: w - 1) if t.name == "mm.soft_emb_norm.weight" else stored


_PATCH_FRAMES = ("v.patch_embd.weight", "v.patch_embd.weight.1")


# the architectures whose q / k rows llama.cpp's converter permutes (LlamaModel's and its subclasses')
ROTARY_PERMUTED = ("llama", "mixtral", "granite", "granitemoe", "smollm3", "ministral3")


# the sliding window of every StarCoder2 checkpoint's config.json, which its GGUF headers do not carry
STARCODER2_WINDOW = 4096


# a GGUF header key ridge's writer sets where it interleaved only each head's first rotary dims (a partial rotary,
# Bamba's), the form llama.cpp computes as HF's model does
PARTIAL_ROTARY_ROWS = "ridge.rope.interleaved_rotary_dims_only"


def _rotary_order(rows: int, heads: int, rotary_dim: int | None = None) -> torch.Tensor:
    """The row order that undoes the permutation llama.cpp's converter applies to llama q/k (interleaved ->
    halves rotary), over each head's first rotary_dim rows (None: the whole head)."""
    per_head = rows // heads
    width = rotary_dim or per_head
    head = torch.arange(per_head)
    head[:width] = torch.arange(width).view(width // 2, 2).T.flatten()
    return (torch.arange(heads)[:, None] * per_head + head).flatten()


def load_model(
    path: Path, dtype: torch.dtype, device: str = "cpu", progress: bool = True, gguf: GGUFFile | None = None,
    gguf_native: bool = False, target: LinearTarget | None = None, ignore_sliding_window: bool = False,
    shard: Callable[[DecoderModel], ShardCuts] | None = None, max_model_len: int | None = None,
    projector: Projector | None = None,
) -> LoadedModel:
    """gguf_native: keep a GGUF file's quantized tensors as they are. Layers kept quantized (those, and a
    quantized checkpoint's) get their kernels for `target` (default: dtype and device, no ridge kernels).
    ignore_sliding_window: every layer attends to all (a benchmark baseline; not the model's outputs).
    max_model_len: the context the model will serve (None: its own), which picks a LongRoPE rotary's factors.
    shard: a tensor-parallel rank's cut of the model (given the meta-device model, cuts it and says how its
    weights are cut): only that part of each weight is read and held. projector: a GGUF language model's vision
    tower, in llama.cpp's projector file (models/mmproj.py)."""
    if path.is_dir():
        if gguf_native:
            raise ValueError(f"quantization: gguf needs a .gguf model file; {path} is a directory")
        if projector is not None:
            raise ValueError(f"mmproj: a projector file goes with a GGUF language model; {path} is a directory")
        hf_config = json.loads((path / "config.json").read_text())
        spec = spec_from_hf_config(hf_config, path.name, str(path / "config.json"))
        cfg = config_from_spec(spec)
        predicting = int(hf_config.get("num_nextn_predict_layers") or 0)
        tensors: Iterator[tuple[str, _Stored]] = _hf_language_model(_safetensors(path), cfg, predicting)
        if cfg.architecture == "gpt_oss":  # its experts stacked, in its own layout (another's would be refused)
            tensors = _split_experts(tensors)
        elif cfg.architecture in ("granitemoe", "granitemoehybrid"):
            tensors = _split_stacked(tensors, _GRANITE_STACKED)
        elif cfg.architecture in ("qwen3_moe", "mistral4", "llama4", "dots1", "gemma4"):  # Qwen3-VL-MoE's, Mistral
            # 4's, Llama 4's, dots.llm1's and Gemma 4's experts come stacked
            tensors = _split_hf_stacked_experts(tensors, cfg)
        if cfg.attention_output_gate or cfg.state_mixer == "gated_delta":
            tensors = _split_gated_attention(tensors, cfg)
        if cfg.architecture == "nemotron_h":
            tensors = _nemotron_h_blocks(tensors, hf_config.get("text_config", hf_config))
        table = hf_names(cfg)
        fmt = "safetensors"
        quantization = hf_config.get("quantization_config")
        if quantization and quantization.get("quant_method") == "mxfp4":  # _split_experts reads its experts
            if cfg.architecture != "gpt_oss":
                raise ValueError(f"quantization_config.quant_method: 'mxfp4' is read for gpt-oss's experts only; "
                                 f"{path} is {cfg.architecture}")
            fmt += " mxfp4 experts"
        elif quantization:  # GPTQ / AWQ / fp8 layers, kept quantized
            tensors = _checkpoint_layers(tensors, quantization)
            fmt += f" {quantization['quant_method']}"
    else:
        gguf = gguf or open_gguf(path)
        spec = spec_from_gguf(gguf, path.stem, f"GGUF header of {path.name}")
        if projector is not None:
            spec = with_projector(spec, gguf, projector.gguf, projector.path.name)
        cfg = config_from_spec(spec)
        if cfg.architecture == "starcoder2" and cfg.max_position_embeddings > STARCODER2_WINDOW:
            log.warning("ridge: %s: a starcoder2 GGUF names no sliding window, so every layer attends to its whole "
                        "history as llama.cpp's does; StarCoder2's checkpoints window at %d tokens, so outputs past "
                        "that many positions are not the HF model's", path.name, STARCODER2_WINDOW)
        tensors = _gguf_tensors(gguf, cfg, gguf_native, target.cpu_ops if target else None)
        if cfg.attention_output_gate:
            tensors = _split_gated_attention(tensors, cfg)
        if cfg.architecture == "nemotron_h":
            kinds = gguf_nemotron_h_kinds(gguf_value(gguf, "general.architecture"),
                                          functools.partial(gguf_value, gguf), {t.name for t in gguf.tensors})
            tensors = _nemotron_h_gguf_blocks(tensors, kinds)
        table = gguf_names(cfg)
        if projector is not None and cfg.vision is not None:
            tensors = itertools.chain(tensors, _mmproj_tensors(projector.gguf, cfg.vision,
                                                               target.cpu_ops if target else None))
            table = mmproj_names(cfg.vision) + table
        kinds = sorted({t.tensor_type.name for t in gguf.tensors} - _FLOAT_TYPES)
        fmt = f"gguf {'+'.join(kinds) or 'float'}" + (" native" if gguf_native else "") + (
            f", vision tower from {projector.path.name}" if projector is not None else "")

    cfg = _served_context(_windows(cfg, ignore_sliding_window), max_model_len)
    with torch.device("meta"):
        model = DecoderModel(cfg)
    cuts = shard(model) if shard is not None else None  # the file's layout stays cfg's, the whole model's
    # every tensor found first (a GGUF tensor is a view of the mapped file, nothing read), then each weight read:
    # a fused one's slots together, under `cuts` only the rank's rows of each
    weights: dict[str, dict[int, _Stored]] = defaultdict(dict)
    for name, item in tensors:
        if name.startswith("rope_"):  # Llama 3.1's and Phi-3's rotary divisors: the spec read them (cfg.rope_scaling)
            continue
        key, slot = map_name(name, table)
        if key == "lm_head.weight" and cfg.tie_word_embeddings or cuts is not None and not cuts.keeps(key):
            continue
        weights[key][slot or 0] = item
    if cfg.rope_interleave or cfg.index_rope_interleave:
        _deinterleave_rotary(cfg, weights)

    state: dict[str, torch.Tensor] = {}
    quantized: list[tuple[str, list[_Stored]]] = []
    for key in tqdm(list(weights), desc="load", unit="tensor", disable=not progress, leave=False):
        slots = weights.pop(key)  # dropped as read: a weight is held once, not twice
        parts = [slots[i] for i in sorted(slots)]
        if parts[0].quantized:
            quantized.append((key, parts))  # placed once the dense weights (their biases) are read
            continue
        state[key] = _read_cut(key, parts, cuts, dtype)
        if key.endswith(".ssm.conv_weight"):  # a depthwise Conv1d's [channels, 1, taps]: the taps per channel
            state[key] = state[key].flatten(1)
        elif key.endswith(".mlp.router_bias"):  # Ernie 4.5 keeps it as [1, experts]
            state[key] = state[key].flatten()
    target = target or LinearTarget(dtype, device)
    for key, parts in quantized:
        _place_quantized(model, key, parts, state, target, cuts)
    model = _with_weights(model, state, device, str(path))
    return LoadedModel(cfg, spec, model, path, f"{fmt} -> {str(dtype).removeprefix('torch.')}")


def _read_cut(key: str, slots: list[_Stored], cuts: ShardCuts | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight at `key` in `dtype` (the slots of a fused one joined along its rows), only the rank's cut of it
    read where `cuts` cut it: rows by the slots they fall in, columns after reading."""
    cut = cuts.of(key) if cuts is not None else None
    if cut is None or cut[0] == 1:
        whole = torch.cat([_tensor(s.read(None), dtype) for s in slots]) if len(slots) > 1 else \
            _tensor(slots[0].read(None), dtype)
        return whole if cut is None else whole.index_select(1, cut[1].to(whole.device))
    pieces = [_tensor(stored.read(rows), dtype) for stored, rows in _rows_by_part(cut[1], slots)]
    tensor = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return _padded(key, tensor, cuts.pad_to(key))


def _padded(key: str, value: torch.Tensor | QuantizedWeight, rows: int | None) -> torch.Tensor | QuantizedWeight:
    """The last vocabulary shard with zero rows to the others' count (`rows`; None: as it is)."""
    if rows is None or value.shape[0] >= rows:
        return value
    if isinstance(value, QuantizedWeight):
        return cut_quantized(key, value, 0, torch.arange(value.shape[0]), rows)
    return pad_rows(value, rows)


def _rows_by_part(index: torch.Tensor, parts: list) -> list[tuple[Any, torch.Tensor]]:
    """The rows `index` (ascending) of parts joined along their rows (a fused q|k|v's, gate|up's): each part that
    holds some, with its own rows among them."""
    found, first = [], 0
    for part in parts:
        rows = index[(index >= first) & (index < first + part.shape[0])] - first
        if len(rows):
            found.append((part, rows))
        first += part.shape[0]
    return found


def _tensor(value: np.ndarray | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, np.ndarray):  # the file's own map is read-only: copied; a dequantized array is ours
        value = torch.from_numpy(value if value.flags.writeable else np.array(value))
    if value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # codes, meaningless without their scales
        raise ValueError("an fp8 weight without its weight_scale_inv (a truncated checkpoint, or one whose "
                         "quantization_config is missing?)")
    return value.to(dtype=dtype)


def _deinterleave_rotary(cfg: ModelConfig, weights: dict[str, dict[int, _Stored]]) -> None:
    """Reorder the rows that make rotary dims from interleaved pairs (x0, x1), (x2, x3)... to halves (x0, x2, ...,
    x1, x3, ...): MLA's query and kv_a projections (DeepSeek's checkpoints), or attention's q and k rows with their
    biases (GLM-4's), to the rotate-half layout the shared rotary code turns (the scores q . k are the same under
    one order for both); a per-head norm weight's dims follow its head's rows (Command R+'s), and a sparse-attention
    indexer's key norm its key's (GLM-5's, whose indexer interleaves where its latent attention may not)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv_order = torch.cat([_rotary_order(q, cfg.num_heads, cfg.rotary_dim),
                           q + _rotary_order(kv, cfg.num_kv_heads, cfg.rotary_dim), torch.arange(q + kv, q + 2 * kv)])
    head_order = _rotary_order(cfg.head_dim, 1, cfg.rotary_dim)  # one head's dims
    indexer_orders = indexer_rotary_orders(cfg) if cfg.index_rope_interleave else {}
    for i in range(cfg.num_layers):
        if cfg.is_mla:
            for name in ("q_b" if cfg.q_lora_rank else "q_proj", "kv_a") if cfg.rope_interleave else ():
                stored = weights[f"layers.{i}.attn.{name}.weight"]
                stored[0] = stored[0].reordered(latent_rotary_order(cfg, name, stored[0].shape[0]))
            for name, order in indexer_orders.items():
                stored = weights[f"layers.{i}.attn.indexer.{name}"]
                stored[0] = stored[0].reordered(order)
            continue
        for kind in ("weight", "bias"):
            slots = weights.get(f"layers.{i}.attn.qkv.{kind}")
            if not slots:
                continue
            if len(slots) == 1:  # q, k and v stored fused (a GGUF's attn_qkv)
                slots[0] = slots[0].reordered(qkv_order)
            else:
                slots[0], slots[1] = slots[0].reordered(qkv_order[:q]), slots[1].reordered(qkv_order[q:q + kv] - q)
        for name in ("q_norm", "k_norm"):  # Command R+'s [heads, head_dim] norm weights: each head's dims likewise
            slots = weights.get(f"layers.{i}.attn.{name}.weight")
            if slots and len(slots[0].shape) == 2:
                slots[0] = slots[0].mapped(lambda t: t[:, head_order])


def indexer_rotary_orders(cfg: ModelConfig, to_halves: bool = True) -> dict[str, torch.Tensor]:
    """The row orders that take a sparse-attention indexer's rotary rows from interleaved pairs to halves
    (to_halves=False: back, as llama.cpp's files hold them): its query's per head, its key's and the key norm's
    dims with them, by parameter name under the indexer."""
    key = _rotary_order(cfg.index_head_dim, 1, cfg.qk_rope_head_dim)
    query = _rotary_order(cfg.index_heads * cfg.index_head_dim, cfg.index_heads, cfg.qk_rope_head_dim)
    if not to_halves:
        key, query = torch.argsort(key), torch.argsort(query)
    return {"wq_b.weight": query, "wk.weight": key, "k_norm.weight": key, "k_norm.bias": key}


def latent_rotary_order(cfg: ModelConfig, name: str, rows: int, to_halves: bool = True) -> torch.Tensor:
    """The row order that takes MLA projection `name`'s (q_proj, q_b or kv_a) rotary rows of each head from
    interleaved pairs to halves (to_halves=False: back, as llama.cpp's files hold them); other rows stay."""
    rope = cfg.qk_rope_head_dim
    offset = cfg.kv_lora_rank if name == "kv_a" else cfg.qk_nope_head_dim  # the rows before a head's rotary ones
    halves = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    order = torch.arange(rows).view(rows // (offset + rope), offset + rope)
    order[:, offset:] = order[:, offset:][:, halves if to_halves else torch.argsort(halves)]
    return order.flatten()


def random_model(spec: ModelSpec, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
                 shard: Callable[[DecoderModel], ShardCuts] | None = None,
                 ignore_sliding_window: bool = False, quantize: DrawnQuantization | None = None,
                 progress: bool = False, max_model_len: int | None = None) -> LoadedModel:
    """A model of `spec`'s shape with random weights drawn on `device` (models/random_weights.py). shard: as
    load_model's; every weight is drawn whole and cut to the rank's part before the next is drawn.
    ignore_sliding_window, max_model_len: as load_model's. quantize: the decoder layers' linear weights quantized as
    they are drawn, each dense draw dropped before the next, so that a model larger than memory in `dtype` loads in
    its quantized size."""
    if quantize is not None and shard is not None:
        raise ValueError("random_model: weights quantized as drawn are made whole, not a rank's part")
    cfg = _served_context(_windows(config_from_spec(spec), ignore_sliding_window), max_model_len)
    with torch.device("meta"):
        model = DecoderModel(cfg)
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    cuts = shard(model) if shard is not None else None
    drawn = quantize.keys(model) if quantize is not None else set()
    held = sum(tensor.numel() * (dtype.itemsize if name not in drawn else quantize.bytes_per_weight)
               for name, tensor in model.state_dict().items())  # the rank's part
    _check_fits(spec.name, int(held), dtype, device)
    state: dict[str, torch.Tensor] = {}
    layers: dict[str, torch.nn.Module] = {}  # the quantized layers, by module path, swapped in once the model is made
    pending: tuple[str, QuantizedWeight] | None = None  # a quantized weight whose bias, if it has one, comes next
    draws = random_tensors(shapes, dtype, device, seed)
    for name, tensor in tqdm(draws, desc="draw", unit="tensor", total=len(shapes), disable=not progress, leave=False):
        if pending is not None:  # its layer made now: the codes held packed, not as drawn
            key, weight = pending
            layers[key] = make_linear(weight, tensor if name == f"{key}.bias" else None, quantize.target)
            pending = None
        if name in drawn:  # a stride-0 stand-in for the dense weight, until the layer is swapped
            pending = (name.removesuffix(".weight"), quantize.weight(tensor))
            tensor = torch.zeros((), dtype=dtype, device=device).expand(tensor.shape)
        elif cuts is not None and cuts.keeps(name):
            tensor = _read_cut(name, [_Stored.of(tensor)], cuts, dtype)
        elif cuts is not None:
            continue
        state[name] = tensor
    if pending is not None:
        layers[pending[0]] = make_linear(pending[1], None, quantize.target)
    model = _with_weights(model, state, device, spec.name)
    for key, layer in layers.items():
        model.set_submodule(key, layer)
    return LoadedModel(cfg, spec, model, Path(spec.name), f"random weights (seed {seed}) -> "
                       f"{str(dtype).removeprefix('torch.')}")


@dataclass(frozen=True)
class DrawnQuantization:
    """How random_model quantizes the decoder layers' linears as it draws them (a method without calibration)."""

    weight: Callable[[torch.Tensor], QuantizedWeight]
    bytes_per_weight: float  # about, scales included: what the memory check counts
    target: LinearTarget

    def keys(self, model: DecoderModel) -> set[str]:
        """The state-dict names of the weights it quantizes."""
        return {f"layers.{i}.{name}.weight" for i, layer in enumerate(model.layers)
                for name, child in layer.named_modules() if quantizable(child)}


def _windows(cfg: ModelConfig, ignore_sliding_window: bool) -> ModelConfig:
    """cfg, or under ignore_sliding_window (a benchmark baseline) every layer attending to its whole history."""
    if not ignore_sliding_window or not cfg.sliding_window:
        return cfg
    log.warning("ridge: ignore_sliding_window: every layer attends to its whole history; outputs past the "
                "%d-token window are not the model's", cfg.sliding_window)
    return dataclasses.replace(cfg, sliding_window=0)


def _served_context(cfg: ModelConfig, max_model_len: int | None) -> ModelConfig:
    """cfg for a run of at most max_model_len positions (None: the model's own context): a LongRoPE rotary takes
    its long factors only where that passes the original context."""
    if cfg.rope_scaling is None or cfg.rope_scaling.kind != "longrope":
        return cfg
    positions = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    scaling = cfg.rope_scaling.served_context(positions)
    log.info("ridge: LongRoPE's %s factors: serving %d positions, the original context %d",
             "long" if scaling.use_long_factor else "short", positions, scaling.original_max_positions)
    return dataclasses.replace(cfg, rope_scaling=scaling)


def _check_fits(name: str, needed: int, dtype: torch.dtype, device: str) -> None:
    """Refuse, before a weight is drawn, weights larger than the memory the device has free: drawing DeepSeek-V3's
    671B random parameters would end in the kernel's out-of-memory killer, not an error."""
    if torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info(torch.device(device))[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needed > free:
        fewer = "num_experts=8" if "num_layers=" in name else "num_layers=4"
        raise ValueError(f"model: {name}'s weights take {needed / 2**30:.1f} GiB in "
                         f"{str(dtype).removeprefix('torch.')}, more than the {free / 2**30:.1f} GiB {device} has "
                         f"free; give it fewer layers or experts ('{name},{fewer}')")


def _with_weights(model: DecoderModel, state: dict[str, torch.Tensor], device: str, source: str) -> DecoderModel:
    """The meta-device model with `state` as its weights, its rotary tables made, on `device`."""
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise ValueError(f"{source}: weights missing for {sorted(missing)[:5]}")
    model.load_state_dict(state, assign=True, strict=True)
    model.make_rotary()
    return model.to(device).eval().requires_grad_(False)


def _place_quantized(model: DecoderModel, key: str, stored: list[_Stored], state: dict[str, torch.Tensor],
                     target: LinearTarget, cuts: ShardCuts | None) -> None:
    """Swap the module that weight `key` belongs to for one that keeps it quantized: under `cuts`, the rank's
    part of it (a fused q|k|v or gate|up is several parts, each with its own rows: the cut's rows are read from
    each; columns only on the boundaries of the scale groups). A checkpoint layer read as its dequantized matrix
    joins the dense weights in `state`."""
    cut = cuts.of(key) if cuts is not None else None
    if cut is None:
        parts = [part.read(None) for part in stored]
    elif cut[0] == 1:
        parts = [_columns(key, part.read(None), cut[1]) for part in stored]
    else:
        parts = [part.read(rows) for part, rows in _rows_by_part(cut[1], stored)]
        parts[-1] = _padded(key, parts[-1], cuts.pad_to(key))
    if not all(isinstance(part, QuantizedWeight) for part in parts):  # a checkpoint layer no kernel here runs
        state[key] = torch.cat([_tensor(p if isinstance(p, torch.Tensor) else dequantize(p), target.dtype)
                                for p in parts])
        return
    if key == "embed_tokens.weight":
        tied = make_linear(parts[0], None, target) if model.cfg.tie_word_embeddings else None
        if cut is not None:  # vocabulary-parallel: its lookup reads a dense shard (cluster/collectives.py)
            state[key] = dequantize(parts[0]).to(target.dtype)
        else:
            model.embed_tokens = QuantizedEmbedding(parts[0], target.dtype, tied)  # one copy of a tied table
        if tied is not None:
            model.output_projection = tied
        return
    if key == "lm_head.weight":
        model.lm_head = None
        model.output_projection = make_linear(parts[0], None, target)
        return
    path = key.removesuffix(".weight")
    parent_path, _, name = path.rpartition(".")
    bias = state.pop(f"{path}.bias", None)
    setattr(model.get_submodule(parent_path), name, fused_linear(parts, bias, target))


def _columns(key: str, value: torch.Tensor | QuantizedWeight, index: torch.Tensor) -> torch.Tensor | QuantizedWeight:
    if isinstance(value, QuantizedWeight):
        return cut_quantized(key, value, 1, index)
    return value.index_select(1, index)


def _checkpoint_layers(tensors: Iterator[tuple[str, _Stored]],
                       config: dict[str, Any]) -> Iterator[tuple[str, _Stored]]:
    """A quantized checkpoint's tensors with each quantized layer's parts as one weight, read (whole, then cut to
    the rows asked for: the packing is decoded on whole tensors) only when the loader reaches it, so a load holds
    its weights so far and one layer more, never the whole file."""
    for name, item in checkpoint.group_layers(tensors, config):
        if isinstance(item, _Stored):
            yield name, item
            continue
        module = name.removesuffix(".weight")

        def read(rows: torch.Tensor | None, parts: dict[str, _Stored] = item,
                 module: str = module) -> torch.Tensor | QuantizedWeight:
            layer = checkpoint.decode_layer({part: s.read(None) for part, s in parts.items()}, config, module)
            if rows is None:
                return layer
            return cut_quantized(module, layer, 0, rows) if isinstance(layer, QuantizedWeight) else layer[rows]

        shape = checkpoint.layer_shape({part: s.shape for part, s in item.items()}, config)
        yield name, _Stored(shape, read, quantized=True)


def open_gguf(path: Path) -> GGUFFile:
    """The file's header and tensor table, with the failures a user can act on named plainly."""
    try:
        return read_gguf(path)
    except Exception as exc:  # a bad magic, a cut header (struct.error), an unknown type, a short tensor...
        raise ValueError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({exc}); re-pull it or check the download"
        ) from exc


def _hf_language_model(tensors: Iterator[tuple[str, _Stored]], cfg: ModelConfig,
                       predicting: int = 0) -> Iterator[tuple[str, _Stored]]:
    """An HF checkpoint's language-model tensors under a causal LM's names, norm weights made what the norm
    multiplies by (Gemma stores w for 1 + w). `predicting`: the multi-token prediction layers DeepSeek-V3's and
    GLM-4.5's checkpoints store as layers past the decoder's (num_nextn_predict_layers), left out: a drafter ridge
    does not run."""
    drafter = range(cfg.num_layers, cfg.num_layers + predicting)
    for name, stored in tensors:
        if cfg.architecture == "bert":  # an encoder's: its masked LM head and pooler are not the encoder's (the
            # pooler is a classifier's, though: BERT's head reads it)
            name = ENCODER_PREFIX.sub("", name)
            if not NOT_ENCODER.match(name) or cfg.num_labels and name.startswith("pooler."):
                yield name, stored
            continue
        if cfg.vision is not None and (tower := VISION_TOWER.match(name)):  # a tower ridge runs: under `visual.`
            if not UNREAD_VISION.match(name, tower.end()):
                yield "visual." + name[tower.end():], stored
            continue
        if NOT_LANGUAGE_MODEL.match(name):
            continue
        for prefix, plain in LANGUAGE_MODEL_PREFIXES:
            name = re.sub("^" + prefix, plain, name)
        if (layer := _LAYER_INDEX.match(name)) and int(layer.group(1)) in drafter:
            continue
        if cfg.norm_weight_offset and name.endswith("norm.weight") and not _PLAIN_NORM.search(name):
            yield name, stored.mapped(lambda t: t.float() + cfg.norm_weight_offset)
        else:
            yield name, stored


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
# the gated DeltaNet's norm multiplies by its weight as stored, beside Qwen3.5's other norms (1 + w)
_PLAIN_NORM = re.compile(r"linear_attn\.norm\.weight$")
# a query projection that holds the output gate's rows too: HF's (q_proj) and llama.cpp's (attn_q); the gate's
# name for it
_QUERY_AND_GATE = re.compile(r"(.+)\.(self_attn\.q_proj|attn_q)\.(weight|bias)")
_GATE_NAME = {"self_attn.q_proj": "self_attn.q_gate", "attn_q": "attn_q_gate"}
# Qwen3-Next's projections whose rows go key head by key head: HF's, and llama.cpp's (ssm_in: qkvz; ssm_ba); the
# names of their parts, as Qwen3.5's checkpoints (qwen35 files) hold them
_GROUPED_PROJECTIONS = re.compile(r"(model\.layers\.\d+\.linear_attn)\.in_proj_(qkvz|ba)\.weight"
                                  r"|(blk\.\d+)\.(ssm_in|ssm_ba)\.weight")
_UNGROUPED_NAMES = {"qkvz": ("in_proj_qkv", "in_proj_z"), "ba": ("in_proj_b", "in_proj_a"),
                    "ssm_in": ("attn_qkv", "attn_gate"), "ssm_ba": ("ssm_beta", "ssm_alpha")}


def _split_gated_attention(tensors: Iterator[tuple[str, _Stored]], cfg: ModelConfig) -> Iterator[tuple[str, _Stored]]:
    """Qwen3.5's and Qwen3-Next's tensors as ridge holds them: q_proj's (attn_q's) rows, each head's query then its
    output gate, as q_proj (the queries) and q_gate (the gates); Qwen3-Next's in_proj_qkvz and in_proj_ba (a qwen3next
    file's ssm_in and ssm_ba), whose rows go key head by key head (its q, k, its value heads' v, z; their b, a), as
    Qwen3.5's in_proj_qkv, _z, _b, _a (attn_qkv, attn_gate, ssm_beta, ssm_alpha)."""
    heads, width = cfg.num_heads, cfg.head_dim
    per_head = torch.arange(heads)[:, None] * 2 * width
    queries = (per_head + torch.arange(width)).flatten()
    for name, stored in tensors:
        if match := _QUERY_AND_GATE.fullmatch(name):
            yield name, stored.reordered(queries)
            prefix, projection, kind = match.groups()
            yield f"{prefix}.{_GATE_NAME[projection]}.{kind}", stored.reordered(queries + width)
        elif cfg.state_mixer == "gated_delta" and (match := _GROUPED_PROJECTIONS.fullmatch(name)):
            prefix, kind = match.group(1) or match.group(3), match.group(2) or match.group(4)
            yield from _ungrouped_projections(prefix, kind, stored, cfg)
        else:
            yield name, stored


def _ungrouped_projections(prefix: str, kind: str, stored: _Stored, cfg: ModelConfig) -> Iterator[tuple[str, _Stored]]:
    groups, key, value = cfg.ssm_groups, cfg.ssm_state_size, cfg.ssm_head_dim
    per_group = cfg.ssm_num_heads // groups
    widths = [key, key, per_group * value, per_group * value] if kind in ("qkvz", "ssm_in") else [per_group, per_group]
    starts = torch.tensor([0, *widths[:-1]]).cumsum(0)
    group_rows = torch.arange(groups)[:, None] * sum(widths)

    def rows(part: int) -> torch.Tensor:  # the part's rows of every group, group by group
        return (group_rows + starts[part] + torch.arange(widths[part])).flatten()

    first, second = _UNGROUPED_NAMES[kind]
    if len(widths) == 4:
        yield f"{prefix}.{first}.weight", stored.reordered(torch.cat([rows(0), rows(1), rows(2)]))
        yield f"{prefix}.{second}.weight", stored.reordered(rows(3))
    else:
        yield f"{prefix}.{first}.weight", stored.reordered(rows(0))
        yield f"{prefix}.{second}.weight", stored.reordered(rows(1))


# Granite's experts, stacked [experts, rows, columns] in ridge's own per-expert layout (input_linear: gate's rows,
# then up's)
_GRANITE_STACKED = re.compile(r"model\.layers\.\d+\.block_sparse_moe\.(input|output)_linear\.weight")


def _split_stacked(tensors: Iterator[tuple[str, _Stored]], stacked: re.Pattern) -> Iterator[tuple[str, _Stored]]:
    """Each tensor whose name `stacked` matches, [experts, rows, columns], as one tensor an expert named
    `{name}.{expert}`, each read on its own (its slab of the file); every other tensor as it is."""
    for name, stored in tensors:
        if not stacked.fullmatch(name):
            yield name, stored
            continue
        for index in range(stored.shape[0]):
            yield f"{name}.{index}", _expert_slab(stored, index, transposed=False)


def _expert_slab(stored: _Stored, index: int, transposed: bool) -> _Stored:
    """Expert `index` of a stacked tensor [experts, rows, columns], read on its own (its slab of the file);
    transposed: the slab's transpose, contiguous ([in, out] stacks held as ridge's [out, in])."""
    def read(rows: torch.Tensor | None) -> torch.Tensor:
        slab = torch.as_tensor(stored.read(torch.tensor([index])))[0]
        weight = slab.T.contiguous() if transposed else slab
        return weight if rows is None else weight[rows]

    shape = tuple(stored.shape[1:])
    return _Stored(shape[::-1] if transposed else shape, read)


_NEMOTRON_H_BLOCK = re.compile(r"(?:backbone|model)\.layers\.(\d+)\.(?:norm\.weight|mixer\.(.+))")
_NEMOTRON_H_OTHERS = {"backbone.embeddings.weight": "model.embed_tokens.weight",
                      "model.embeddings.weight": "model.embed_tokens.weight",
                      "backbone.norm_f.weight": "model.norm.weight", "model.norm_f.weight": "model.norm.weight"}


def _nemotron_h_blocks(tensors: Iterator[tuple[str, _Stored]], config: dict) -> Iterator[tuple[str, _Stored]]:
    """Nemotron-H's blocks under the names of ridge's layers (models/spec.py's nemotron_h_layers): a mixer block's
    norm is its layer's input norm and its mixer the layer's Mamba-2 mixer or attention, the FFN block after it the
    layer's MLP (or mixture) behind the post-attention norm."""
    where: dict[int, tuple[int, str]] = {}  # block -> (ridge's layer, the part of it the block holds)
    for layer, (mixer, kind, ffn) in enumerate(nemotron_h_layers(config)):
        where[mixer] = (layer, "mamba" if kind == "mamba" else "self_attn")
        if ffn is not None:
            where[ffn] = (layer, "mlp")
    for name, stored in tensors:
        match = _NEMOTRON_H_BLOCK.fullmatch(name)
        if match is None:
            yield _NEMOTRON_H_OTHERS.get(name, name), stored
            continue
        layer, role = where[int(match.group(1))]
        if match.group(2) is None:  # the block's norm
            norm = "post_attention_layernorm" if role == "mlp" else "input_layernorm"
            yield f"model.layers.{layer}.{norm}.weight", stored
        else:
            yield f"model.layers.{layer}.{role}.{match.group(2)}", stored


_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _nemotron_h_gguf_blocks(tensors: Iterator[tuple[str, _Stored]], kinds: list[str]) -> Iterator[tuple[str, _Stored]]:
    """A nemotron_h file's blocks under the names of ridge's layers (_nemotron_h_blocks' for llama.cpp's names):
    each block's norm is attn_norm there, an MLP block's the layer's ffn_norm here."""
    where: dict[int, int] = {}  # block -> ridge's layer
    mlp_blocks = set()
    for layer, (mixer, _, ffn) in enumerate(nemotron_h_layers({"layers_block_type": kinds})):
        where[mixer] = layer
        if ffn is not None:
            where[ffn] = layer
            mlp_blocks.add(ffn)
    for name, stored in tensors:
        match = _GGUF_BLOCK.fullmatch(name)
        if match is None:
            yield name, stored
            continue
        block, rest = int(match.group(1)), match.group(2)
        if rest == "attn_norm.weight" and block in mlp_blocks:
            rest = "ffn_norm.weight"
        yield f"blk.{where[block]}.{rest}", stored


_HF_STACKED = re.compile(r"(model\.layers\.\d+\.(?:(?:mlp|feed_forward)\.)?experts)\.(gate_up|down)_proj")


def _split_hf_stacked_experts(tensors: Iterator[tuple[str, _Stored]],
                              cfg: ModelConfig) -> Iterator[tuple[str, _Stored]]:
    """Experts stacked in one tensor per projection (Qwen3-VL-MoE's, Mistral 4's, Llama 4's, Gemma 4's), as each
    expert's weights as ridge holds them ([out, in], gate's rows then up's), each read on its own; every other tensor
    as it is. Llama 4's are [experts, in, out] always; Qwen3-VL-MoE's published checkpoints stack [experts, in, out],
    HF transformers saves [experts, out, in]: the shape tells which (as HF's loader reads it, a square one as the
    latter)."""
    for name, stored in tensors:
        match = _HF_STACKED.fullmatch(name)
        if match is None:
            yield name, stored
            continue
        prefix, kind = match.groups()
        shape = ((2 * cfg.moe_intermediate_size, cfg.hidden_size) if kind == "gate_up"
                 else (cfg.hidden_size, cfg.moe_intermediate_size))  # [out, in], as ridge holds an expert's
        if tuple(stored.shape[1:]) not in (shape, shape[::-1]):
            raise ValueError(f"{name}: shape {list(stored.shape)}, not [experts, {shape[0]}, {shape[1]}] or its "
                             "transpose")
        transposed = cfg.architecture == "llama4" or tuple(stored.shape[1:]) != shape
        if transposed and tuple(stored.shape[1:]) != shape[::-1]:
            raise ValueError(f"{name}: shape {list(stored.shape)}, not [experts, {shape[1]}, {shape[0]}]")
        for index in range(stored.shape[0]):
            yield f"{prefix}.{index}.{kind}.weight", _expert_slab(stored, index, transposed)


_STACKED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up|down)_proj(_bias|_blocks|_scales)?")


def _split_experts(tensors: Iterator[tuple[str, _Stored]]) -> Iterator[tuple[str, _Stored]]:
    """gpt-oss's experts, stacked in one tensor per projection, as each expert's weights as ridge holds them
    ([out, in], gate's rows then up's), each expert read on its own (its slab of the file); every other tensor as
    it is. The stacked forms: dense [experts, in, out] (gate_up's columns gate and up interleaved: gate the even
    ones) with biases [experts, out]; or MXFP4 (quant/mxfp4.py), _blocks [experts, out, in / 32, 16] and _scales
    [experts, out, in / 32] (gate_up's rows interleaved), read as QuantizedWeights."""
    mxfp4_halves: dict[str, dict[str, _Stored]] = defaultdict(dict)
    for name, stored in tensors:
        match = _STACKED_EXPERTS.fullmatch(name)
        if match is None:
            yield name, stored
            continue
        prefix, kind, suffix = match.group(1), match.group(2), match.group(3) or ""
        gate_up = kind == "gate_up"
        if suffix in ("_blocks", "_scales"):
            halves = mxfp4_halves[f"{prefix}.{kind}_proj"]
            halves[suffix] = stored
            if len(halves) == 2:
                del mxfp4_halves[f"{prefix}.{kind}_proj"]
                yield from _mxfp4_experts(prefix, kind, halves["_blocks"], halves["_scales"])
            continue
        bias = suffix == "_bias"
        shape = stored.shape[1:] if bias else (stored.shape[2], stored.shape[1])

        def expert(rows: torch.Tensor | None, index: int, stored: _Stored = stored, bias: bool = bias,
                   gate_up: bool = gate_up) -> torch.Tensor:
            slab = torch.as_tensor(stored.read(torch.tensor([index])))[0]  # [in, out], or [out] for a bias
            if gate_up:
                slab = torch.cat([slab[..., 0::2], slab[..., 1::2]], dim=-1)
            weight = slab if bias else slab.T.contiguous()
            return weight if rows is None else weight[rows]

        for index in range(stored.shape[0]):
            yield (f"{prefix}.{index}.{kind}.{'bias' if bias else 'weight'}",
                   _Stored(tuple(shape), functools.partial(expert, index=index)))
    if mxfp4_halves:  # each pair was yielded and dropped when its second half came
        unpaired = sorted(name + half for name, halves in mxfp4_halves.items() for half in halves)
        raise ValueError(f"{', '.join(unpaired)}: MXFP4 blocks without their scales, or scales without their blocks "
                         "(a truncated checkpoint?)")


def _mxfp4_experts(prefix: str, kind: str, blocks: _Stored,
                   exponents: _Stored) -> Iterator[tuple[str, _Stored]]:
    """Each expert of one stacked MXFP4 projection, read (its rows asked for) as a QuantizedWeight."""
    experts, rows, groups, _ = blocks.shape
    # gate_up's rows interleaved in the file: gate's (the even ones) first here
    order = torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)]) if kind == "gate_up" else \
        torch.arange(rows)

    def expert(wanted: torch.Tensor | None, index: int) -> QuantizedWeight:
        take = order if wanted is None else order[wanted]
        slab = torch.as_tensor(blocks.read(torch.tensor([index])))[0]
        return mxfp4.from_hf(slab[take], torch.as_tensor(exponents.read(torch.tensor([index])))[0][take])

    for index in range(experts):
        yield (f"{prefix}.{index}.{kind}.weight",
               _Stored((rows, groups * mxfp4.GROUP), functools.partial(expert, index=index), quantized=True))


def _safetensors(path: Path) -> Iterator[tuple[str, _Stored]]:
    """Every tensor of a checkpoint's files, each read when asked (its rows as runs of slices of the file)."""
    for file in sorted(path.glob("*.safetensors")):
        handle = safe_open(file, framework="pt")  # open while a tensor of it is unread: its reads hold it
        for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
            yield name, _Stored(tuple(handle.get_slice(name).get_shape()), functools.partial(_read_rows, handle, name))


def _read_rows(handle: Any, name: str, rows: torch.Tensor | None) -> torch.Tensor:
    if rows is None:
        return handle.get_tensor(name)
    tensor = handle.get_slice(name)
    breaks = torch.nonzero(rows.diff() != 1).flatten() + 1  # where a run of consecutive rows ends
    starts, stops = [0, *breaks.tolist()], [*breaks.tolist(), len(rows)]
    runs = [tensor[int(rows[a]):int(rows[b - 1]) + 1] for a, b in zip(starts, stops, strict=True)]
    return torch.cat(runs) if len(runs) > 1 else runs[0]
