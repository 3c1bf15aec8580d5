"""Scaled rotary (linear, Llama 3.1's, YaRN, LongRoPE): the frequencies equal HF transformers', a small random
model's logits and greedy tokens equal HF's at positions past the original context, a GGUF of the same model
(Llama 3.1's divisors as llama.cpp's rope_freqs tensor, YaRN as header keys) reads back to the same logits, and
what is not implemented is refused by name."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_logits_match_hf, hf_greedy_disagreements, random_prompts
from ridge import SamplingParams
from ridge.rope_scaling import RopeScaling
from test_models_random import byte_tokenizer

VOCAB = 320
ORIGINAL = 32  # the "pretraining" context: the prompts below run past it
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    # DeepSeek's form: the attention factor from mscale / mscale_all_dim, and other correction betas
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": ORIGINAL,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
}


def hf_config(arch: str, scaling: dict):
    from transformers import LlamaConfig, Qwen2Config

    kind = LlamaConfig if arch == "llama" else Qwen2Config
    return kind(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4 * ORIGINAL, rms_norm_eps=1e-6,
                rope_parameters={"rope_theta": 500.0, **scaling}, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("kind", SCALINGS)
def test_frequencies_and_magnitude_equal_hf(kind):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_config("llama", SCALINGS[kind])
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[SCALINGS[kind]["rope_type"]](config, "cpu")
    ours = RopeScaling.from_hf(dict(config.rope_parameters), config.max_position_embeddings)
    assert torch.allclose(ours.inverse_frequencies(16, 500.0), inv_freq, rtol=1e-6)
    assert ours.rotation_magnitude() == pytest.approx(attention_factor)
    assert not torch.allclose(inv_freq, RopeScaling("linear", 1.0).inverse_frequencies(16, 500.0))  # it scales


@pytest.mark.parametrize("served", [ORIGINAL, 4 * ORIGINAL], ids=["short", "long"])
def test_longrope_frequencies_and_magnitude_equal_hf(served):
    """LongRoPE (Phi-3's): HF's inverse frequencies for a sequence of `served` positions (its short set up to the
    original context, the long set past it) and its attention factor, taken from the context ridge serves."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
               "long_factor": [2.0 + i for i in range(8)], "original_max_position_embeddings": ORIGINAL}
    config = hf_config("llama", scaling)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=served)
    ours = RopeScaling.from_hf(dict(config.rope_parameters), config.max_position_embeddings).served_context(served)
    assert ours.use_long_factor == (served > ORIGINAL)
    assert torch.allclose(ours.inverse_frequencies(16, 500.0), inv_freq, rtol=1e-6)
    assert ours.rotation_magnitude() == pytest.approx(attention_factor) and attention_factor > 1


@pytest.fixture(scope="module", params=[("llama", "llama3"), ("qwen2", "yarn")], ids=lambda p: "-".join(p))
def scaled_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch, kind = request.param
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(arch, SCALINGS[kind]), dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(f"{arch}-{kind}")
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path, model


def test_logits_and_greedy_tokens_match_hf_past_the_original_context(scaled_model, make_llm_for_test):
    path, hf = scaled_model
    assert_logits_match_hf(make_llm_for_test, path, hf, VOCAB)
    llm = make_llm_for_test(path, dtype="float32")
    prompts = random_prompts(3, VOCAB, 40, 60, seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for ids, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert not hf_greedy_disagreements(hf, ids, out.outputs[0].token_ids)


@pytest.mark.parametrize("kind", ["llama3", "yarn", "linear"])
def test_a_scaled_gguf_reads_back_as_the_same_model(kind, smollm2_path, tmp_path, make_llm_for_test):
    """Llama 3.1's scaling written as llama.cpp's converter writes it (the rope_freqs divisors), linear and YaRN
    as header keys: the file loads as the model `random:` draws from the HF config, with the same logits."""
    import json

    from ridge.bench.random_gguf import write_random_gguf
    from ridge.models.random_weights import random_spec

    config = {**hf_config("llama", SCALINGS[kind]).to_dict(), "vocab_size": 49152}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = random_spec(f"random:{tmp_path}")
    path = write_random_gguf(spec, tmp_path / "model.gguf", smollm2_path, seed=0, float16=False)
    from_file = make_llm_for_test(path, dtype="float32", kv_cache_memory="16MiB")
    drawn = make_llm_for_test(f"random:{tmp_path}", dtype="float32", kv_cache_memory="16MiB")
    ours, theirs = from_file.engine.loaded.model.rotary.freqs, drawn.engine.loaded.model.rotary.freqs
    assert torch.allclose(ours, theirs, atol=1e-6)
    ids = random_prompts(1, 49152, 70, 71, seed=5)[0]
    assert torch.allclose(from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids), atol=1e-5)


def test_yarn_serves_its_stretched_context():
    """A config that keeps max_position_embeddings at the original (Qwen2.5's advice for YaRN) serves
    factor x original positions, as vLLM does."""
    from ridge.models.registry import config_from_spec
    from ridge.models.spec import spec_from_hf_config

    config = {**hf_config("qwen2", {}).to_dict(), "max_position_embeddings": 1024,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}
    config.pop("rope_parameters")
    assert config_from_spec(spec_from_hf_config(config, "qwen")).max_position_embeddings == 4096


@pytest.mark.parametrize("scaling,message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not supported"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 7,
      "original_max_position_embeddings": ORIGINAL}, "longrope needs short_factor and long_factor of one length"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0}, "llama3 needs original_max_position_emb"),
    ({"rope_type": "linear", "factor": 0.0}, "factor must be positive"),
    ({"rope_type": "yarn", "factor": 4.0, "extrapolation_factor": 2.0}, "extrapolation_factor not supported"),
])
def test_what_is_not_implemented_is_refused_by_name(scaling, message):
    from ridge.models.registry import config_from_spec
    from ridge.models.spec import spec_from_hf_config

    config = {**hf_config("llama", {}).to_dict(), "rope_scaling": scaling}
    config.pop("rope_parameters")
    with pytest.raises(ValueError, match=message):
        config_from_spec(spec_from_hf_config(config, "llama"))
