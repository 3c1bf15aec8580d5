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


def random_encoder(family: str, folder):
    """A 2-layer random encoder of the family saved in `folder` with BERT's tokenizer, and HF's base model of it."""
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(0)
    positions = 64 if family == "bert" else 66  # RoBERTa's count its two rows before the first position
    config = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=positions,
                                  pad_token_id=0 if family == "bert" else 1)
    model = AutoModel.from_config(config, dtype=torch.float32).eval()
    for name, param in model.named_parameters():  # LayerNorms drawn too: an unread bias or weight would show
        if "LayerNorm" in name:
            torch.nn.init.normal_(param, mean=1.0 if name.endswith("weight") else 0.0, std=0.2)
    model.save_pretrained(folder)
    _bert_tokenizer(folder)
    return folder, model


@pytest.fixture(scope="module", params=["bert", "roberta", "xlm-roberta"])
def encoder(request, tmp_path_factory):
    """(its folder, HF's base model) of each family's random encoder."""
    return random_encoder(request.param, tmp_path_factory.mktemp(request.param))


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


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def cross_encoder(request, tmp_path_factory):
    """(its folder, HF's model, HF's tokenizer) of a random cross-encoder (a sequence classifier of one label: BERT's
    ms-marco-MiniLM, XLM-RoBERTa's bge-reranker) with BERT's tokenizer; its weights drawn wider than HF's
    initialiser draws them (std 0.2, the head's 0.3), so that the documents' scores spread over 0.25 to 0.65 and a
    misread token type or head would show."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, PreTrainedTokenizerFast

    torch.manual_seed(1)
    config = AutoConfig.for_model(request.param, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128, num_labels=1,
                                  max_position_embeddings=64 if request.param == "bert" else 66,
                                  pad_token_id=0 if request.param == "bert" else 1)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    for name, param in model.named_parameters():
        if "LayerNorm" not in name:
            torch.nn.init.normal_(param, std=0.3 if name.startswith(("classifier", "bert.pooler")) else 0.2)
    folder = tmp_path_factory.mktemp(f"{request.param}-reranker")
    model.save_pretrained(folder)
    _bert_tokenizer(folder)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                        model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    return folder, model, tokenizer


QUERY = "the cat"
DOCUMENTS = ["the cat sat on the mat", "a dog ran far away", "then it slept", "cat and dog"]


def hf_scores(model, tokenizer, query: str, documents: list[str]) -> torch.Tensor:
    """HF's relevance of each document to the query: the sigmoid of the pair's logit (token types included)."""
    with torch.inference_mode():
        return torch.cat([model(**tokenizer(query, d, return_tensors="pt")).logits[:, 0] for d in documents]).sigmoid()


def test_a_cross_encoder_scores_pairs_as_hf_does(cross_encoder, make_llm_for_test):
    """LLM.score: each pair read as one input ([CLS] query [SEP] document [SEP], the second text's tokens of type 1
    where the model has token types), the sigmoid of its logit; classify gives the same probability; one query
    against many documents, and pairs of equal lists."""
    path, hf, tokenizer = cross_encoder
    llm = make_llm_for_test(path, dtype="float32", runner="pooling")
    expected = hf_scores(hf, tokenizer, QUERY, DOCUMENTS)
    assert expected.max() - expected.min() > 0.05  # the documents are told apart
    scored = llm.score(QUERY, DOCUMENTS)
    assert [o.prompt_token_ids for o in scored] == [tokenizer(QUERY, d)["input_ids"] for d in DOCUMENTS]
    assert (torch.tensor([o.outputs.score for o in scored]) - expected).abs().max() < 1e-5
    pairwise = llm.score([QUERY, "dog"], DOCUMENTS[:2])
    assert abs(pairwise[0].outputs.score - expected[0].item()) < 1e-5
    assert abs(pairwise[1].outputs.score - hf_scores(hf, tokenizer, "dog", DOCUMENTS[1:2]).item()) < 1e-5
    probs = llm.classify([tokenizer(QUERY, d)["input_ids"] for d in DOCUMENTS])
    assert (torch.tensor([o.outputs.probs[0] for o in probs]) - expected).abs().max() < 1e-5
    with pytest.raises(ValueError, match="text_2: 3 texts against 2 in text_1"):
        llm.score(["a", "b"], ["c", "d", "e"])
    with pytest.raises(ValueError, match="embed: this model is a classifier"):
        llm.embed("the cat")
    with pytest.raises(ValueError, match="pooling_type: .* is a classifier"):
        make_llm_for_test(path, dtype="float32", runner="pooling", pooling_type="mean")


def test_an_embedding_model_scores_by_cosine_similarity(encoder, make_llm_for_test):
    """LLM.score on an embedding model: the two texts' embeddings' cosine similarity; classify is refused."""
    path, _ = encoder
    llm = make_llm_for_test(path, dtype="float32", runner="pooling", pooling_type="mean")
    vectors = {t: torch.tensor(o.outputs.embedding) for t, o in zip([QUERY, *DOCUMENTS], llm.embed([QUERY, *DOCUMENTS]),
                                                                    strict=True)}
    for out, doc in zip(llm.score(QUERY, DOCUMENTS), DOCUMENTS, strict=True):
        assert abs(out.outputs.score - float(vectors[QUERY] @ vectors[doc])) < 1e-6
    with pytest.raises(ValueError, match="classify: this model has no classification head"):
        llm.classify("the cat")


def test_the_server_scores_reranks_and_classifies(cross_encoder):
    """/v1/score, /v1/rerank (and /rerank, /v2/rerank: Jina's and Cohere's) and /classify: the scores LLM.score gives,
    the documents by score with top_n, refusals by name; an embeddings request on a classifier is refused."""
    import httpx

    path, hf, tokenizer = cross_encoder
    expected = hf_scores(hf, tokenizer, QUERY, DOCUMENTS).tolist()
    config = EngineConfig(model=str(path), dtype="float32", kv_cache_memory="16MiB", runner="pooling")
    with running_server(config, ServerConfig("reranker")) as srv:
        score = httpx.post(f"{srv.url}/v1/score", json={"model": "reranker", "text_1": QUERY, "text_2": DOCUMENTS},
                           timeout=60).json()
        assert [d["index"] for d in score["data"]] == [0, 1, 2, 3] and score["object"] == "list"
        assert max(abs(d["score"] - e) for d, e in zip(score["data"], expected, strict=True)) < 1e-5
        order = sorted(range(4), key=lambda i: -expected[i])
        for path_ in ("/v1/rerank", "/rerank", "/v2/rerank"):
            reply = httpx.post(srv.url + path_, json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2},
                               timeout=60).json()
            assert [r["index"] for r in reply["results"]] == order[:2]
            assert [r["document"]["text"] for r in reply["results"]] == [DOCUMENTS[i] for i in order[:2]]
            assert abs(reply["results"][0]["relevance_score"] - expected[order[0]]) < 1e-5
        bare = httpx.post(f"{srv.url}/v1/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS],
                                                        "return_documents": False}, timeout=60).json()
        assert [r["index"] for r in bare["results"]] == order and "document" not in bare["results"][0]
        classes = httpx.post(f"{srv.url}/classify", json={"input": [tokenizer(QUERY, DOCUMENTS[0])["input_ids"]]},
                             timeout=60).json()
        assert abs(classes["data"][0]["probs"][0] - expected[0]) < 1e-5 and classes["data"][0]["num_classes"] == 1
        for route, body, param in (
                ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
                ("/v1/score", {"text_1": QUERY, "text_2": []}, "text_2"),
                ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
                ("/v1/rerank", {"query": QUERY, "documents": ["x"], "max_tokens_per_doc": 8}, "max_tokens_per_doc"),
                ("/v1/rerank", {"query": QUERY, "documents": ["x " * 70]}, "documents"),  # past the 64-token context
                ("/v1/score", {"text_1": QUERY, "text_2": "x", "use_activation": False}, "use_activation"),
                ("/v1/embeddings", {"input": "the cat"}, "model")):
            got = httpx.post(srv.url + route, json=body, timeout=60)
            assert got.status_code == 400 and got.json()["error"]["param"] == param, got.json()
        assert srv.engine.state().idle


def llama_cpp_gguf(folder, out, pooling: int | None = None):
    """The BERT in `folder` written as llama.cpp's convert_hf_to_gguf.py writes one: gguf-py's tensor names for its
    bert architecture, float32, its WordPiece vocabulary in phantom-space form (a word's first piece behind a ▁, a
    continuation bare, a bracketed special as it is), [CLS] as BOS, [SEP] as the separator; `pooling`: gguf-py's
    PoolingType, where the model declares one."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(out), "bert")
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    if pooling is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling))
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = [t.startswith("[") and t.endswith("]") for t in tokens]
    writer.add_tokenizer_model("bert")
    writer.add_token_list([t if special else t[2:] if t.startswith("##") else "\u2581" + t
                           for t, special in zip(tokens, specials, strict=True)])
    writer.add_token_types([gguf.TokenType.CONTROL if special else gguf.TokenType.NORMAL for special in specials])
    writer.add_token_type_count(config["type_vocab_size"])
    writer.add_bos_token_id(vocab["[CLS]"])
    writer.add_sep_token_id(vocab["[SEP]"])
    writer.add_unk_token_id(vocab["[UNK]"])
    writer.add_pad_token_id(vocab["[PAD]"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, layers)
    for name, tensor in load_file(folder / "model.safetensors").items():
        if name.startswith("pooler.") or name.endswith("position_ids"):  # llama.cpp leaves them out
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_gguf_of_a_bert_embeds_as_its_hf_folder(tmp_path, make_llm_for_test):
    """llama.cpp's form of a BERT (its bert GGUF: WordPiece in phantom-space form, gguf-py's names): the same tokens
    of a text as HF's tokenizer gives, the same embeddings as HF's model, and the file's declared pooling honoured."""
    import gguf
    from transformers import PreTrainedTokenizerFast

    folder, hf = random_encoder("bert", tmp_path / "hf")
    path = llama_cpp_gguf(folder, tmp_path / "bert.gguf", pooling=gguf.PoolingType.MEAN)
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    llm = make_llm_for_test(path, dtype="float32", runner="pooling")
    assert llm.engine.pooling == "mean"
    texts = ["The cat sat on the mat.", "then the dog ran far, far away", "zzz unknownword!"]
    for text, out in zip(texts, llm.embed(texts), strict=True):
        ids = theirs(text)["input_ids"]
        assert out.prompt_token_ids == ids
        assert (torch.tensor(out.outputs.embedding) - hf_pooled(hf, ids, "mean")).abs().max().item() < 1e-5
