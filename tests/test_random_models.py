"""`random:NAME` models: a preset's or a config's shape with random weights drawn from a fixed seed, a
byte-level tokenizer, named random in what they report; and the HF config the benchmarks build beside them."""

import torch

from ridge import SamplingParams
from ridge.models.random_weights import hf_config, random_spec
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


def test_byte_level_tokenizer_round_trips_text_and_names_the_other_ids():
    tok = RidgeTokenizer(*byte_level_tokenizer(300))
    text = "héllo, wörld\n"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([299]) == "<r299>" and tok.vocab_size == 300 and not tok.stop_token_ids


def test_hf_config_builds_the_same_shape():
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = random_spec("random:qwen2.5-coder-0.5b,num_layers=2")
    fields = hf_config(spec)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    from ridge.models.registry import config_from_spec
    from ridge.models.transformer import DecoderModel

    with torch.device("meta"):
        ours = DecoderModel(config_from_spec(spec))
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())
