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


LOAD_SCRIPT = """
import sys
from ridge.config import EngineConfig
from ridge.engine.loading import ModelFile, load_weights

def anonymous_bytes():  # resident less file-backed: the GGUF file's mapped pages are the page cache's
    resident, shared = open("/proc/self/statm").read().split()[1:3]
    return (int(resident) - int(shared)) * 4096

model = ModelFile.open(sys.argv[1])
before = anonymous_bytes()
loaded = load_weights(model, EngineConfig(model=sys.argv[1], dtype="float32"), None, progress=False)
weights = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in loaded.model.state_dict().values()}
print(sum(weights.values()), anonymous_bytes() - before)
"""


def test_a_loaded_model_holds_its_weights_and_little_more(smollm2_path):
    """SmolLM2 dequantized to float32 (513 MiB): what the load leaves resident is the weights and little more
    (595 MiB). The load frees temporaries as large as what it keeps (dequantized tensors; the parts of fused q/k/v
    and gate/up weights, once all held until the model was made), whose pages glibc kept until a trim: 850 MiB."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(smollm2_path)], capture_output=True, text=True,
                         check=True).stdout
    weights, resident = map(int, out.split())
    assert resident < 1.3 * weights, f"{resident / 2**20:.0f} MiB resident for {weights / 2**20:.0f} MiB of weights"


def test_a_lora_adapter_over_the_smollm2_file_matches_peft(smollm2, smollm2_path, hf_smollm2, make_llm_for_test,
                                                           tmp_path):
    """PEFT's adapter (rank 16 on every projection) over HF's SmolLM2 against ridge's LoRA over the GGUF file, whose
    q / k rows are permuted back at load: an adapter's rows must land on the same ones (tests/test_lora.py has the
    rest). Adapter and base rows in one batch; the fused decode step still runs the base model's steps."""
    import copy

    from peft import LoraConfig, get_peft_model

    from ridge import LoRARequest

    torch.manual_seed(4)
    config = LoraConfig(r=16, lora_alpha=32, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft = get_peft_model(copy.deepcopy(hf_smollm2), config).eval()
    with torch.no_grad():  # PEFT draws B small: enough to move every token, as a fine-tune does
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.mul_(4)
    peft.save_pretrained(tmp_path / "smol")
    llm = make_llm_for_test(smollm2_path, dtype="float32", enable_lora=True)
    assert llm.engine.runner.decode_stack is not None
    request = LoRARequest("smol", 1, str(tmp_path / "smol"))
    prompts = [llm.tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    params = SamplingParams(temperature=0, max_tokens=16)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts + prompts, params,
                                                           lora_request=[request, request, None, None])]
    for ids, tokens in zip(prompts, outs[:2], strict=True):
        assert not hf_greedy_disagreements(peft, ids, tokens)
    assert outs[2:] == [o.outputs[0].token_ids for o in smollm2.generate(prompts, params)]
    assert outs[:2] != outs[2:]
