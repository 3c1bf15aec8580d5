"""Encoders (BERT, RoBERTa, XLM-RoBERTa: every token attends to the whole sequence) under --runner pooling: CLS, mean
and last-token embeddings against HF transformers' base model in float32 on small random configs; texts through
the tokenizer's own [CLS] ... [SEP]; prompts computed whole, batched, and refused past the step's budget; the
pooling a sentence-transformers folder declares; /v1/embeddings with OpenAI's client."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from conftest import declare_pooling, running_server
from ridge import SamplingParams
from ridge.config import EngineConfig
from ridge.serve.gateway import ServerConfig

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "away", "and", "then", "slept"]
VOCAB = 96  # the tokenizer's words, its letters and specials, then ids no text reaches


def prompts_of(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """Token ids from 5 on: no special token, and no padding id (RoBERTa's HF model reads its positions off them)."""
    rng = random.Random(seed)
    return [[rng.randrange(5, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _bert_tokenizer(folder) -> None:
    """A WordPiece tokenizer (BERT's: lower-cased, [CLS] text [SEP]) over a few words and the letters, saved as
    tokenizer.json beside the model, as HF's checkpoints hold it."""
    from tokenizers.implementations import BertWordPieceTokenizer

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(97, 123)]
    vocab = {t: i for i, t in enumerate(specials + WORDS + letters + ["##" + c for c in letters] + [".", ","])}
    BertWordPieceTokenizer(vocab).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizerFast"}))


@pytest.fixture(scope="module", params=["bert", "roberta", "xlm-roberta"])
def encoder(request, tmp_path_factory):
    """(its folder, HF's base model) of a 2-layer random encoder of the family, with BERT's tokenizer."""
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(0)
    positions = 64 if request.param == "bert" else 66  # RoBERTa's count its two rows before the first position
    config = AutoConfig.for_model(request.param, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=positions,
                                  pad_token_id=0 if request.param == "bert" else 1)
    model = AutoModel.from_config(config, dtype=torch.float32).eval()
    for name, param in model.named_parameters():  # LayerNorms drawn too: an unread bias or weight would show
        if "LayerNorm" in name:
            torch.nn.init.normal_(param, mean=1.0 if name.endswith("weight") else 0.0, std=0.2)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    _bert_tokenizer(folder)
    return folder, model


def hf_pooled(model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    pooled = {"cls": hidden[0], "mean": hidden.mean(0), "last": hidden[-1]}[pooling]
    return torch.nn.functional.normalize(pooled, dim=-1)


@pytest.mark.parametrize("pooling", ["cls", "mean", "last"])
def test_an_encoder_s_embeddings_are_hf_s_pooled_states(encoder, pooling, make_llm_for_test):
    """A batch of prompts of 1 to 60 tokens, more of them than one step holds (they wait their turn whole): each
    embedding HF's to float32's last bits."""
    path, hf = encoder
    llm = make_llm_for_test(path, dtype="float32", runner="pooling", pooling_type=pooling,
                            max_num_batched_tokens=64)
    prompts = [[7], *prompts_of(6, 2, 60, seed=5)]
    for ids, out in zip(prompts, llm.embed(prompts), strict=True):
        ours = torch.tensor(out.outputs.embedding)
        assert ours.shape == (64,) and (ours - hf_pooled(hf, ids, pooling)).abs().max().item() < 1e-5, len(ids)
    assert llm.engine.kv.cache is None  # an encoder's prompt is never a cached prefix's continuation


def test_texts_are_wrapped_as_bert_s_tokenizer_wraps_them(encoder, make_llm_for_test):
    """[CLS] text [SEP] (the tokenizer.json's post-processor), as HF's tokenizer encodes it; an encoder pools by
    CLS where nothing says otherwise (vLLM's default); in bf16, the embeddings stay within rounding of float32's."""
    from transformers import PreTrainedTokenizerFast

    path, hf = encoder
    texts = ["The cat sat on the mat.", "then the dog ran far, far away"]
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    llm = make_llm_for_test(path, dtype="float32", runner="pooling")
    outs = llm.embed(texts)
    for text, out in zip(texts, outs, strict=True):
        ids = theirs(text)["input_ids"]
        assert out.prompt_token_ids == ids and ids[0] == 2 and ids[-1] == 3
        assert (torch.tensor(out.outputs.embedding) - hf_pooled(hf, ids, "cls")).abs().max().item() < 1e-5
    half = make_llm_for_test(path, dtype="bfloat16", runner="pooling")
    for ours, full in zip(half.embed(texts), outs, strict=True):
        cosine = torch.dot(torch.tensor(ours.outputs.embedding), torch.tensor(full.outputs.embedding)).item()
        assert cosine > 0.995


def test_an_encoder_generates_nothing_and_takes_prompts_one_step_holds(encoder, make_llm_for_test, caplog):
    path, _ = encoder
    with pytest.raises(ValueError, match="runner: .* is an encoder .*--runner pooling"):
        make_llm_for_test(path, dtype="float32")
    with pytest.raises(ValueError, match="pooling_type: pools embeddings, which need runner='pooling'"):
        EngineConfig(model=str(path), pooling_type="mean")
    with caplog.at_level("WARNING", logger="ridge"):
        llm = make_llm_for_test(path, dtype="float32", runner="pooling", max_num_batched_tokens=16)
    assert "prefix caching is off" in caplog.text
    assert "max_model_len 64 cut to max_num_batched_tokens (16)" in caplog.text
    assert llm.engine.max_model_len == 16
    with pytest.raises(ValueError, match="prompt: 17 tokens is more than the maximum context length, 16 tokens"):
        llm.embed([list(range(5, 22))])
    with pytest.raises(ValueError, match="runner: this engine runs runner='pooling'"):
        llm.generate([5, 6], SamplingParams(max_tokens=2))
    assert len(llm.embed([list(range(5, 21))])[0].outputs.embedding) == 64  # 16 tokens: the whole context


def test_a_declared_pooling_is_honoured(encoder, make_llm_for_test, tmp_path, caplog):
    """A sentence-transformers folder's Pooling module: mean runs as mean (most such models; one ridge lacks is
    refused: test_embeddings); pooling_type over a declared pooling runs, said at warning level."""
    path, hf = encoder
    folder = tmp_path / "st"
    shutil.copytree(path, folder)
    declare_pooling(folder, "pooling_mode_mean_tokens")
    ids = [2, 9, 10, 11, 3]
    got = make_llm_for_test(folder, dtype="float32", runner="pooling").embed([ids])[0].outputs.embedding
    assert (torch.tensor(got) - hf_pooled(hf, ids, "mean")).abs().max().item() < 1e-5
    with caplog.at_level("WARNING", logger="ridge"):
        make_llm_for_test(folder, dtype="float32", runner="pooling", pooling_type="cls")
    assert "pooling_type=cls, where st declares mean pooling" in caplog.text


def test_the_server_embeds_with_an_encoder(encoder):
    """/v1/embeddings with OpenAI's client: a batch of texts, each its LLM.embed vector; a completion refused."""
    import openai
    from transformers import PreTrainedTokenizerFast

    path, hf = encoder
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    config = EngineConfig(model=str(path), dtype="float32", kv_cache_memory="16MiB", runner="pooling",
                          pooling_type="mean")
    texts = ["the cat sat", "and then it slept on the mat"]
    with running_server(config, ServerConfig("bge")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = client.embeddings.create(model="bge", input=texts)
        for text, data in zip(texts, got.data, strict=True):
            ids = tokenizer(text)["input_ids"]
            assert (torch.tensor(data.embedding) - hf_pooled(hf, ids, "mean")).abs().max().item() < 1e-5
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="bge", prompt="x", max_tokens=2)
        assert caught.value.body["param"] == "runner"
        assert srv.engine.state().idle


def test_two_tensor_parallel_ranks_embed_as_hf_does(encoder, make_llm_for_test):
    """Each rank holds its heads' share of every layer (the position and type tables whole); mean pooling."""
    path, hf = encoder
    two = make_llm_for_test(path, dtype="float32", runner="pooling", pooling_type="mean", kv_cache_memory="16MiB",
                            tensor_parallel_size=2)
    prompts = prompts_of(3, 2, 50, seed=8)
    for ids, out in zip(prompts, two.embed(prompts), strict=True):
        assert (torch.tensor(out.outputs.embedding) - hf_pooled(hf, ids, "mean")).abs().max().item() < 1e-5


def test_bench_embed_draws_a_random_encoder_s_weights_for_both_engines(capsys):
    """`ridge bench embed` on a random-weight bge-base cut small: HF's initialiser draws the weights once, both
    engines load them; their CLS embeddings agree and both rates are reported."""
    from ridge.cli import main

    model = ("random:bge-base-en-v1.5,num_layers=2,hidden_size=64,num_heads=4,num_kv_heads=4,head_dim=16,"
             "intermediate_size=128,vocab_size=512")
    assert main(["bench", "embed", "--model", model, "--dtype", "float32", "--num-prompts", "4", "--input-len", "16",
                 "--hf-batch-size", "2", "--repeats", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == model and report["pooling"] == "cls" and report["repeats"] == 2
    assert [r["engine"] for r in report["rows"]] == ["ridge", "HF transformers"]
    assert all(r["tok_s"] > 0 and r["roofline_fraction"] > 0 for r in report["rows"])
    assert report["max_cosine_distance"] < 1e-6
