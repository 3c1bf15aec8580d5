"""What `ridge plan` reasons about: a model's shape, a machine's ceilings and a workload.

A model comes from a preset (models/presets.toml), an HF config.json or a GGUF header; a machine from
hardware.toml or from measuring this one. Every field can be overridden (`--set field=value`), so a
user can ask "what if this model had 4 KV heads" without writing a config.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ridge.kv.formats import KV_FORMATS
from ridge.models.spec import ModelSpec

DATA = Path(__file__).parent


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator's (or machine's) ceilings. FLOP/s are dense (no 2:4 sparsity), per dtype."""

    name: str
    memory_gb: float  # decimal GB, as vendors state it
    bandwidth_gb_s: float
    tflops: dict[str, float] = field(default_factory=dict)  # dtype -> dense TFLOP/s
    source: str = ""
    link: str = ""  # the interconnect between two of them ([links] of hardware.toml; "" where none is listed)

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
class LinkSpec:
    """An interconnect: what one step of a ring all-reduce costs over it."""

    name: str
    bandwidth_gb_s: float  # one way, between two devices
    latency_us: float  # per step of the ring, whatever its size
    source: str = ""


@dataclass(frozen=True)
class Workload:
    context: int = 4096  # tokens each sequence holds while decoding (prompt + output so far)
    prompt: int | None = None  # prefill length for TTFT (default: context)
    batch: int = 1
    dtype: str = "bf16"  # weights
    kv_dtype: str = "bf16"
    gpus: int = 1
    link: str | None = None  # the interconnect between the gpus (default: the hardware's)
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
        dtype_bytes(self.dtype)  # raise on an unknown dtype
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype: {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
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
# a KV cache's dtypes: the plain ones, and ridge's quantized formats (kv/formats.py: codes, scales, int2's tails)
KV_DTYPES = [*BYTES_PER_VALUE, *(name for name in KV_FORMATS if name not in BYTES_PER_VALUE)]


def dtype_bytes(dtype: str) -> float:
    if dtype not in BYTES_PER_VALUE:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(BYTES_PER_VALUE)}")
    return BYTES_PER_VALUE[dtype]


def _load_table(file: str) -> dict[str, dict]:
    with open(DATA / file, "rb") as f:
        return tomllib.load(f)


def hardware_table() -> dict[str, HardwareSpec]:
    return {name: HardwareSpec(name=name, **fields) for name, fields in _load_table("hardware.toml").items()
            if name != "links"}


def link_table() -> dict[str, LinkSpec]:
    return {name: LinkSpec(name=name, **fields) for name, fields in _load_table("hardware.toml")["links"].items()}


def resolve_link(hw: HardwareSpec, name: str | None) -> LinkSpec:
    """The named link, or the hardware's own (ValueError naming the choices where it has none)."""
    table = link_table()
    chosen = name or hw.link
    if not chosen:
        raise ValueError(f"link: {hw.name} lists no interconnect between devices; name one of {', '.join(table)} "
                         "(--link)")
    if chosen not in table:
        raise ValueError(f"link: {chosen!r} is not known; known: {', '.join(table)}")
    return table[chosen]


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
