"""Gemma 3 270M from its real GGUF file against HF transformers in float32: the tokenizer on a corpus, logits, and
greedy tokens on chat prompts (longer than the 512-token window too), alone and under the runtime.

llama.cpp on the same file agrees with HF's reading (docs/notes/gemma3.md): this base model answers a chat
prompt by repeating it, in both.
"""

import pytest
import torch
from tokenizer_corpus import BASE, corpus

from conftest import CHAT_PROMPTS, hf_greedy_disagreements, hf_model_from_gguf
from ridge import SamplingParams

MAX_TOKENS = 32
FILLER_TOKENS = 16


@pytest.fixture(scope="module")
def gemma3(make_llm, gemma3_path):
    return make_llm(gemma3_path, dtype="float32")


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_path, tmp_path_factory):
    return hf_model_from_gguf(gemma3_path, tmp_path_factory.mktemp("hf-gemma3"))


def long_text(tokens: int, tokenizer) -> str:
    """Prose and code from the tokenizer corpus until the text holds about `tokens` tokens."""
    parts, n, i = [], 0, 0
    while n < tokens:
        parts.append(BASE[i % len(BASE)])
        n += len(tokenizer.encode(BASE[i % len(BASE)], add_special_tokens=False)) + 1
        i += 1
    return "\n".join(parts)


@pytest.fixture(scope="module")
def chat_prompts(gemma3):
    """7 chat prompts: 4 short, 2 past the window (~600 and ~750 tokens), 1 of ~1,100 (past two windows)."""
    questions = list(CHAT_PROMPTS[:4])
    for size in (600, 750, 1100):
        questions.append(long_text(size, gemma3.tokenizer) + "\n\nWhich languages appear in the text above?")
    prompts = [gemma3.render_chat([{"role": "user", "content": q}]) for q in questions]
    assert sum(len(p) > 512 for p in prompts) == 3 and max(len(p) for p in prompts) > 1024
    return prompts


def test_tokenizer_matches_hf_on_a_corpus(gemma3, gemma3_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(gemma3_path.parent), gguf_file=gemma3_path.name)
    texts = corpus()
    assert len(texts) >= 200
    for text in texts:
        assert gemma3.tokenizer.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), \
            repr(text)
    assert gemma3.tokenizer.encode("Hello")[0] == gemma3.tokenizer.info.bos_token_id  # the file says add BOS
    # no template in the file: the built-in Gemma one, a system message opening the first user turn
    rendered = gemma3.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "Hi"}])
    assert rendered == "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_logits_match_hf(gemma3, hf_gemma3, chat_prompts):
    for ids in (chat_prompts[0], chat_prompts[4]):  # one inside the window, one past it
        ours = gemma3.engine.prompt_logits(ids)
        with torch.inference_mode():
            ref = hf_gemma3(torch.tensor([ids])).logits[0]
        # float32 on both sides, summed in another order over a 262k vocabulary
        assert (ours - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def batch_tokens(gemma3, chat_prompts):
    """The chat prompts' greedy tokens in a batch of 32: 25 fillers beside them for their first FILLER_TOKENS steps
    (each filler row costs a 262k-wide float32 head a step, which later steps would add nothing to)."""
    fillers = [gemma3.render_chat([{"role": "user", "content": q}]) for q in CHAT_PROMPTS[7:]] * 8
    batch = chat_prompts + fillers[:32 - len(chat_prompts)]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS)] * len(chat_prompts) + [
        SamplingParams(temperature=0, max_tokens=FILLER_TOKENS, ignore_eos=True)] * (32 - len(chat_prompts))
    outs = gemma3.generate(batch, params)
    assert sum(len(o.outputs[0].token_ids) == FILLER_TOKENS for o in outs[len(chat_prompts):]) == 25
    return [o.outputs[0].token_ids for o in outs[:len(chat_prompts)]]


