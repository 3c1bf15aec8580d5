"""The adapters an engine serves, and their products added to a step's projections.

Each adapted projection gets a forward hook: its base output (whatever kernel and weight format made it) plus each
row's adapter's x @ A.T @ B.T (_Product). Hooks, not wrapper modules: the projections keep their types,
so the fused decode stack, which has no adapter path, still runs every step without one (the runner sends steps
with adapters down the layer-by-layer path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ridge.cluster.shards import ShardPlan
from ridge.config import ModelConfig
from ridge.lora.adapter import Adapter, LoRAWeights, read_adapter
from ridge.lora.request import LoRARequest
from ridge.models.moe import MoEBlock
from ridge.models.transformer import DecoderModel

log = logging.getLogger("ridge")

NO_ADAPTER = -1  # a row of the base model


@dataclass(frozen=True)
class AdapterStep:
    """Which adapter each row of a step runs with (NO_ADAPTER: none), and the adapters in the step."""

    row_adapters: torch.Tensor  # [T] long
    adapters: tuple[int, ...]  # those in the step, ascending
    uniform: bool  # every row runs with the one adapter
    # the rows whose logits are read, where the model goes on with those alone (Gemma 4's KV-shared layers)
    kept: AdapterStep | None = None

    @classmethod
    def of(cls, row_adapters: torch.Tensor, kept_rows: torch.Tensor | None = None) -> AdapterStep:
        kept = None if kept_rows is None else cls.of(row_adapters[kept_rows])
        present = row_adapters.unique().tolist()
        adapters = tuple(a for a in present if a != NO_ADAPTER)
        return cls(row_adapters, adapters, present == list(adapters) and len(adapters) == 1, kept)

    def serving(self, rows: int) -> AdapterStep:
        """The step of a projection's `rows` input rows: all the step's, or the kept ones."""
        if rows == len(self.row_adapters) or self.kept is None:
            return self
        assert rows == len(self.kept.row_adapters), f"{rows} rows in a step of {len(self.row_adapters)}"
        return self.kept


@dataclass(frozen=True)
class _Stacked:
    """Some adapters' factors of one projection side by side."""

    adapters: tuple[int, ...]
    a: torch.Tensor  # [sum of ranks, in]
    b: torch.Tensor  # [sum of ranks, out]: B transposed, the layout addmm reads fastest
    owners: torch.Tensor  # [sum of ranks]: each rank's adapter


