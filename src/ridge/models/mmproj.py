"""llama.cpp's multimodal projector files (`mmproj-*.gguf`, `--mmproj`): a vision tower beside a GGUF language model.

llama.cpp keeps a vision-language model's tower in a GGUF of its own (general.architecture `clip`), written by its
converter from the HF checkpoint: the tower's shape under `clip.vision.*`, the processor's mean and deviation, and
the tensors under its `v.*` / `mm.*` names. This module reads the header into the VisionConfig ridge's towers run
(models/vision.py, models/siglip.py, models/pixtral.py) and the language model's fields that go with it: its image
token, read from the language model's own vocabulary by name, and Qwen2-VL's M-RoPE sections, from the language
model's header. The loader reads the tensors under the towers' names (tensor_names.MMPROJ_*, models/loader.py's
_mmproj_tensors).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ridge.models.gguf_file import GGUFFile, read_gguf
from ridge.models.spec import ModelSpec, gguf_value
from ridge.multimodal.images import QWEN2_VL_PROCESSING, QWEN3_VL_PROCESSING, ImageProcessing
from ridge.multimodal.vision_config import VisionConfig

# clip.projector_type -> the language models' GGUF architectures it goes with
PROJECTORS = {"qwen2vl_merger": ("qwen2vl",), "qwen2.5vl_merger": ("qwen2vl",),
              "qwen3vl_merger": ("qwen3vl", "qwen3vlmoe"), "gemma3": ("gemma3",),
              "pixtral": ("llama", "mistral3")}  # (Mistral Small 3.1's files are llama's, Ministral 3's mistral3's)
# Qwen2.5-VL's windows (pixels a side): every published checkpoint's, which its mmproj files do not carry
QWEN2_5_VL_WINDOW = 112
# the projector's pooling of Gemma 3's patches, a side: what llama.cpp assumes where clip.vision.projector.scale_factor
# is absent (written only for other values)
GEMMA3_POOLING = 4


@dataclass(frozen=True)
class Projector:
    """A projector file, its header and tensor table read (its tensors are read as the model loads)."""

    path: Path
    gguf: GGUFFile

    @classmethod
    def open(cls, path: str | Path) -> Projector:
        path = Path(path).expanduser()
        if not path.is_file():
            raise ValueError(f"mmproj: {path} is not a file (llama.cpp's mmproj-*.gguf)")
        try:
            gguf = read_gguf(path)
        except Exception as exc:  # a bad magic, a cut header, an unknown type...
            raise ValueError(f"mmproj: {path}: not a readable GGUF file, truncated or corrupt ({exc})") from exc
        projector_type(gguf, path.name)
        return cls(path, gguf)


def projector_type(projector: GGUFFile, source: str) -> str:
    """The file's clip.projector_type (clip.vision.projector_type in files of several encoders), one ridge runs."""
    if gguf_value(projector, "general.architecture") != "clip":
        raise ValueError(f"mmproj: {source} is not a multimodal projector (general.architecture "
                         f"{gguf_value(projector, 'general.architecture')!r}, not 'clip')")
    kind = gguf_value(projector, "clip.vision.projector_type", gguf_value(projector, "clip.projector_type"))
    if kind not in PROJECTORS:
        raise ValueError(f"mmproj: {source}: clip.projector_type {kind!r} is not supported "
                         f"({', '.join(PROJECTORS)})")
    return kind


