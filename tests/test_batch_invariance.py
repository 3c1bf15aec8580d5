"""--batch-invariant: a greedy output under load (batched, chunked, preempted, prefix-cached) equals the same
prompt's output alone, token for token and logprob for logprob, in float32 and in bfloat16; and the probe that
guards it can fail."""

import pytest
import torch

from conftest import random_prompts
from ridge import SamplingParams
from ridge.config import EngineConfig
from ridge.kernels.batch_invariance import PROBE_ROWS, first_variant_batch, verify

pytestmark = pytest.mark.threaded  # the kernels split their work across threads: on every core

# with each step's two best logprobs: those are equal to the bit too, where the tokens alone would hide a change
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


def test_the_probe_finds_the_row_count_a_result_changes_at():
    x = torch.randn(max(PROBE_ROWS), 8)
    assert first_variant_batch(lambda rows: rows * 2, x) is None
    assert first_variant_batch(lambda rows: rows.sum(1, keepdim=True) + (rows.shape[0] > 16) * 1e-3, x) == 17


def test_the_default_float32_path_is_refused_by_the_probe(smollm2):
    """Without batch invariance, float32 prompts go to MKL's sgemm, whose rows differ from the kernel's."""
    with pytest.raises(ValueError, match=r"batch_invariant: layers\.0\.attn\.qkv \(FewRowsLinear\).* 33 rows"):
        verify(smollm2.engine.loaded.model, torch.float32)


# SmolLM2's shape cut to 6 layers and an 8,192-token vocabulary: the same kernels and runtime, a fifth of the work
MODEL, LAYERS = "random:smollm2,num_layers=6,vocab_size=8192", 6


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_under_load_equals_alone(make_llm_for_test, dtype):
    # a pool of 16 blocks of 16 tokens for 12 requests of up to 200 tokens, and steps of 48 tokens: prompts are
    # chunked, sequences preempted and recomputed, and half of them share a 40-token opening (prefix hits)
    bytes_per_block = 16 * LAYERS * 2 * 3 * 64 * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    llm = make_llm_for_test(MODEL, dtype=dtype, batch_invariant=True, kv_cache_memory=16 * bytes_per_block,
                            max_num_batched_tokens=48)
    assert llm.engine.pool.num_blocks == 16 and llm.engine.runner.backend.batch_invariant
    assert llm.engine.runner.decode_stack is not None  # decode steps keep the C++ stack, padded as the Python path
    vocab = llm.engine.loaded.config.vocab_size
    [opening] = random_prompts(1, vocab, 40, 41, seed=4)
    prompts = [opening + tail for tail in random_prompts(6, vocab, 3, 120, seed=6)]
    prompts += random_prompts(6, vocab, 3, 200, seed=5)
    under_load = llm.generate(prompts, GREEDY)
    assert sum(o.num_cached_tokens for o in under_load) > 0, "the shared opening was meant to hit the cache"
    # alone: every preempted request, and every third of the others
    checked = [i for i, o in enumerate(under_load) if o.metrics["num_preemptions"] > 0 or i % 3 == 0]
    assert len(checked) < len(prompts) and any(under_load[i].metrics["num_preemptions"] for i in checked), \
        "the pool was meant to force preemption"
    for i in checked:
        [alone] = llm.generate(prompts[i], GREEDY)
        assert under_load[i].outputs[0].token_ids == alone.outputs[0].token_ids
        assert under_load[i].outputs[0].logprobs == alone.outputs[0].logprobs, f"request {i}: logprobs differ"


@pytest.mark.parametrize(("field", "value"), [("attention_backend", "reference"), ("cpu_kernels", False),
                                               ("int8_activations", True)])
def test_what_it_cannot_serve_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"batch_invariant: .*{field}"):
        EngineConfig(model="smollm2", batch_invariant=True, **{field: value})