def test_greedy_chat_matches_hf_in_a_batch_of_32(gemma3, hf_gemma3, chat_prompts, batch_tokens):
    for ids, tokens in zip(chat_prompts, batch_tokens, strict=True):
        assert not hf_greedy_disagreements(hf_gemma3, ids, tokens)
        assert len(tokens) == MAX_TOKENS or tokens[-1] in gemma3.tokenizer.stop_token_ids


def test_greedy_under_the_runtime(make_llm_for_test, gemma3_path, chat_prompts, batch_tokens):
    """The same tokens with prefill chunked across the window edge, preempted in a pool of a few sequences'
    blocks, and without the prefix cache (the batch of 32 above has it on: the long prompts share their
    opening), as in the batch that HF's choices were checked on."""
    llm = make_llm_for_test(gemma3_path, dtype="float32", kv_cache_memory="44MiB", max_num_batched_tokens=200,
                            enable_prefix_caching=False)
    outs = llm.generate(chat_prompts[3:6], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))  # 1 short, 2 long
    assert [o.outputs[0].token_ids for o in outs] == batch_tokens[3:6]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0


def test_bench_capacity_measures_what_windows_save(gemma3_path, capsys):
    """`ridge bench capacity` fills the pool through the engine's KV manager: windows honoured hold more sequences
    than every layer whole, and each sequence holds what the plan's arithmetic says (to whole blocks)."""
    import json

    from ridge.cli import main

    assert main(["bench", "capacity", "--model", str(gemma3_path), "--dtype", "float32", "--context", "2048",
                 "--kv-cache-memory", "96MiB", "--max-num-batched-tokens", "256", "--json"]) == 0
    honoured, whole = json.loads(capsys.readouterr().out)["modes"]
    assert honoured["sequences"] >= 2 * whole["sequences"] > 0
    for mode in (honoured, whole):
        assert abs(mode["kv_bytes_per_sequence"] - mode["plan_kv_bytes_per_sequence"]) <= 6 * mode["block_bytes"]


def test_an_int8_cache_keeps_the_answers_past_the_window(make_llm_for_test, gemma3_path, chat_prompts, batch_tokens):
    """Local (512-token window) and global layers on an int8 cache: the quantized decode kernel starts each local
    row at its window, the window groups give blocks back as they pass, and the answers to the prompts past the
    window stay the float32 cache's (on AVX512 the kernel, not torch, read them; no block leaks: the fixture
    checks). The prompts of ~600 and ~750 tokens: past the window, as the ~1,100-token one the batch above holds."""
    llm = make_llm_for_test(gemma3_path, dtype="float32", kv_cache_dtype="int8", kv_cache_memory="64MiB")
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        assert llm.engine.runner.backend.kernels is not None
    outs = llm.generate(chat_prompts[3:6], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))  # 1 short, 2 long
    equal = sum(o.outputs[0].token_ids == tokens for o, tokens in zip(outs, batch_tokens[3:6], strict=True))
    assert equal >= 2, f"{equal} of 3 answers equal the float32 cache's"


@pytest.mark.threaded  # the kernels split their work across threads: on every core
def test_the_fused_decode_step_is_the_python_path_to_the_bit(make_llm_for_test, gemma3_path, chat_prompts):
    """Decode steps in one C++ call (each layer over its own KV group: windows on the local layers, their rotary
    base, the sandwich norms, GeGLU) against every layer in Python (enforce_eager), on the file's blocks in bf16 as
    `ridge bench` runs it: the same tokens and log-probabilities to the last bit, prompts past the window."""
    args = {"dtype": "bfloat16", "quantization": "gguf"}
    stacked = make_llm_for_test(gemma3_path, **args)
    eager = make_llm_for_test(gemma3_path, enforce_eager=True, **args)
    assert stacked.engine.runner.decode_stack is not None and eager.engine.runner.decode_stack is None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = chat_prompts[3:5]  # a short one, one longer than the window
    for a, b in zip(stacked.generate(prompts, params), eager.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
