"""A request's adapter, named as vLLM names it (vllm.lora.request.LoRARequest)."""

from __future__ import annotations

from dataclasses import dataclass

from ridge.config import lora_module


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with: its name (what a server's clients pass as `model`), a positive id, and
    its PEFT directory (adapter_config.json and adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name: an adapter needs a name")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be at least 1 (0 is the base model), got {self.lora_int_id}")

    @classmethod
    def from_modules(cls, modules: tuple[str, ...] | list[str]) -> list[LoRARequest]:
        """--lora-modules' adapters (`name=path` each), their ids counted from 1 in order."""
        pairs = [lora_module(module) for module in modules]
        return [cls(name, i + 1, path) for i, (name, path) in enumerate(pairs)]