class _Product:
    """One projection's hook: the adapters' products added to its output in the step that runs.

    The step's adapters' factors side by side (kept while the step's set of adapters stays the same, as it does from
    one decode step to the next): x @ A.T gives every row every adapter's low-rank activations, a mask zeroes those
    of the other adapters (and all of a base row's), and one addmm adds the rest through B. Three ops whatever the
    mix, where one pair of matmuls per adapter would cost 4 ops each: a CPU step of a small model is bound by its op
    count (docs/notes/lora.md)."""

    def __init__(self, owner: AdapterSet) -> None:
        self.owner = owner
        self.weights: dict[int, LoRAWeights] = {}  # by adapter index
        self._stacked: _Stacked | None = None  # the last step's

    def forget(self, adapter: int) -> None:
        """Drop the stacked factors that hold `adapter`'s (unloaded)."""
        if self._stacked is not None and adapter in self._stacked.adapters:
            self._stacked = None

    def _factors(self, adapters: tuple[int, ...]) -> _Stacked | None:
        """The factors of `adapters` that adapt this projection, side by side (None: none do)."""
        mine = tuple(a for a in adapters if a in self.weights)
        if not mine:
            return None
        if self._stacked is None or self._stacked.adapters != mine:
            pairs = [self.weights[a] for a in mine]
            owners = torch.cat([torch.full((p.a.shape[0],), a, dtype=torch.long, device=p.a.device)
                                for a, p in zip(mine, pairs, strict=True)])
            self._stacked = _Stacked(mine, torch.cat([p.a for p in pairs]),
                                     torch.cat([p.b for p in pairs], dim=1).T.contiguous(), owners)
        return self._stacked

    def __call__(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        step = self.owner.step
        if step is None:
            return
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        step = step.serving(len(x))
        factors = self._factors(step.adapters)
        if factors is None:  # no adapter of the step adapts this projection
            return
        low = F.linear(x.to(factors.a.dtype), factors.a)
        if not step.uniform:
            low *= step.row_adapters[:, None] == factors.owners
        out = output.view(-1, output.shape[-1])  # the projection's fresh output, added to in place
        if out.dtype == factors.b.dtype:
            out.addmm_(low, factors.b)
        else:
            out += (low @ factors.b).to(out.dtype)


class AdapterSet:
    """The adapters loaded over one model, by index (a sequence's `adapter`); loaded once, kept until unloaded (an
    adapter is a few MB: rank x (in + out) per projection). An index is never reused: an unloaded adapter's slot
    stays empty."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, dtype: torch.dtype, device: str, max_rank: int,
                 plan: ShardPlan | None = None) -> None:
        """plan: where `model` is a tensor-parallel rank's shard, the split (cluster/shards.py): an adapter is read
        against the whole model's shapes (a model on the meta device) and each projection keeps the rows or columns
        of its factors that its weight keeps; a row-parallel projection's products are partial sums then, which the
        layer's all-reduce adds up with its own."""
        self.model, self.cfg, self.dtype, self.device, self.max_rank = model, cfg, dtype, torch.device(device), max_rank
        self.shapes = model
        self.cuts: dict[str, tuple[int, torch.Tensor]] = {}
        if plan is not None:
            with torch.device("meta"):
                self.shapes = DecoderModel(plan.cfg)
            self.cuts = plan.weight_cuts(self.shapes)
        self.adapters: list[Adapter | None] = []
        self._by_name: dict[str, int] = {}
        self._products: dict[str, _Product] = {}  # by module path
        self.step: AdapterStep | None = None  # set for the forward pass of a step with adapters (run())

    def index(self, request: LoRARequest) -> int:
        """The adapter's index, loading it on first use; ValueError naming what does not fit (nothing is kept)."""
        known = self.known(request)
        if known is not None:
            return known
        adapter = read_adapter(request, self.shapes, self.cfg, self.dtype, self.device, self.max_rank)
        adapter.modules = {path: self._cut(path, pair) for path, pair in adapter.modules.items()}
        index = len(self.adapters)
        for path, pair in adapter.modules.items():
            parts = path.split(".")
            for depth in range(1, len(parts)):  # a mixture whose C++ form would pass by this projection's hook
                if isinstance(block := self.model.get_submodule(".".join(parts[:depth])), MoEBlock):
                    block.adapted = True
            product = self._products.get(path)
            if product is None:
                product = self._products[path] = _Product(self)
                self.model.get_submodule(path).register_forward_hook(product)
            product.weights[index] = pair
        self.adapters.append(adapter)
        self._by_name[request.lora_name] = index
        log.info("ridge: LoRA adapter %r loaded from %s: rank %d over %d projections (%.1f MiB)", request.lora_name,
                 request.lora_path, adapter.rank, len(adapter.modules), adapter.nbytes / 2**20)
        return index

    def known(self, request: LoRARequest) -> int | None:
        """The loaded adapter's index, or None; ValueError where its name is another adapter's."""
        known = self._by_name.get(request.lora_name)
        if known is not None:
            loaded = self.adapters[known].request
            if (loaded.lora_path, loaded.lora_int_id) != (request.lora_path, request.lora_int_id):
                raise ValueError(f"lora_name: {request.lora_name!r} already names the adapter at {loaded.lora_path} "
                                 f"(id {loaded.lora_int_id}); give this one another name")
        return known

    def _cut(self, path: str, pair: LoRAWeights) -> LoRAWeights:
        """This rank's part of a projection's factors: B's rows where its weight keeps rows, A's columns where it
        keeps columns (the whole pair in one process)."""
        if path not in self.cuts:
            return pair
        dim, index = self.cuts[path]
        index = index.to(self.device)
        if dim == 0:
            return LoRAWeights(pair.a, pair.b.index_select(0, index))
        return LoRAWeights(pair.a.index_select(1, index), pair.b)

    def unload(self, name: str, in_use: set[int]) -> None:
        """Drop the adapter called `name`, its factors freed; ValueError where it is not loaded or in use (in_use: the
        indices of the adapters of live sequences)."""
        index = self._by_name.get(name)
        if index is None:
            raise ValueError(f"lora_name: no adapter {name!r} is loaded")
        if index in in_use:
            raise ValueError(f"lora_name: {name!r} is in use by requests still running or waiting; unload it after "
                             "they finish")
        del self._by_name[name]
        self.adapters[index] = None
        for product in self._products.values():
            product.weights.pop(index, None)
            product.forget(index)
        log.info("ridge: LoRA adapter %r unloaded", name)

    def run_with(self, step: AdapterStep | None) -> None:
        """Set (or, with None, clear) the step the hooks add products for."""
        self.step = step
