"""Embeddings (--runner pooling): a prompt's last-token final hidden state, L2-normalized, against HF transformers'
base model in float32 on a random Qwen3 (Qwen3-Embedding's architecture, tied as it is); through LLM.embed, under
chunked prefill and the prefix cache, and through the server's /v1/embeddings with OpenAI's client."""

from __future__ import annotations

import pytest
import torch

from conftest import declare_pooling, random_prompts, running_server
from ridge import SamplingParams
from ridge.config import EngineConfig
from ridge.serve.gateway import ServerConfig
from test_models_random import VOCAB, hf_config, saved, with_drawn_norms


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = with_drawn_norms(AutoModelForCausalLM.from_config(hf_config("qwen3", True), dtype=torch.float32).eval())
    return saved(model, tmp_path_factory.mktemp("qwen3-embedding"))


def hf_embedding(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1)


def test_embeddings_are_hf_s_last_hidden_state_normalized(qwen3, make_llm_for_test):
    """A batch of prompts of 1 to 60 tokens (a one-token prompt runs as a decode row), chunked
    at 16 tokens a step, and again once cached: each embedding HF's to float32's last bits."""
    path, hf = qwen3
    llm = make_llm_for_test(path, dtype="float32", runner="pooling", max_num_batched_tokens=16)
    prompts = [[7], *random_prompts(5, VOCAB, 2, 60, seed=3)]
    for attempt in range(2):  # the second finds every full prompt block in the prefix cache
        outs = llm.embed(prompts)
        assert [o.prompt_token_ids for o in outs] == prompts
        for ids, out in zip(prompts, outs, strict=True):
            ours = torch.tensor(out.outputs.embedding)
            assert ours.shape == (64,) and abs(ours.norm().item() - 1) < 1e-5
            assert (ours - hf_embedding(hf, ids)).abs().max().item() < 1e-5, (attempt, len(ids))
    assert llm.engine.kv.cache.stats.hits > 0


def test_two_tensor_parallel_ranks_embed_as_one_process(qwen3, make_llm_for_test):
    """Every rank's runner pools (none computes logits); rank 0's final hidden states are the whole model's."""
    path, hf = qwen3
    two = make_llm_for_test(path, dtype="float32", runner="pooling", kv_cache_memory="16MiB", tensor_parallel_size=2)
    prompts = random_prompts(3, VOCAB, 2, 40, seed=4)
    for ids, out in zip(prompts, two.embed(prompts), strict=True):
        assert (torch.tensor(out.outputs.embedding) - hf_embedding(hf, ids)).abs().max().item() < 1e-5


def test_a_pooling_engine_embeds_only_and_a_generating_one_generates_only(qwen3, make_llm_for_test):
    path, _ = qwen3
    pooling = make_llm_for_test(path, dtype="float32", runner="pooling")
    with pytest.raises(ValueError, match="runner: this engine runs runner='pooling'"):
        pooling.generate([5, 6, 7], SamplingParams(max_tokens=2))
    generating = make_llm_for_test(path, dtype="float32")
    with pytest.raises(ValueError, match="embed: this engine generates"):
        generating.embed([5, 6, 7])
    assert len(pooling.embed([[5, 6, 7]])[0].outputs.embedding) == 64  # both still serve
    with pytest.raises(ValueError, match="speculate: not with runner='pooling'"):
        EngineConfig(model=str(path), runner="pooling", speculate="ngram")


