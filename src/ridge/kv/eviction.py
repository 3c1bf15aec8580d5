"""KV eviction: which cached tokens a sequence lets go of, so that its cache stops growing with its length.

sink-window (StreamingLLM, Xiao et al., 2023): a sequence keeps its first tokens, the "attention sinks" that
softmax heads lean on whatever the text, and its most recent ones, `budget` tokens in all; the blocks between go
back to the pool as it grows. Eviction is by whole blocks: the sinks are the first ceil(sink_tokens / block_size)
blocks, and the block dropped is always the oldest one after them, so a sequence's cached tokens are positions
[0, sinks) and [sinks + evicted, num_computed): one offset (`num_evicted`) maps a position to its cache index,
and the attention kernels see a plain contiguous sequence, none of them changed (engine/runner.py maps).

Positions: each key keeps the rotary position it was written at and each query uses its true position, so the
distances the model sees are the true ones, as in the rest of the text. The paper re-numbers positions within
the cache instead (keys cached before their rotation), which lets a model run past its trained context; ridge
keeps the model's context limit (max_model_len) as without eviction.

h2o (heavy hitters, Zhang et al., 2023; prompts scored as SnapKV does, Li et al., 2024): a sequence keeps its
most recent `recent_tokens` and, in the rest of its budget, the blocks that received the most attention so far;
the block dropped is the one with the least. A block's attention mass is the sum, over every layer, query head
and scored query of the sequence, of the probability the query gave the block's tokens: every decode query
counts, and of a prompt chunk its last OBSERVED_ROWS queries (SnapKV's observation window: the end of a prompt,
where the question usually sits, says best which of its earlier tokens the answer will need). The decode kernels
sum it as they attend (kernels/decode_tasks.h); prompt chunks in torch (attention/mass.py). H2O ranks tokens
per head and layer; ridge ranks whole blocks per sequence, summed over heads and layers, because a block is
what a sequence holds and gives back (every layer's K/V of its tokens). Mass only accumulates, so older blocks
have had more queries to earn it, as in H2O. Evicted blocks can sit anywhere before the recent window, but they
are whole blocks before the one being written, so `num_evicted` maps the next position to its cache index, and
the kernels read the remaining blocks as a plain sequence.

Outputs change by design: an evicting engine answers differently from a plain one once a sequence passes its
budget, and a prompt's KV depends on how it was chunked (a chunk attends to itself whole before eviction).
"""

from __future__ import annotations

from dataclasses import dataclass

EVICTION_POLICIES = ("none", "sink-window", "h2o")
# a prompt chunk's last queries whose attention counts towards its blocks' mass (SnapKV's observation window)
OBSERVED_ROWS = 32


@dataclass(frozen=True)
class SinkWindow:
    sink_blocks: int
    budget: int  # tokens a sequence keeps cached between steps, the sinks' whole blocks included
    block_size: int

    @classmethod
    def from_config(cls, sink_tokens: int, budget: int, block_size: int) -> SinkWindow:
        """ValueError naming the field unless the budget holds the sinks' blocks and a window of two blocks
        (the partial block being written, and one whole one to drop)."""
        if sink_tokens < 1:
            raise ValueError(f"kv_sink_tokens: must be at least 1, got {sink_tokens}")
        sink_blocks = -(-sink_tokens // block_size)
        least = (sink_blocks + 2) * block_size
        if budget < least:
            raise ValueError(f"kv_budget: must be at least the sinks' {sink_blocks * block_size} tokens (whole blocks "
                             f"of {block_size}) plus a window of two blocks, {least} tokens; got {budget}")
        return cls(sink_blocks, budget, block_size)

    needs_attention_mass = False

    def blocks_to_evict(self, cached_tokens: int) -> int:
        """Blocks after the sinks to drop so that at most `budget` tokens stay cached. Those are whole blocks
        before the one being written: after dropping, more than budget - block_size >= the sinks + one block
        remain."""
        return _over_budget(cached_tokens, self.budget, self.block_size)

    def victims(self, cached_tokens: int, table: list[int], mass: dict[int, float]) -> list[int]:
        """The table indices to drop: the oldest blocks after the sinks."""
        drop = self.blocks_to_evict(cached_tokens)
        return list(range(self.sink_blocks, self.sink_blocks + drop))


@dataclass(frozen=True)
class HeavyHitters:
    recent_tokens: int
    budget: int  # tokens a sequence keeps cached between steps, the recent window's included
    block_size: int

    needs_attention_mass = True

    @classmethod
    def from_config(cls, recent_tokens: int | None, budget: int, block_size: int) -> HeavyHitters:
        """recent_tokens None: half the budget (H2O's even split of heavy hitters and recent tokens). ValueError
        naming the field unless the budget holds the recent window and at least one block of heavy hitters."""
        recent = budget // 2 if recent_tokens is None else recent_tokens
        if recent < 0:
            raise ValueError(f"kv_recent_tokens: must be at least 0, got {recent}")
        if budget < recent + block_size:
            raise ValueError(f"kv_budget: must be at least kv_recent_tokens ({recent}) plus one block of heavy hitters "
                             f"({block_size} tokens), {recent + block_size} tokens; got {budget}")
        return cls(recent, budget, block_size)

    def blocks_to_evict(self, cached_tokens: int) -> int:
        return _over_budget(cached_tokens, self.budget, self.block_size)

    def victims(self, cached_tokens: int, table: list[int], mass: dict[int, float]) -> list[int]:
        """The table indices to drop: the whole blocks before the recent window with the least attention mass
        (`mass` by block id), the older first among equals. There are enough of them: the blocks wholly before
        the window number (cached - recent) // block_size >= the blocks over budget, since budget >= recent +
        block_size."""
        drop = self.blocks_to_evict(cached_tokens)
        candidates = range((cached_tokens - self.recent_tokens) // self.block_size)
        return sorted(sorted(candidates, key=lambda i: mass.get(table[i], 0.0))[:drop])


Eviction = SinkWindow | HeavyHitters


def _over_budget(cached_tokens: int, budget: int, block_size: int) -> int:
    """Whole blocks to give back so that at most `budget` of `cached_tokens` stay."""
    return max(0, -(-(cached_tokens - budget) // block_size))