def with_projector(spec: ModelSpec, language: GGUFFile, projector: GGUFFile, source: str) -> ModelSpec:
    """`spec` (a GGUF language model's) with the projector file's vision tower and image token; ValueError naming the
    field where the two files do not go together."""
    kind = projector_type(projector, source)
    arch = gguf_value(language, "general.architecture")
    if arch not in PROJECTORS[kind]:
        raise ValueError(f"mmproj: a {kind} projector goes with a {' / '.join(PROJECTORS[kind])} language model; "
                         f"{spec.name} is {arch}")

    def value(key: str, default: Any = None) -> Any:
        found = gguf_value(projector, key, default)
        if found is None:
            raise ValueError(f"mmproj: {source}: no {key} in its header")
        return found

    output_size = int(value("clip.vision.projection_dim"))
    if output_size != spec.hidden_size:
        raise ValueError(f"mmproj: {source}: clip.vision.projection_dim {output_size} is not the language model's "
                         f"width ({spec.hidden_size}): the projector is another model's")
    tokens = gguf_value(language, "tokenizer.ggml.tokens") or []
    shapes = {t.name: t.shape for t in projector.tensors}
    if kind == "pixtral":
        vision = _pixtral_tower(value, output_size, shapes, spec.rms_norm_eps, source)
        return dataclasses.replace(spec, vision=vision, image_token_id=_token(tokens, "[IMG]", spec.name))
    if kind == "gemma3":
        vision = _gemma3_tower(value, output_size, tokens, spec.name)
        return dataclasses.replace(spec, vision=vision, image_token_id=_token(tokens, "<image_soft_token>", spec.name))
    sections = gguf_value(language, f"{arch}.rope.dimension_sections")
    if not sections or sum(sections[:3]) * 2 != spec.head_dim:
        raise ValueError(f"mmproj: {spec.name}: {arch}.rope.dimension_sections {sections} do not split its "
                         f"{spec.head_dim // 2} rotary pairs in three (M-RoPE's time, height, width)")
    if kind == "qwen3vl_merger":
        vision = _qwen3_tower(value, output_size, shapes, source)
        levels = int(gguf_value(language, f"{arch}.n_deepstack_layers", len(vision.deepstack_blocks)))
        if levels != len(vision.deepstack_blocks):
            raise ValueError(f"mmproj: {spec.name}: {arch}.n_deepstack_layers {levels} is not the projector's "
                             f"{len(vision.deepstack_blocks)} DeepStack mergers (clip.vision.is_deepstack_layers)")
    else:
        vision = _qwen_tower(kind, value, output_size, shapes, source)
    return dataclasses.replace(spec, vision=vision, image_token_id=_token(tokens, "<|image_pad|>", spec.name),
                               mrope_section=tuple(int(n) for n in sections[:3]),
                               mrope_interleaved=kind == "qwen3vl_merger")


def projector_processing(projector: GGUFFile, tower: VisionConfig) -> ImageProcessing:
    """How the projector's images are cut into patches: its header's mean and deviation (and Qwen2-VL's pixel budget
    where the file has one), the family's processor otherwise."""
    mean = tuple(gguf_value(projector, "clip.vision.image_mean"))
    std = tuple(gguf_value(projector, "clip.vision.image_std"))
    if tower.family == "siglip":  # Gemma 3's fixed square, bilinear
        return ImageProcessing.square_of(tower, mean, std)
    if tower.family == "pixtral":  # within the tower's image size a side
        return ImageProcessing.longest_edge_of(tower, mean, std, tower.longest_edge)
    defaults = QWEN3_VL_PROCESSING if tower.patch_size == QWEN3_VL_PROCESSING.patch_size else QWEN2_VL_PROCESSING
    return dataclasses.replace(
        defaults, mean=mean, std=std,
        min_pixels=int(gguf_value(projector, "clip.vision.image_min_pixels", defaults.min_pixels)),
        max_pixels=int(gguf_value(projector, "clip.vision.image_max_pixels", defaults.max_pixels)))


def _qwen_tower(kind: str, value, output_size: int, shapes: dict[str, tuple[int, ...]], source: str) -> VisionConfig:
    """Qwen2-VL's (LayerNorms, a plain MLP) or Qwen2.5-VL's tower (RMSNorms, a gated MLP, windows but on every
    n_wa_pattern-th block). The MLP's width is read off its tensor: the converter writes Qwen2-VL's merger width
    as feed_forward_length."""
    if "v.patch_embd.weight.1" not in shapes:
        raise ValueError(f"mmproj: {source}: no v.patch_embd.weight.1 (Qwen2-VL's second frame of each patch)")
    depth = int(value("clip.vision.block_count"))
    windowed = kind == "qwen2.5vl_merger"
    pattern = int(value("clip.vision.n_wa_pattern")) if windowed else 0
    return VisionConfig(
        depth=depth, width=int(value("clip.vision.embedding_length")),
        num_heads=int(value("clip.vision.attention.head_count")),
        intermediate_size=int(shapes["v.blk.0.ffn_up.weight"][0]), output_size=output_size,
        activation="silu" if windowed else "quick_gelu", gated_mlp=windowed, rms_norm=windowed,
        window_size=int(value("clip.vision.window_size", QWEN2_5_VL_WINDOW)) if windowed else None,
        full_attention_blocks=tuple(i for i in range(depth) if (i + 1) % pattern == 0) if windowed else (),
        patch_size=int(value("clip.vision.patch_size")), temporal_patch_size=2,
        merge_size=int(value("clip.vision.spatial_merge_size", 2)))


