"""Named model shapes (presets.toml) and the one function that reads a shape from a name or a file.

`ridge plan` reasons about them; the engine builds random-weight models of them (models/random_weights.py).
"""

from __future__ import annotations

import json
import tomllib
from functools import cache
from pathlib import Path

from ridge.models.gguf_file import read_gguf
from ridge.models.spec import ModelSpec, nemotron_h_layers, spec_from_gguf, spec_from_hf_config


@cache
def _preset_table() -> dict[str, dict]:
    with open(Path(__file__).parent / "presets.toml", "rb") as f:
        return tomllib.load(f)


def model_presets() -> dict[str, ModelSpec]:
    return {name: ModelSpec(name=name, **_spec_fields(fields)) for name, fields in _preset_table().items()}


def _spec_fields(preset: dict) -> dict:
    """A preset's ModelSpec fields; its state-space layers written as "all", or as the rest of the layers
    beside attention_layer_indices (Bamba's own key); NoPE layers as nope_every; Nemotron-H's blocks as its
    pattern (nemotron_blocks)."""
    fields = dict(preset)
    layers = fields.get("num_layers", 0)
    if fields.get("ssm_layers") == "all":
        fields["ssm_layers"] = tuple(range(layers))
    if (attention := fields.pop("attention_layer_indices", None)) is not None:
        fields["ssm_layers"] = tuple(i for i in range(layers) if i not in attention)
    if (every := fields.pop("nope_every", None)) is not None:  # SmolLM3's NoPE layers: the last of every n
        fields["nope_layers"] = tuple(i for i in range(layers) if (i + 1) % every == 0)
    if "nope_temperature" in fields:  # Llama 4's (scale, period)
        fields["nope_temperature"] = tuple(fields["nope_temperature"])
    if (blocks := fields.pop("nemotron_blocks", None)) is not None:  # Nemotron-H's, as its hybrid_override_pattern
        layers = nemotron_h_layers({"hybrid_override_pattern": blocks})
        fields.update(num_layers=len(layers), ssm_layers=tuple(i for i, (_, kind, _) in enumerate(layers)
                                                               if kind == "mamba"),
                      mlp_free_layers=tuple(i for i, (_, _, ffn) in enumerate(layers) if ffn is None),
                      partial_rotary_factor=0.0, gated_ffn=False, hidden_act="relu2")
    return fields


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset's name, a config.json, a GGUF file, or a directory holding a config.json -> its shape."""
    presets = model_presets()
    if name_or_path in presets:
        return presets[name_or_path].validate()
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        path = path / "config.json"
    if path.suffix == ".json" and path.exists():
        return spec_from_hf_config(json.loads(path.read_text()), path.parent.name or path.stem, str(path))
    if path.suffix == ".gguf" and path.exists():
        return spec_from_gguf(read_gguf(path), path.stem, f"GGUF header of {path.name}")
    raise ValueError(f"model: {name_or_path!r} is not a preset, config.json or GGUF file; presets: "
                     + ", ".join(presets))
