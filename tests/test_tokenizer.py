"""The GGUF-built tokenizer against HF's own reading of the same file; detokenizer and stop strings."""

import pytest

from ridge.tokenizer import IncrementalDetokenizer, RidgeTokenizer, find_stop

TEXTS = [
    "Hello world! 12345 tokens,   spaces\n\n\ttabs",
    "def f(x):\n    return x**2  # héllo 日本語 🙂",
    "<|im_start|>user\nHi<|im_end|>\n",
    "I'm here, you've said: 'don't' 3.14159",
    "   leading and trailing   ",
    "a\r\nb\n\n\nc",
]


@pytest.fixture(scope="module", params=["smollm2_path", "qwen_path"])
def pair(request):
    from transformers import AutoTokenizer

    path = request.getfixturevalue(request.param)
    return RidgeTokenizer.from_path(path), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_encode_decode_match_hf(pair):
    ours, hf = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)


def test_chat_template_matches_hf(pair):
    ours, hf = pair
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected


def test_end_of_turn_tokens_stop_generation(pair):
    ours, _ = pair
    im_end = ours.tokenizer.token_to_id("<|im_end|>")
    assert im_end in ours.stop_token_ids


def test_incremental_detokenizer_never_splits_a_character(smollm2_path):
    tok = RidgeTokenizer.from_path(smollm2_path)
    text = "naïve café — 日本語のテキスト 🙂🚀 done"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the test needs a token holding part of a character"
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_stop_string_spanning_tokens():
    text = "the answer is ###END"
    # the stop arrives split: "##" in one delta, "#END" in the next
    assert find_stop("the answer is ##", 14, ("###END",)) is None
    assert find_stop(text, 16, ("###END",)) == (14, "###END")
    assert find_stop(text, 16, ("END", "###")) == (14, "###")  # the earliest match wins


@pytest.mark.parametrize("where", ["jinja", "named", "jinja over config"])
def test_an_hf_directory_s_chat_template_is_found_where_hf_finds_it(tmp_path, where):
    """chat_template.jinja (what HF transformers saves since 4.43: gpt-oss's and Qwen3's repositories ship it), over
    tokenizer_config.json's; a named list's "default": the text HF transformers renders from the same directory."""
    import json

    from transformers import AutoTokenizer

    from test_models_random import byte_tokenizer

    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    jinja = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
             "{% if add_generation_prompt %}<a>{% endif %}")
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if where == "named":
        config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": jinja}]
    else:
        (tmp_path / "chat_template.jinja").write_text(jinja)
        if where == "jinja over config":
            config["chat_template"] = "{{ 'not this one' }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}]
    expected = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)
    assert RidgeTokenizer.from_path(tmp_path).apply_chat_template(messages) == expected == \
        "<user>Hi!<assistant>Hello.<a>"


@pytest.mark.parametrize("pre,warns", [("qwen2", False), ("smollm", False), ("gpt2", False), ("lfm2", False),
                                       ("kimi-k2", True)])
def test_a_pre_tokenizer_split_ridge_does_not_know_is_said_at_warning_level(pre, warns, caplog):
    """GPT-2's split stands in for a `tokenizer.ggml.pre` name ridge has no pattern for; that is said, not done
    silently (its tokens may differ from llama.cpp's)."""
    import logging

    from ridge.gguf_vocab import _byte_level_split

    with caplog.at_level(logging.WARNING, logger="ridge"):
        _byte_level_split(pre)
    assert any(f"tokenizer.ggml.pre {pre!r} has no split here" in r.message for r in caplog.records) == warns


def test_each_pre_tokenizer_split_is_hf_s():
    """Every `tokenizer.ggml.pre` name ridge has a split for cuts text as HF transformers' GGUF reader cuts it (the
    reference the model tests compare tokens against): LFM2's, gpt-oss's o200k, Llama 4's, Mistral's tekken..."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from ridge.gguf_vocab import _SPLITS, _byte_level_split

    texts = [*TEXTS, "HelloWorld FOOBar they'RE 123456 a/b\r\n\n  x", "ÀÉÎõü Straße İstanbul 你好 Ωμέγα"]
    # names HF's table lacks whose split llama.cpp's vocabulary code gives as Llama 3's: GLM-4's
    assert set(_SPLITS) <= set(GGUF_PRE_TOKENIZER_SPLITS) | {"llama-bpe", "glm4", "chatglm-bpe"}
    for name in _SPLITS:
        theirs = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS.get(name, GGUF_PRE_TOKENIZER_SPLITS["llama3"])),
                                 behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        ours = _byte_level_split(name)
        for text in texts:
            assert ours.pre_tokenize_str(text) == theirs.pre_tokenize_str(text), (name, text)
