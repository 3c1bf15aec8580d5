"""models/spec.py reads a model's shape once, for the planner and the engine alike; the engine's
ModelConfig comes from it (models/registry.py) and refuses by name what ridge cannot run."""

import pytest

from ridge.models.gguf_file import read_gguf
from ridge.models.registry import config_from_spec
from ridge.models.spec import spec_from_gguf, spec_from_hf_config
from ridge.plan import arithmetic

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 2048}


def test_the_engine_config_comes_from_the_spec():
    cfg = config_from_spec(spec_from_hf_config(LLAMA, "tiny"))
    assert (cfg.architecture, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta) == \
        ("llama", 2, 16, 1e-5, 500000.0)
    assert cfg.max_position_embeddings == 2048 and not cfg.qkv_bias and not cfg.qk_norm
    qwen2 = config_from_spec(spec_from_hf_config({**LLAMA, "architectures": ["Qwen2ForCausalLM"],
                                                  "model_type": "qwen2"}, "tiny"))
    qwen3 = config_from_spec(spec_from_hf_config({**LLAMA, "architectures": ["Qwen3ForCausalLM"],
                                                  "model_type": "qwen3"}, "tiny"))
    assert qwen2.qkv_bias and qwen3.qk_norm


@pytest.mark.parametrize(("change", "refusal"), [
    ({"architectures": ["PhiForCausalLM"], "model_type": "phi"}, "architecture 'PhiForCausalLM'"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True,
      "sliding_window": 4096}, "use_sliding_window"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling: rope_type 'dynamic'"),
    ({"num_local_experts": 8, "num_experts_per_tok": 2}, "mixture of experts"),
])
def test_what_the_engine_cannot_run_is_refused_by_name(change, refusal):
    spec = spec_from_hf_config({**LLAMA, **change}, "tiny")  # the planner reads it all the same
    with pytest.raises(ValueError, match=refusal):
        config_from_spec(spec)


def test_a_gguf_header_gives_the_loaders_config(smollm2_path, smollm2):
    spec = spec_from_gguf(read_gguf(smollm2_path), smollm2_path.stem, f"GGUF header of {smollm2_path.name}")
    assert config_from_spec(spec) == smollm2.engine.loaded.config
    assert smollm2.engine.loaded.spec == spec


def test_generation_flops_add_a_prefill_and_the_decode_steps():
    spec = spec_from_hf_config(LLAMA, "tiny")
    assert arithmetic.generation_flops(spec, 10, 1) == arithmetic.prefill(spec, 10).flops
    assert arithmetic.generation_flops(spec, 10, 3) == pytest.approx(
        arithmetic.prefill(spec, 10).flops + arithmetic.decode_step_flops(spec, 1, 11)
        + arithmetic.decode_step_flops(spec, 1, 12))
