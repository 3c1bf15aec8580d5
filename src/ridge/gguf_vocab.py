"""A GGUF file's vocabulary as a `tokenizers` pipeline: byte-level BPE ('gpt2') or SentencePiece ('llama').

Byte-level BPE files carry their merges and the name of their pre-tokenizer split; we rebuild the pipeline
the model's tokenizer.json describes. SentencePiece files carry tokens and scores but no merges: they are
recovered from the vocabulary (every way to cut a token into two tokens is a merge, the better-ranked
token's merges first), and text is tokenized with byte fallback (a character outside the vocabulary
becomes its UTF-8 bytes' <0xXX> tokens). HF transformers builds the same pipeline from these files, and
its tokens are what tests compare against.
"""

from __future__ import annotations

import logging

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from ridge.models.gguf_file import GGUFFile

log = logging.getLogger("ridge")

# Pre-tokenizer split patterns by the name llama.cpp writes to `tokenizer.ggml.pre`.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: Qwen2's with combining marks (\p{M}) kept in words, as its tokenizer.json splits
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k's (gpt-oss, Llama 4): words split at case changes, their contractions kept on
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's tekken: o200k's without the contractions, digits one at a time
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> its split (the names llama.cpp writes; HF transformers reads GGUF vocabularies by the same
# table): the model families whose split is one of the above under a name of their own
_SPLITS = {
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "lfm2", "dbrx",
                     "smaug-bpe", "glm4", "chatglm-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    "qwen35": _QWEN35_SPLIT,
}

# GGUF token types (llama.cpp's enum)
CONTROL, USER_DEFINED = 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space


def vocabulary_tokenizer(gguf: GGUFFile) -> Tokenizer:
    kind = gguf.fields.get("tokenizer.ggml.model")
    tokens: list[str] = gguf.fields.get("tokenizer.ggml.tokens")
    types: list[int] = gguf.fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if kind == "gpt2":
        tok = _byte_level_bpe(gguf, tokens)
    elif kind == "llama":  # a token of spaces alone is stored as spaces: the model sees ▁s
        tok = _sentencepiece_bpe(gguf, [_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens])
    elif kind == "bert":
        tok = _wordpiece(gguf, tokens)
    else:
        raise ValueError(f"tokenizer.ggml.model: {kind!r} is not supported (supported: gpt2, llama, bert)")
    vocab = tok.get_vocab()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == CONTROL])
    # user-defined tokens (`<think>`, Gemma's "\n\n") are matched whole in the text, as llama.cpp does
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types, strict=True) if ty == USER_DEFINED and t in vocab])
    return tok


def _wordpiece(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    """llama.cpp's bert vocabulary (its WPM tokenizer's) as BERT's WordPiece: its converter stores a word's first
    piece behind a ▁ (a phantom space), a continuation bare and a bracketed special ([CLS]) as it is, which is
    WordPiece's `##` form written the other way. BERT's uncased normalizer and word split (llama.cpp lower-cases
    too); [CLS] text [SEP] around a text, [CLS] a [SEP] b [SEP] around a pair (its post-processor)."""
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token.startswith(_SPACE):
            piece = token[1:]
        elif token.startswith("[") and token.endswith("]"):
            piece = token
        else:
            piece = "##" + token
        vocab.setdefault(piece, i)
    fields = gguf.fields
    unknown = tokens[fields.get("tokenizer.ggml.unknown_token_id", vocab.get("[UNK]", 0))]
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unknown))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls = fields.get("tokenizer.ggml.cls_token_id", fields.get("tokenizer.ggml.bos_token_id"))
    sep = fields.get("tokenizer.ggml.seperator_token_id", fields.get("tokenizer.ggml.eos_token_id"))
    if cls is None or sep is None:
        raise ValueError("tokenizer.ggml.cls_token_id / seperator_token_id: a bert vocabulary needs both (the [CLS] "
                         "and [SEP] around a text)")
    tok.post_processor = processors.BertProcessing((tokens[sep], sep), (tokens[cls], cls))
    return tok


def _byte_level_bpe(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in gguf.fields.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               byte_fallback=False))
    tok.pre_tokenizer = _byte_level_split(gguf.fields.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    return tok


def _byte_level_split(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if (split := _SPLITS.get(pre)) is not None:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"), byte_level_only])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in ("gpt2", "default"):
        log.warning("ridge: tokenizer.ggml.pre %r has no split here; text is split as GPT-2 splits it, and its tokens "
                    "may differ from llama.cpp's for this model", pre)
    return gpt2


def _sentencepiece_bpe(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    # Gemma's scores do not follow the order its merges were learned in; its tokens' order in the file does
    arch = gguf.fields.get("general.architecture", "")
    if arch.startswith("gemma"):
        rank = {t: i for i, t in enumerate(tokens)}
    else:
        scores = gguf.fields.get("tokenizer.ggml.scores")
        order = sorted(range(len(tokens)), key=lambda i: -scores[i])
        rank = {tokens[i]: r for r, i in enumerate(order)}
    unk = gguf.fields.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges_from_vocabulary(vocab, rank), fuse_unk=True,
                               byte_fallback=True, unk_token=tokens[unk] if unk is not None else None))
    space = normalizers.Replace(" ", _SPACE)
    if gguf.fields.get("tokenizer.ggml.add_space_prefix", True):  # SentencePiece's default: " " before the text
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), space])
    else:
        tok.normalizer = space
    # no Strip of the prefix space when decoding: the detokenizer decodes windows of a stream, and a window's
    # leading space is a real one
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _merges_from_vocabulary(vocab: dict[str, int], rank: dict[str, int]) -> list[tuple[str, str]]:
    """Each way to cut a token into two tokens, as a merge; ordered by the whole token's rank, then by the
    ids of its halves."""
    found = []
    for token, token_rank in rank.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found.extend((token_rank, pair) for pair in pairs)
    found.sort(key=lambda item: item[0])
    return [pair for _, pair in found]
