"""What `ridge plan` reasons about: a model's shape, a machine's ceilings and a workload.

A model comes from a preset (presets.toml), an HF config.json or a GGUF header; a machine from
hardware.toml or from measuring this one. Every field can be overridden (`--set field=value`), so a
user can ask "what if this model had 4 KV heads" without writing a config.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

DATA = Path(__file__).parent


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape: enough to count its parameters, FLOPs and KV bytes."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense FFN's width (of the dense layers, in an MoE model)
    tie_word_embeddings: bool = False
    gated_ffn: bool = True  # SwiGLU / GeGLU: gate, up and down matrices; else up and down
    qkv_bias: bool = False
    # mixture of experts: each MoE layer holds num_experts FFNs of moe_intermediate_size and runs
    # experts_per_token of them, plus shared_experts always-on ones; the first first_dense_layers are dense
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_experts: int = 0
    first_dense_layers: int = 0
    # multi-head latent attention (DeepSeek): the cache holds a kv_lora_rank latent and one shared rotary
    # key of qk_rope_head_dim per token and layer, instead of K and V per KV head
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # local / global attention (Gemma 3): all but every global_every-th layer see only sliding_window tokens
    sliding_window: int = 0
    global_every: int = 0
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_kind(self) -> str:
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def local_layers(self) -> int:
        """Layers that attend to at most sliding_window tokens."""
        if not self.sliding_window:
            return 0
        if not self.global_every:
            return self.num_layers
        return self.num_layers - self.num_layers // self.global_every

    def validate(self) -> ModelSpec:
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model {self.name}: {f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                             f"({self.num_heads})")
        if self.is_moe and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"model {self.name}: experts_per_token must be in 1..num_experts ({self.num_experts})")
        return self


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator's (or machine's) ceilings. FLOP/s are dense (no 2:4 sparsity), per dtype."""

    name: str
    memory_gb: float  # decimal GB, as vendors state it
    bandwidth_gb_s: float
    tflops: dict[str, float] = field(default_factory=dict)  # dtype -> dense TFLOP/s
    source: str = ""

    def flops(self, dtype: str) -> float:
        """FLOP/s for a dtype's matmuls: the dtype's own figure, else the nearest wider one listed."""
        for candidate in _COMPUTE_FALLBACK.get(dtype, (dtype,)):
            if candidate in self.tflops:
                return self.tflops[candidate] * 1e12
        raise ValueError(f"hardware {self.name}: no FLOP/s for {dtype} (has {', '.join(self.tflops)})")

    def ridge_point(self, dtype: str) -> float:
        """FLOPs per byte at which a kernel stops being bandwidth-bound and becomes compute-bound."""
        return self.flops(dtype) / (self.bandwidth_gb_s * 1e9)


@dataclass(frozen=True)
class Workload:
    context: int = 4096  # tokens each sequence holds while decoding (prompt + output so far)
    prompt: int | None = None  # prefill length for TTFT (default: context)
    batch: int = 1
    dtype: str = "bf16"  # weights
    kv_dtype: str = "bf16"
    gpus: int = 1
    price_per_hour: float | None = None  # for all `gpus` together
    memory_utilization: float = 0.9  # of device memory for weights + KV (vLLM's default)
    shared_prefix: float = 0.0  # fraction of prompt tokens shared with earlier requests (prefix caching)
    tpot_target: float | None = None  # seconds per output token a running request may take at most
    throughput: float | None = None  # tok/s to price (default: the decode ceiling)

    def validate(self) -> Workload:
        if self.context <= 0:
            raise ValueError(f"context: {self.context} tokens; must be positive")
        if self.prompt is not None and self.prompt <= 0:
            raise ValueError(f"prompt: {self.prompt} tokens; must be positive")
        if self.batch <= 0:
            raise ValueError(f"batch: {self.batch}; must be at least 1")
        if self.gpus <= 0:
            raise ValueError(f"gpus: {self.gpus}; must be at least 1")
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise ValueError(f"price per hour: {self.price_per_hour}; must not be negative")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory utilization: {self.memory_utilization} is outside (0, 1]")
        if not 0 <= self.shared_prefix <= 1:
            raise ValueError(f"shared prefix: {self.shared_prefix} is outside [0, 1]")
        if self.tpot_target is not None and self.tpot_target <= 0:
            raise ValueError(f"TPOT target: {self.tpot_target} s; must be positive")
        if self.throughput is not None and self.throughput <= 0:
            raise ValueError(f"throughput: {self.throughput} tok/s; must be positive")
        dtype_bytes(self.dtype), dtype_bytes(self.kv_dtype)  # raise on an unknown dtype
        return self

    @property
    def prompt_tokens(self) -> int:
        return self.prompt or self.context