def test_the_server_s_embeddings_are_llm_embed_s(qwen3, make_llm_for_test):
    """OpenAI's client (base64 by default) and float JSON alike; texts and token ids; the usage counts the inputs'
    tokens; a generation request on a pooling server, and an embedding on a generating one, get a 400."""
    import openai

    path, _ = qwen3
    llm = make_llm_for_test(path, dtype="float32", runner="pooling")
    texts = ["the cat sat", "on the mat, and then it slept"]
    expected = [o.outputs.embedding for o in llm.embed(texts)]
    config = EngineConfig(model=str(path), dtype="float32", kv_cache_memory="16MiB", runner="pooling")
    with running_server(config, ServerConfig("embedder", max_request_tokens=64)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = client.embeddings.create(model="embedder", input=texts)  # the SDK asks for base64 and decodes it
        assert [d.index for d in got.data] == [0, 1]
        for ours, theirs in zip(got.data, expected, strict=True):
            assert torch.allclose(torch.tensor(ours.embedding), torch.tensor(theirs), atol=1e-6)
        ids = [llm.tokenizer.encode(t) for t in texts]
        assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
        floats = client.embeddings.create(model="embedder", input=ids[1], encoding_format="float")
        assert floats.data[0].embedding == pytest.approx(expected[1], abs=1e-6)
        cut = client.embeddings.create(model="embedder", input=texts[1], encoding_format="float",
                                       extra_body={"truncate_prompt_tokens": 3})  # vLLM's: the last 3 tokens
        assert cut.data[0].embedding == pytest.approx(llm.embed([ids[1][-3:]])[0].outputs.embedding, abs=1e-6)
        assert cut.usage.prompt_tokens == 3
        for call, param in ((lambda: client.embeddings.create(model="embedder", input="x", dimensions=8),
                             "dimensions"),
                            (lambda: client.embeddings.create(model="embedder", input=[]), "input"),
                            (lambda: client.embeddings.create(model="embedder", input=["x " * 40] * 2), "input"),
                            (lambda: client.embeddings.create(model="embedder", input="x",
                                                              extra_body={"normalize": False}), "normalize"),
                            (lambda: client.completions.create(model="embedder", prompt="x", max_tokens=2),
                             "runner")):
            with pytest.raises(openai.BadRequestError) as caught:
                call()
            assert caught.value.body["param"] == param, caught.value.body
        assert srv.engine.state().idle
    with running_server(EngineConfig(model=str(path), dtype="float32", kv_cache_memory="16MiB"),
                        ServerConfig("generator")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model="generator", input="x")
        assert caught.value.body["param"] == "model" and "--runner pooling" in caught.value.body["message"]


def test_bench_embed_runs_ridge_beside_hf_on_the_same_prompts(qwen3, capsys):
    """`ridge bench embed --json`: both engines' rates and roofline fractions, and their embeddings the same."""
    import json

    from ridge.cli import main

    path, _ = qwen3
    assert main(["bench", "embed", "--model", str(path), "--dtype", "float32", "--num-prompts", "4", "--input-len",
                 "16", "--hf-batch-size", "2", "--repeats", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["engine"] for r in report["rows"]] == ["ridge", "HF transformers"]
    assert all(r["tok_s"] > 0 and r["roofline_fraction"] > 0 for r in report["rows"])
    assert report["max_cosine_distance"] < 1e-6


def test_a_model_s_declared_pooling_runs_and_one_ridge_lacks_is_refused(qwen3, make_llm_for_test, tmp_path, caplog):
    """The pooling a model declares (a sentence-transformers folder's Pooling module, a GGUF's pooling_type): max
    pooling is refused by the pooling runner (its vectors would be another model's); mean pooling runs, over whole
    prompts without the prefix cache, as HF's mean of the final hidden states; a last-token one runs; an embedding
    model loaded to generate is said at warning level."""
    import shutil
    from pathlib import Path

    from ridge.engine.loading import ModelFile
    from ridge.models.gguf_file import GGUFFile

    path, hf = qwen3
    folder = tmp_path / "st"
    shutil.copytree(path, folder)
    declare_pooling(folder, "pooling_mode_max_tokens")
    with pytest.raises(ValueError, match=r"runner: this model's embeddings pool by max \(1_Pooling/config"):
        make_llm_for_test(folder, dtype="float32", runner="pooling")
    declare_pooling(folder, "pooling_mode_mean_tokens")
    mean = make_llm_for_test(folder, dtype="float32", runner="pooling", max_num_batched_tokens=48)
    assert mean.engine.kv.cache is None and mean.engine.max_model_len == 48
    prompts = random_prompts(4, VOCAB, 2, 48, seed=6)  # more tokens than a step holds: each prompt waits whole
    for ids, out in zip(prompts, mean.embed(prompts), strict=True):
        with torch.inference_mode():
            expected = torch.nn.functional.normalize(hf.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
                                                     .mean(0), dim=-1)
        assert (torch.tensor(out.outputs.embedding) - expected).abs().max().item() < 1e-5
    declare_pooling(folder, "pooling_mode_lasttoken")
    assert len(make_llm_for_test(folder, dtype="float32", runner="pooling").embed([[5, 6]])) == 1
    with caplog.at_level("WARNING", logger="ridge"):
        make_llm_for_test(folder, dtype="float32")
    assert "declares last pooling (1_Pooling/config.json): an embedding model" in caplog.text
    header = GGUFFile({"general.architecture": "qwen3", "qwen3.pooling_type": 2}, [])
    assert ModelFile(Path("e.gguf"), header).pooling == ("cls", "qwen3.pooling_type in e.gguf")
