"""KV eviction (sink-window, h2o): ridge's tokens against HF transformers attending to exactly the kept tokens, the pool
flat as a sequence grows, the plain path's tokens until the budget is reached, and the refusals.

The reference: a token's K and V are computed once, in the step that computes it, over the keys its query sees
then; so one HF forward pass whose mask gives each query the keys that were cached in its step (the sinks'
blocks and the tokens after the evicted ones) reproduces a whole evicting run, token by token.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from ridge import SamplingParams

VOCAB = 320
BLOCK = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from test_models_random import byte_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path, model


def evicting_mask(steps: list[int], sink_tokens: int, budget: int) -> torch.Tensor:
    """[T, T] additive mask: the keys each query sees when a sequence is computed in steps of `steps` tokens and,
    after each, the oldest whole blocks after the sinks' blocks are dropped while more than `budget` are kept."""
    total, sinks = sum(steps), -(-sink_tokens // BLOCK) * BLOCK
    visible = torch.zeros(total, total, dtype=torch.bool)
    done, evicted = 0, 0
    for n in steps:
        for q in range(done, done + n):
            visible[q, :min(sinks, q + 1)] = True
            visible[q, sinks + evicted:q + 1] = True
        done += n
        while done - evicted > budget:
            evicted += BLOCK
    return torch.zeros(total, total).masked_fill_(~visible, float("-inf"))


def hf_greedy_under_mask(model, prompt: list[int], steps_of, new_tokens: int, **policy) -> list[int]:
    """HF's greedy continuation when every query sees what the evicting cache held in its step."""
    ids = list(prompt)
    for _ in range(new_tokens):
        mask = evicting_mask(steps_of(len(prompt), len(ids)), **policy)
        with torch.no_grad():
            logits = model(torch.tensor([ids]), attention_mask=mask[None, None]).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("chunk", [512, 16])  # the prompt in one step, or in chunks (evicting between them)
def test_greedy_tokens_equal_hf_attending_to_the_kept_tokens(llama, chunk, make_llm_for_test):
    path, model = llama
    policy = {"sink_tokens": 4, "budget": 40}
    llm = make_llm_for_test(path, dtype="float32", block_size=BLOCK, kv_eviction="sink-window",
                            kv_budget=policy["budget"], kv_sink_tokens=policy["sink_tokens"],
                            max_num_batched_tokens=chunk, kv_cache_memory="4MiB")
    prompt = random_prompts(1, VOCAB, 37, 38, seed=3)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0]

    def steps_of(prompt_len: int, length: int) -> list[int]:
        return [min(chunk, prompt_len - i) for i in range(0, prompt_len, chunk)] + [1] * (length - prompt_len)

    reference = hf_greedy_under_mask(model, prompt, steps_of, 60, **policy)
    assert out.outputs[0].token_ids == reference
    # 97 tokens, 40 kept (the last between 32 and 40 of them recent): 56 evicted after the last step, the sinks'
    # block and 5 recent blocks cached
    assert out.metrics["kv_evicted_tokens"] == 56
    plain = hf_greedy_under_mask(model, prompt, steps_of, 60, sink_tokens=4, budget=10**6)
    assert plain != reference  # eviction changed the answer: the check above could fail


