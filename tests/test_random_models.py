"""`random:NAME` models: a preset's or a config's shape with random weights drawn from a fixed seed, a
byte-level tokenizer, named random in what they report; and the HF config the benchmarks build beside them."""

import pytest
import torch

from ridge import SamplingParams
from ridge.models.random_weights import hf_config, random_spec, random_tensors
from ridge.tokenizer import RidgeTokenizer, byte_level_tokenizer

SMALL = "random:smollm2,num_layers=2,vocab_size=512"


def test_the_same_seed_gives_the_same_model(make_llm_for_test):
    first = make_llm_for_test(SMALL, dtype="float32")
    again = make_llm_for_test(SMALL, dtype="float32")
    other = make_llm_for_test(SMALL, dtype="float32", seed=1)
    ids = list(range(20, 60))
    assert torch.equal(first.engine.prompt_logits(ids), again.engine.prompt_logits(ids))
    assert not torch.equal(first.engine.prompt_logits(ids), other.engine.prompt_logits(ids))
    assert first.engine.loaded.weight_format.startswith("random weights (seed 0)")
    cfg = first.engine.loaded.config
    assert (cfg.num_layers, cfg.vocab_size, cfg.hidden_size) == (2, 512, 576)  # the preset, as changed
    (out,) = first.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 8


@pytest.mark.parametrize(("model", "method"), [(SMALL, "int4"), (SMALL, "mxfp4"),
                                               ("random:qwen2.5-coder-0.5b,num_layers=2,vocab_size=512", "int4")])
def test_layers_quantized_as_drawn_are_those_quantized_after(make_llm_for_test, ops, model, method):
    """A random model under a quantization without calibration has each layer's weights quantized as they are
    drawn (its dense weights never whole in memory): the same layers, code for code, as the whole model drawn and
    then quantized; a tensor's numbers are its own (seed and name), whatever was drawn before it."""
    from ridge.linear import LinearTarget
    from ridge.linear.select import place_quantized
    from ridge.models.loader import random_model
    from ridge.quant.methods import quantize_weights

    lazy = make_llm_for_test(model, dtype="float32", quantization=method).engine.loaded.model
    whole = random_model(random_spec(model), torch.float32).model
    place_quantized(whole, quantize_weights(whole, method, 32), LinearTarget(torch.float32, ops=ops))
    buffers = dict(whole.named_buffers())
    compared = 0
    for name, buffer in lazy.named_buffers():
        if name.startswith("layers.") and not name.endswith(("freqs", "levels")):
            assert torch.equal(buffer, buffers[name]), name
            compared += 1
    assert compared >= 2 * 4 * 2  # codes and scales of 2 layers' 4 linears (q|k|v, o, gate|up, down) at least
    for layer, reference in zip(lazy.layers, whole.layers, strict=True):  # Qwen2's q|k|v bias kept with its layer
        assert (layer.attn.qkv.bias is None) == (reference.attn.qkv.bias is None)
    shapes = {"a.weight": torch.Size([4, 8]), "b.weight": torch.Size([4, 8])}
    alone = dict(random_tensors({"b.weight": shapes["b.weight"]}, torch.float32, "cpu"))
    assert torch.equal(dict(random_tensors(shapes, torch.float32, "cpu"))["b.weight"], alone["b.weight"])


def test_byte_level_tokenizer_round_trips_text_and_names_the_other_ids():
    tok = RidgeTokenizer(*byte_level_tokenizer(300))
    text = "héllo, wörld\n"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([299]) == "<r299>" and tok.vocab_size == 300 and not tok.stop_token_ids


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b,num_layers=2", "smollm3-3b,num_layers=4,vocab_size=49152",
                                  "glm-4.6,num_layers=4,num_experts=8", "minimax-m2,num_layers=2,num_experts=8",
                                  "phi-4-mini,num_layers=2,vocab_size=49152",
                                  "olmo-3-7b,num_layers=4,vocab_size=49152", "exaone-4.0-32b,num_layers=4",
                                  "glm-4-9b,num_layers=2,vocab_size=49152",
                                  "ernie-4.5-21b-a3b,num_layers=3,num_experts=8,vocab_size=49152",
                                  "command-r7b,num_layers=4,vocab_size=49152",
                                  "gemma-4-31b,num_layers=6,vocab_size=49152",
                                  "gemma-4-26b-a4b,num_layers=6,num_experts=8,vocab_size=49152",
                                  "gemma-4-e2b,num_layers=10,kv_shared_layers=5,vocab_size=49152"])
def test_hf_config_builds_the_same_shape(name):
    """The HF baseline of `ridge bench` is the model ridge draws: as many parameters (GLM-4.6's q / k norms and
    biases, SmolLM3's vocabulary cut below its padding token, Gemma 4's global heads, shared KV and per-layer
    embeddings)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = random_spec(f"random:{name}")
    fields = hf_config(spec)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    from ridge.models.registry import config_from_spec
    from ridge.models.transformer import DecoderModel

    with torch.device("meta"):
        ours = DecoderModel(config_from_spec(spec))
    biases = sum(b.numel() for n, b in hf.named_buffers()  # HF's buffers
                 if n.endswith(("e_score_correction_bias", "layer_scalar")))
    assert sum(p.numel() for p in hf.parameters()) + biases == sum(p.numel() for p in ours.parameters())