# a dtype without its own figure runs at the next wider one's rate (int4 weights are dequantized to bf16)
_COMPUTE_FALLBACK = {
    "fp4": ("fp4", "fp8", "bf16"), "int4": ("bf16",), "fp8": ("fp8", "bf16"), "int8": ("int8", "bf16"),
    "bf16": ("bf16", "fp16"), "fp16": ("fp16", "bf16"), "fp32": ("fp32",),
}

# bytes per stored value of each weight / KV dtype (int4: one scale per group of 64 adds 1/32 byte)
BYTES_PER_VALUE = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "fp4": 0.5}


def dtype_bytes(dtype: str) -> float:
    if dtype not in BYTES_PER_VALUE:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(BYTES_PER_VALUE)}")
    return BYTES_PER_VALUE[dtype]


def _load_table(file: str) -> dict[str, dict]:
    with open(DATA / file, "rb") as f:
        return tomllib.load(f)


def model_presets() -> dict[str, ModelSpec]:
    return {name: ModelSpec(name=name, **fields) for name, fields in _load_table("presets.toml").items()}


def hardware_table() -> dict[str, HardwareSpec]:
    return {name: HardwareSpec(name=name, **fields) for name, fields in _load_table("hardware.toml").items()}


# HF config.json keys -> ModelSpec fields (first key present wins)
_HF_KEYS = {
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_heads": ("num_attention_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner"),
    "tie_word_embeddings": ("tie_word_embeddings",),
    "qkv_bias": ("attention_bias",),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "experts_per_token": ("num_experts_per_tok", "num_experts_per_token"),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "shared_experts": ("n_shared_experts",),
    "first_dense_layers": ("first_k_dense_replace",),
    "kv_lora_rank": ("kv_lora_rank",),
    "q_lora_rank": ("q_lora_rank",),
    "qk_rope_head_dim": ("qk_rope_head_dim",),
    "qk_nope_head_dim": ("qk_nope_head_dim",),
    "v_head_dim": ("v_head_dim",),
    "sliding_window": ("sliding_window",),
    "global_every": ("sliding_window_pattern",),
}


def spec_from_hf_config(config: dict, name: str, source: str = "config.json") -> ModelSpec:
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    fields: dict = {}
    for spec_field, keys in _HF_KEYS.items():
        for key in keys:
            if config.get(key) is not None:
                fields[spec_field] = config[key]
                break
    for required in ("vocab_size", "hidden_size", "num_layers", "num_heads"):
        if required not in fields:
            raise ValueError(f"{source}: no {required} ({' / '.join(_HF_KEYS[required])})")
    fields.setdefault("num_kv_heads", fields["num_heads"])
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_heads"])
    fields.setdefault("intermediate_size", 4 * fields["hidden_size"])
    if config.get("model_type", "").startswith("qwen2") and "qkv_bias" not in fields:
        fields["qkv_bias"] = True  # Qwen2 has q / k / v biases without saying so in its config
    if config.get("use_sliding_window") is False:
        fields.pop("sliding_window", None)
    if fields.get("num_experts") and not fields.get("moe_intermediate_size"):
        fields["moe_intermediate_size"] = fields["intermediate_size"]  # Mixtral: experts as wide as a dense FFN
    if config.get("layer_types") and fields.get("sliding_window"):  # newer configs list each layer's kind
        full = sum(kind == "full_attention" for kind in config["layer_types"])
        fields["global_every"] = fields["num_layers"] // full if full else 0
    fields["qkv_bias"] = bool(fields.get("qkv_bias", False))
    if fields.get("q_lora_rank") is None:
        fields.pop("q_lora_rank", None)
    return ModelSpec(name=name, source=source, **fields).validate()