def _qwen3_tower(value, output_size: int, shapes: dict[str, tuple[int, ...]], source: str) -> VisionConfig:
    """Qwen3-VL's tower: Qwen2-VL's blocks over 16-pixel patches with a biased patch embedding, a learned position
    table (its rows read off its tensor) and DeepStack's mergers after the blocks clip.vision.is_deepstack_layers
    marks."""
    if "v.patch_embd.weight.1" not in shapes or "v.position_embd.weight" not in shapes:
        raise ValueError(f"mmproj: {source}: a qwen3vl_merger projector without v.patch_embd.weight.1 or "
                         "v.position_embd.weight")
    marked = _gguf_list(value("clip.vision.is_deepstack_layers", []))
    return VisionConfig(
        depth=int(value("clip.vision.block_count")), width=int(value("clip.vision.embedding_length")),
        num_heads=int(value("clip.vision.attention.head_count")),
        intermediate_size=int(shapes["v.blk.0.ffn_up.weight"][0]), output_size=output_size,
        activation="gelu_pytorch_tanh", gated_mlp=False, rms_norm=False,
        patch_size=int(value("clip.vision.patch_size")), temporal_patch_size=2,
        merge_size=int(value("clip.vision.spatial_merge_size", 2)), patch_bias="v.patch_embd.bias" in shapes,
        position_embeddings=int(shapes["v.position_embd.weight"][0]),
        deepstack_blocks=tuple(i for i, deep in enumerate(marked) if deep))


def _gguf_list(read: Any) -> list:
    """A header array as a list (gguf_value reads a one-item array as its item)."""
    return read if isinstance(read, list) else [read]


def _pixtral_tower(value, output_size: int, shapes: dict[str, tuple[int, ...]], text_eps: float,
                   source: str) -> VisionConfig:
    """Mistral 3's Pixtral encoder and projector. Pixtral-12B's LLaVA projector (no patch merger) is another model's
    and refused; the projector's norm is the language model's (its epsilon: the file has none of its own)."""
    if "mm.patch_merger.weight" not in shapes:
        raise ValueError(f"mmproj: {source}: a pixtral projector without mm.patch_merger (Pixtral-12B's LLaVA "
                         "projector) is not supported (Mistral 3's)")
    silu, gelu = bool(value("clip.use_silu", False)), bool(value("clip.use_gelu", False))
    return VisionConfig(
        depth=int(value("clip.vision.block_count")), width=int(value("clip.vision.embedding_length")),
        num_heads=int(value("clip.vision.attention.head_count")),
        intermediate_size=int(shapes["v.blk.0.ffn_up.weight"][0]), output_size=output_size,
        activation="gelu" if gelu and not silu else "silu", gated_mlp=True, rms_norm=True,
        patch_size=int(value("clip.vision.patch_size")), temporal_patch_size=1,
        merge_size=int(value("clip.vision.spatial_merge_size", 2)), family="pixtral",
        norm_eps=float(value("clip.vision.attention.layer_norm_epsilon", 1e-5)), projector_norm_eps=text_eps,
        projector_bias="mm.1.bias" in shapes, longest_edge=int(value("clip.vision.image_size")))


def _gemma3_tower(value, output_size: int, tokens: list[str], name: str) -> VisionConfig:
    """SigLIP over a fixed square, then Gemma 3's projector: its patches pooled a scale_factor a side."""
    side, patch = int(value("clip.vision.image_size")), int(value("clip.vision.patch_size"))
    pooling = int(value("clip.vision.projector.scale_factor", GEMMA3_POOLING))
    if side % patch or (side // patch) % pooling:
        raise ValueError(f"mmproj: clip.vision.image_size {side} is not a whole number of {patch}-pixel patches "
                         f"pooled {pooling} a side")
    eps = float(value("clip.vision.attention.layer_norm_epsilon", 1e-6))
    return VisionConfig(
        depth=int(value("clip.vision.block_count")), width=int(value("clip.vision.embedding_length")),
        num_heads=int(value("clip.vision.attention.head_count")),
        intermediate_size=int(value("clip.vision.feed_forward_length")), output_size=output_size,
        activation="gelu_pytorch_tanh", gated_mlp=False, rms_norm=False, patch_size=patch, temporal_patch_size=1,
        merge_size=pooling, family="siglip", norm_eps=eps, projector_norm_eps=eps,
        position_embeddings=(side // patch) ** 2, longest_edge=side, bidirectional=True,
        start_token_id=_token(tokens, "<start_of_image>", name), end_token_id=_token(tokens, "<end_of_image>", name))


def _token(tokens: list[str], text: str, name: str) -> int:
    try:
        return tokens.index(text)
    except ValueError:
        raise ValueError(f"mmproj: {name}'s vocabulary has no {text} token (where its images go)") from None
