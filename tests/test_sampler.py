"""Sampler: each filter against its definition, the sampled distribution against softmax, seeds per row."""

import pytest
import torch

from ridge.engine.sampler import Sampler
from ridge.engine.sequence import Sequence
from ridge.sampling_params import SamplingParams

EOS = 3


def seq(params: SamplingParams, prompt=(0,), outputs=()) -> Sequence:
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return Sequence(seq_id=0, request_id="r", index=0, prompt_len=len(prompt), token_ids=[*prompt, *outputs],
                    params=params, generator=gen)


def frequencies(logits_row, params, n=20000) -> torch.Tensor:
    sampler = Sampler(len(logits_row), frozenset({EOS}))
    logits = torch.tensor([logits_row], dtype=torch.float32).repeat(n, 1)
    tokens = sampler(logits, [seq(params) for _ in range(n)]).tokens
    return torch.bincount(torch.tensor(tokens), minlength=len(logits_row)).float() / n


LOGITS = [2.0, 1.5, 0.5, -1.0]


def test_greedy_is_argmax():
    sampler = Sampler(4, frozenset({EOS}))
    logits = torch.randn(16, 4)
    tokens = sampler(logits, [seq(SamplingParams(temperature=0)) for _ in range(16)]).tokens
    assert tokens == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_matches_softmax(temperature):
    freq = frequencies(LOGITS, SamplingParams(temperature=temperature))
    expected = torch.softmax(torch.tensor(LOGITS) / temperature, -1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_top_k_and_top_p_keep_the_nucleus():
    probs = torch.softmax(torch.tensor(LOGITS), -1)  # about [0.53, 0.32, 0.12, 0.03]
    two = probs[:2] / probs[:2].sum()
    for params in (SamplingParams(top_k=2), SamplingParams(top_p=0.6)):
        freq = frequencies(LOGITS, params)
        assert torch.allclose(freq[:2], two, atol=0.015) and freq[2:].sum() == 0, (params, freq)


def test_min_p_drops_unlikely_tokens():
    freq = frequencies(LOGITS, SamplingParams(min_p=0.2))  # keeps tokens with p >= 0.2 * 0.53
    assert freq[3] == 0 and freq[2] > 0


def test_filters_at_their_limit_reduce_to_greedy():
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)):
        assert frequencies(LOGITS, params, n=500)[0] == 1.0


def test_penalties():
    sampler = Sampler(4, frozenset({EOS}))
    logits = torch.tensor([[2.0, 2.0, -1.0, 0.0]])
    # token 0 seen in the prompt: repetition penalty halves its positive logit; token 1 wins
    out = sampler(logits, [seq(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(0,))])
    assert out.tokens == [1]
    # token 1 generated twice: frequency penalty 0.6 * 2 takes it below token 0
    out = sampler(logits, [seq(SamplingParams(temperature=0, frequency_penalty=0.6), prompt=(2,), outputs=(1, 1))])
    assert out.tokens == [0]
    out = sampler(logits, [seq(SamplingParams(temperature=0, presence_penalty=0.5), prompt=(2,), outputs=(1,))])
    assert out.tokens == [0]


def test_min_tokens_blocks_eos():
    sampler = Sampler(4, frozenset({EOS}))
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0]])
    assert sampler(logits, [seq(SamplingParams(temperature=0, min_tokens=2), outputs=(1,))]).tokens != [EOS]
    assert sampler(logits, [seq(SamplingParams(temperature=0, min_tokens=1), outputs=(1,))]).tokens == [EOS]


def test_seed_gives_same_tokens_whatever_the_batch():
    sampler = Sampler(50, frozenset({EOS}))
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=1.0, seed=1234)

    def draw(neighbours: int) -> list[int]:
        s = seq(params)
        tokens = []
        for _ in range(8):
            batch = [seq(SamplingParams(temperature=1.0)) for _ in range(neighbours)] + [s]
            tokens.append(sampler(logits.repeat(neighbours + 1, 1), batch).tokens[-1])
        return tokens

    assert draw(0) == draw(5) == draw(17)
    assert len(set(draw(0))) > 1  # it does sample


def test_logprobs_are_log_softmax_of_the_model_output():
    sampler = Sampler(6, frozenset({EOS}))
    logits = torch.randn(2, 6)
    out = sampler(logits, [seq(SamplingParams(temperature=0, logprobs=2)), seq(SamplingParams(temperature=0))])
    ref = logits[0].log_softmax(-1)
    entry = out.logprobs[0]
    top2 = ref.topk(2).indices.tolist()
    assert set(entry) == set(top2) | {out.tokens[0]}
    for token, value in entry.items():
        assert value == pytest.approx(ref[token].item(), abs=1e-5)
    assert out.logprobs[1] is None


def test_allowed_token_ids_leave_only_those_tokens():
    logits = torch.tensor([LOGITS], dtype=torch.float32).repeat(2000, 1)
    sampler = Sampler(4, frozenset({EOS}))
    params = SamplingParams(temperature=1.0, allowed_token_ids=[1, 3], logit_bias={1: -1.0, 0: 5.0})
    tokens = torch.tensor(sampler(logits, [seq(params) for _ in range(2000)]).tokens)
    assert set(tokens.tolist()) == {1, 3}  # the bias on token 0 cannot bring it back
    expected = torch.softmax(torch.tensor([LOGITS[1] - 1.0, LOGITS[3]]), -1)[0].item()
    assert abs((tokens == 1).float().mean().item() - expected) < 0.04
    greedy = sampler(logits[:2], [seq(SamplingParams(temperature=0, allowed_token_ids=[2])),
                                  seq(SamplingParams(temperature=0))]).tokens
    assert greedy == [2, 0]  # the other row is untouched


def test_bad_words_ban_a_word_s_last_token_where_the_rest_precedes_it():
    from ridge.engine.sampler import bad_word_ids

    sampler = Sampler(4, frozenset({EOS}))
    logits = torch.tensor([LOGITS], dtype=torch.float32)
    one_token, two_tokens = seq(SamplingParams(temperature=0)), seq(SamplingParams(temperature=0), outputs=(2,))
    one_token.bad_word_ids = [[0]]  # token 0 always banned: the next best is 1
    two_tokens.bad_word_ids = [[2, 0], [1, 0]]  # "2 0" banned after a 2; "1 0" not after a 2
    after_other = seq(SamplingParams(temperature=0), outputs=(1, 1))
    after_other.bad_word_ids = [[2, 0]]
    tokens = sampler(logits.repeat(3, 1), [one_token, two_tokens, after_other]).tokens
    assert tokens == [1, 1, 0]
    encode = {"cat": [7], " cat": [8], "big dog": [5, 6], " big dog": [9, 6]}.__getitem__
    assert bad_word_ids(["cat", " big dog"], encode) == [[7], [8], [5, 6], [9, 6]]