def spec_from_gguf(path: Path) -> ModelSpec:
    """A GGUF file's header (its `<arch>.*` keys), without reading the tensors."""
    from ridge.models.gguf_file import read_gguf

    gguf = read_gguf(path)

    def value(key: str, default=None):
        v = gguf.fields.get(key, default)
        return v[0] if isinstance(v, list) and len(v) == 1 else v

    arch = value("general.architecture")
    heads = int(value(f"{arch}.attention.head_count"))
    hidden = int(value(f"{arch}.embedding_length"))
    tokens = value("tokenizer.ggml.tokens")
    vocab = int(value(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    kv = value(f"{arch}.attention.head_count_kv", heads)
    names = {t.name for t in gguf.tensors}
    return ModelSpec(
        name=path.stem, vocab_size=vocab, hidden_size=hidden, num_layers=int(value(f"{arch}.block_count")),
        num_heads=heads, num_kv_heads=int(kv), head_dim=int(value(f"{arch}.attention.key_length", hidden // heads)),
        intermediate_size=int(value(f"{arch}.feed_forward_length")),
        tie_word_embeddings="output.weight" not in names, qkv_bias="blk.0.attn_q.bias" in names,
        num_experts=int(value(f"{arch}.expert_count", 0)), experts_per_token=int(value(f"{arch}.expert_used_count", 0)),
        moe_intermediate_size=int(value(f"{arch}.expert_feed_forward_length", 0)),
        sliding_window=int(value(f"{arch}.attention.sliding_window", 0)),
        global_every=6 if arch == "gemma3" else 0,  # Gemma 3's pattern is fixed by the architecture, not stored
        source=f"GGUF header of {path.name}",
    ).validate()


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset's name, a ridge model name (its pulled GGUF), a config.json, a GGUF file, or a directory
    holding a config.json."""
    presets = model_presets()
    if name_or_path in presets:
        return presets[name_or_path].validate()
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        path = path / "config.json"
    if path.suffix == ".json" and path.exists():
        return spec_from_hf_config(json.loads(path.read_text()), path.parent.name or path.stem, str(path))
    if path.suffix == ".gguf" and path.exists():
        return spec_from_gguf(path)
    raise ValueError(f"model: {name_or_path!r} is not a preset, config.json or GGUF file; presets: "
                     + ", ".join(presets))


def resolve_hardware(name: str, measure_this_machine=None) -> HardwareSpec:
    """A row of hardware.toml, or `this-machine` (measured by `measure_this_machine()`)."""
    if name == "this-machine":
        if measure_this_machine is None:
            from ridge.plan.machine import measure_this_machine
        return measure_this_machine()
    table = hardware_table()
    if name not in table:
        raise ValueError(f"hardware: {name!r} is not known; known: {', '.join(table)}, this-machine")
    return table[name]


def override(spec, assignments: list[str]):
    """`field=value` strings applied to a ModelSpec or HardwareSpec, each value parsed as its field's type;
    a hardware's FLOP/s per dtype as `tflops.DTYPE=value`."""
    names = [f.name for f in dataclasses.fields(spec) if f.name != "name"]
    settable = ", ".join(n if n != "tflops" else "tflops.DTYPE" for n in names)
    changes: dict = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        field_name, _, dtype = key.partition(".")
        if not sep or field_name not in names or (field_name == "tflops") != bool(dtype):
            raise ValueError(f"--set {item!r}: expected field=value with field one of {settable}")
        current = getattr(spec, field_name)
        try:
            if field_name == "tflops":
                changes["tflops"] = {**changes.get("tflops", current), dtype: float(raw)}
            elif isinstance(current, bool):
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                changes[key] = raw.lower() in ("true", "1")
            else:
                changes[key] = int(raw) if isinstance(current, int) else type(current)(raw)
        except ValueError:
            kind = "number" if field_name == "tflops" else type(current).__name__
            raise ValueError(f"--set {item!r}: {key} takes a {kind}") from None
    out = dataclasses.replace(spec, **changes)
    return out.validate() if isinstance(out, ModelSpec) else out
