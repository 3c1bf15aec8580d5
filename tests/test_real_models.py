"""Real GGUF models against HF transformers in float32: logits, and greedy tokens on chat prompts."""

import torch

from conftest import CHAT_PROMPTS, hf_greedy_disagreements, hf_model_from_gguf
from ridge import SamplingParams


def test_smollm2_logits_match_hf(smollm2, hf_smollm2):
    ids = smollm2.render_chat([{"role": "user", "content": "Name three planets of the solar system."}])
    ours = smollm2.engine.prompt_logits(ids)
    with torch.inference_mode():
        ref = hf_smollm2(torch.tensor([ids])).logits[0]
    scale = ref.abs().max().item()
    # float32 on both sides; a different summation order leaves ~1e-5 of the logit scale
    assert (ours - ref).abs().max().item() < 1e-4 * scale
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_greedy_chat_matches_hf(smollm2, hf_smollm2):
    prompts = [smollm2.render_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:10]]
    outs = smollm2.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    for ids, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        assert not hf_greedy_disagreements(hf_smollm2, ids, tokens)
        assert len(tokens) == 32 or tokens[-1] in smollm2.tokenizer.stop_token_ids
    wrong = tokens[:5] + [(tokens[5] + 1) % smollm2.tokenizer.vocab_size]  # the check can fail
    assert [d.split(":")[0] for d in hf_greedy_disagreements(hf_smollm2, ids, wrong)] == ["token 5"]


def test_qwen_coder_greedy_matches_hf(qwen_float32, qwen_path, tmp_path):
    qwen = qwen_float32
    hf = hf_model_from_gguf(qwen_path, tmp_path)
    questions = ["Write a Python function that reverses a string.", "What does `git rebase` do?"]
    prompts = [qwen.render_chat([{"role": "user", "content": q}]) for q in questions]
    outs = qwen.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    for ids, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        assert not hf_greedy_disagreements(hf, ids, tokens)
        assert len(tokens) == 32 or tokens[-1] in qwen.tokenizer.stop_token_ids
    ours = qwen.engine.prompt_logits(prompts[0])
    with torch.inference_mode():
        ref = hf(torch.tensor([prompts[0]])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