def hf_greedy_h2o(model, prompt: list[int], chunk: int, new_tokens: int, budget: int,
                  recent: int) -> tuple[list[int], list[int]]:
    """HF's greedy continuation under heavy-hitter eviction, simulated from HF's own attention probabilities: each
    step's queries see every earlier token whose block is not evicted; a block's mass is the attention it got
    from every decode query and a chunk's last 32 queries, over layers and heads; after each step the lowest-mass
    whole blocks before the recent window go while more than `budget` tokens are cached. -> (tokens, the
    evicted blocks in the order they went)."""
    from ridge.kv.eviction import OBSERVED_ROWS

    ids, evicted, mass = list(prompt), [], {}
    total = len(prompt) + new_tokens
    visible = torch.zeros(total, total, dtype=torch.bool)
    done = 0
    while len(ids) < total:
        n = min(chunk, len(prompt) - done) if done < len(prompt) else 1
        for q in range(done, done + n):
            visible[q, :q + 1] = True
            for b in evicted:
                visible[q, b * BLOCK:(b + 1) * BLOCK] = False
        length = done + n
        mask = torch.zeros(length, length).masked_fill_(~visible[:length, :length], float("-inf"))
        with torch.no_grad():
            out = model(torch.tensor([ids[:length]]), attention_mask=mask[None, None], output_attentions=True)
        observed = range(length - min(n, OBSERVED_ROWS), length)
        received = sum(layer[0, :, observed].sum(dim=(0, 1)) for layer in out.attentions)
        for b in range(-(-length // BLOCK)):
            mass[b] = mass.get(b, 0.0) + float(received[b * BLOCK:(b + 1) * BLOCK].sum())
        done = length
        if done >= len(prompt):
            ids.append(int(out.logits[0, -1].argmax()))
        cached = done - len(evicted) * BLOCK
        if cached > budget:
            kept = [b for b in range(done // BLOCK) if b not in evicted][:(cached - recent) // BLOCK]
            drop = -(-(cached - budget) // BLOCK)
            evicted += sorted(sorted(kept, key=lambda b: mass[b])[:drop])
    return ids[len(prompt):], evicted


@pytest.mark.parametrize(("chunk", "path_args"), [
    (512, {}),  # the prompt in one step; decodes through the fused decode stack
    (16, {"enforce_eager": True}),  # chunks evicting between them; decodes layer by layer through the kernel
    (16, {"cpu_kernels": False}),  # torch alone
])
def test_h2o_greedy_tokens_equal_hf_evicting_by_its_own_attention(llama, chunk, path_args, make_llm_for_test):
    """ridge's heavy-hitter run against an HF run that ranks blocks by HF's attention probabilities: the same
    tokens, and the same number of blocks evicted; not the oldest blocks (the check could fail)."""
    path, model = llama
    budget, recent = 48, 16
    llm = make_llm_for_test(path, dtype="float32", block_size=BLOCK, kv_eviction="h2o", kv_budget=budget,
                            kv_recent_tokens=recent, max_num_batched_tokens=chunk, kv_cache_memory="4MiB",
                            **path_args)
    prompt = random_prompts(1, VOCAB, 70, 71, seed=5)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    reference, evicted = hf_greedy_h2o(model, prompt, chunk, 50, budget, recent)
    assert out.outputs[0].token_ids == reference
    assert out.metrics["kv_evicted_tokens"] == len(evicted) * BLOCK
    oldest_first = list(range(len(evicted)))  # what dropping the oldest blocks (no sinks) would have taken
    assert evicted != oldest_first


@pytest.mark.parametrize("path_args", [{}, {"enforce_eager": True}, {"cpu_kernels": False}],
                         ids=["stack", "kernel", "torch"])
def test_h2o_ranks_latent_attention_s_blocks_by_its_own_attention(path_args, tmp_path_factory, make_llm_for_test):
    """DeepSeek-V3's latent attention reports its attention mass (summed over heads, as HF's per-head
    probabilities are) from the fused step, the latent kernel and torch alike: the tokens and evictions of an HF
    run that ranks blocks by its own attention."""
    from test_moe import random_hf_model

    path, model = random_hf_model("deepseek_v3", tmp_path_factory)
    model.set_attn_implementation("eager")  # HF returns attention probabilities only from its eager path
    budget, recent = 48, 16
    llm = make_llm_for_test(path, dtype="float32", block_size=BLOCK, kv_eviction="h2o", kv_budget=budget,
                            kv_recent_tokens=recent, max_num_batched_tokens=16, kv_cache_memory="4MiB", **path_args)
    prompt = random_prompts(1, VOCAB, 70, 71, seed=5)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    reference, evicted = hf_greedy_h2o(model, prompt, 16, 40, budget, recent)
    assert out.outputs[0].token_ids == reference
    assert out.metrics["kv_evicted_tokens"] == len(evicted) * BLOCK
    assert evicted != list(range(len(evicted)))  # not simply the oldest blocks


@pytest.mark.parametrize("policy", [{"kv_eviction": "sink-window"},
                                    {"kv_eviction": "h2o", "kv_cache_dtype": "int8"}])  # over a quantized cache
def test_the_pool_stays_flat_as_a_generation_grows(llama, policy, make_llm_for_test):
    """Between steps a sequence holds its budget's blocks at most, the same at 100 tokens as at 400 (and 8x
    more would not fit this pool); the plain engine's tokens until the budget is first passed."""
    path, _ = llama
    llm = make_llm_for_test(path, dtype="float32", block_size=BLOCK, kv_budget=64, kv_cache_memory="4MiB", **policy)
    engine = llm.engine
    prompt = random_prompts(1, VOCAB, 20, 21, seed=4)[0]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    held, tokens = [], []
    while engine.has_unfinished:
        for delta in engine.step():
            tokens.extend(delta.samples[0].token_ids)
        engine.check_integrity()
        held.append(engine.kv.num_blocks - engine.kv.num_free)
    assert len(tokens) == 400 and max(held) == 64 // BLOCK
    assert set(held[100:-1]) == {64 // BLOCK}  # 57 to 64 tokens cached after each step (the last frees them)
    plain = make_llm_for_test(path, dtype="float32", block_size=BLOCK, kv_cache_memory="4MiB",
                              kv_cache_dtype=policy.get("kv_cache_dtype", "auto"))
    alone = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=44, ignore_eos=True))[0]
    assert tokens[:44] == alone.outputs[0].token_ids  # 20 + 44 = 64 tokens: nothing evicted yet


@pytest.mark.parametrize(("args", "field"), [
    ({"kv_budget": 20}, "kv_budget"),  # under the sinks' block and two more (24)
    ({"kv_sink_tokens": 0}, "kv_sink_tokens"),
    ({"speculate": "ngram"}, "kv_eviction"),
    ({"device": "cuda"}, "device"),
    ({"kv_recent_tokens": 16}, "kv_recent_tokens: 16 is for kv_eviction='h2o'"),
    ({"kv_eviction": "h2o", "kv_sink_tokens": 8}, "kv_sink_tokens: 8 is for kv_eviction='sink-window'"),
    ({"kv_eviction": "h2o", "kv_budget": 40, "kv_recent_tokens": 36}, "kv_budget: must be at least kv_recent"),
    ({"kv_eviction": "h2o", "batch_invariant": True}, "kv_eviction: h2o needs batch_invariant=False"),
    ({"kv_eviction": "h2o", "tensor_parallel_size": 2}, "kv_eviction: h2o needs tensor_parallel_size=1"),
    ({"kv_eviction": "none", "kv_budget": 512}, "kv_budget"),  # a policy's setting with no policy
])
def test_what_eviction_cannot_do_is_refused_by_name(llama, args, field):
    from ridge.config import EngineConfig

    path, _ = llama
    if args.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is present: eviction on it is refused by the engine, not this check")
    with pytest.raises(ValueError, match=field):
        EngineConfig(model=str(path), block_size=BLOCK, **{"kv_eviction": "sink-window", **args})


def test_beam_search_and_windowed_models_are_refused(llama, make_llm_for_test, tmp_path):
    import json

    from ridge.engine.beam_search import BeamSearchParams

    path, model = llama
    llm = make_llm_for_test(path, dtype="float32", kv_eviction="sink-window", kv_budget=64, kv_cache_memory="4MiB")
    with pytest.raises(ValueError, match="kv_eviction: beam search"):
        llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=4))
    (tmp_path / "config.json").write_text(json.dumps({**model.config.to_dict(), "architectures": ["MistralForCausalLM"],
                                                      "model_type": "mistral", "sliding_window": 32}))
    with pytest.raises(ValueError, match="kv_eviction: sink-window on a model with sliding-window layers"):
        make_llm_for_test(f"random:{tmp_path}", kv_eviction="sink-window", kv_cache_memory="4MiB")


def test_usage_reports_the_evicted_tokens():
    from ridge.engine.outputs import RequestOutput
    from ridge.serve.gateway import Gateway

    outputs = [RequestOutput("a", None, [1], [], True, {"kv_evicted_tokens": 48.0})]
    assert Gateway.usage([[1]], 5, outputs)["kv_evicted_tokens"] == 48
    assert "kv_evicted_tokens" not in Gateway.usage([[1]], 5, [RequestOutput("a", None, [1], [], True, {})])


def test_needle_prompts_plant_the_fact_at_its_depth_within_the_length(smollm2):
    from ridge.eval.needle import NEEDLE, QUESTION, haystack_prompt

    lines = [f"Line {i} of a long and quiet text." for i in range(400)]
    tokens = [len(smollm2.tokenizer.encode(line + "\n")) for line in lines]
    places = []
    for depth in (0, 0.5, 1):
        prompt = smollm2.tokenizer.decode(haystack_prompt(smollm2, lines, tokens, 1024, depth, "1234567"))
        assert 1024 - 40 <= len(smollm2.tokenizer.encode(prompt)) <= 1024 and prompt.count(QUESTION) == 1
        text = prompt[prompt.index("then answer.") + len("then answer."):prompt.index(QUESTION)]
        places.append(text.index(NEEDLE.format(code="1234567")) / len(text))
    assert places[0] < 0.01 and 0.45 < places[1] < 0.55 and places[2] > 0.95
    with pytest.raises(ValueError, match="lengths"):
        haystack_prompt(smollm2, lines, tokens, 100_000, 0.5, "1234567")


def test_eval_needle_runs_each_variant_on_the_same_grid(smollm2_path, capsys, tmp_path):
    import json

    from ridge.cli import main

    assert main(["eval", "needle", "--model", str(smollm2_path), "--dtype", "float32", "--kv-cache-memory", "32MiB",
                 "--lengths", "160,320", "--depths", "0,1", "--answer-tokens", "8", "--max-num-batched-tokens", "256",
                 "--max-model-len", "320", "--plot",
                 str(tmp_path / "needle.png"), "--variants", "kv-cache-dtype=auto;kv-eviction=sink-window,kv-budget=96",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    plain, evicting = report["variants"]
    assert [len(v["cells"]) for v in report["variants"]] == [4, 4]
    assert [c["code"] for c in plain["cells"]] == [c["code"] for c in evicting["cells"]]
    assert all(c["found"] == (c["code"] in c["answer"]) for c in plain["cells"] + evicting["cells"])
    # the 320 row is at the model's limit: cut to leave the answer its 8 tokens
    assert 320 - 40 <= max(c["length"] for c in plain["cells"]) <= 320 - 8
    assert (tmp_path / "needle.png").stat().st_size > 0
