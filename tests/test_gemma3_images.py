"""Gemma 3 with images (SigLIP's encoder, Gemma 3's pooling projector, an image's tokens attending to each other both
ways in the language model): preprocessing, the tower, prompt log-probabilities and greedy tokens against HF
transformers on a small random config (its windowed layers too); chunked prefill that never cuts an image, a prefix
cache hit that ends inside one, chat; refusals by name; ridge plan's count of the tower."""

import json

import pytest
import torch
from test_vision import GREEDY, data_url, hf_prompt_logprobs, pictures, prompt_logprobs, saved_with_tokenizer

from ridge import SamplingParams
from test_models_random import byte_tokenizer, with_drawn_norms

SPECIALS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>", "<end_of_turn>"]
BOI, EOI, IMAGE = 256, 257, 258
SIDE, TOKENS = 224, 16  # 16x16 patches of 14 pixels, pooled 4x4 into 16 tokens
TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
            "{% else %}{% for c in m.content %}{% if c.type in ('image', 'image_url') %}<start_of_image>"
            "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}")


def hf_processor():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE})


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return random_gemma3(tmp_path_factory.mktemp("gemma3"))


def random_gemma3(path, **text_fields):
    """A 2-layer Gemma 3 (a window of 8 on its first layer; `text_fields` override its text config) beside a 2-layer
    SigLIP (224-pixel images, 16 tokens each), its projector's matrix drawn (HF starts it at zero), saved with its
    tokenizer and image processor: (its folder, HF's model)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"], initializer_range=0.2)
    text.update(text_fields)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                  image_size=SIDE, initializer_range=0.2)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS,
                                                     boi_token_index=BOI, eoi_token_index=EOI,
                                                     image_token_index=IMAGE))
    hf = with_drawn_norms(hf.float().eval())
    hf.model.multi_modal_projector.mm_input_projection_weight.data.normal_(0, 0.2)
    return saved_with_tokenizer(hf, path, hf_processor(), SPECIALS, TEMPLATE), hf


NEWLINES = byte_tokenizer().encode("\n\n").ids  # what frames an image, as HF's processor writes it


def laid_out(head: list[int], parts: list[list[int]]) -> list[int]:
    """HF's Gemma3Processor's layout: each image "\\n\\n<start_of_image>", its tokens, "<end_of_image>\\n\\n"."""
    ids = list(head)
    for text in parts:
        ids += [*NEWLINES, BOI, *[IMAGE] * TOKENS, EOI, *NEWLINES, *text]
    return ids


def hf_inputs(head, images, parts, bidirectional: bool = True) -> dict:
    """bidirectional False: no token types, so HF's image tokens attend causally (the check can fail)."""
    input_ids = torch.tensor([laid_out(head, parts)])
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
              "pixel_values": hf_processor()(images=images, return_tensors="pt")["pixel_values"]}
    return {**inputs, "token_type_ids": (input_ids == IMAGE).long()} if bidirectional else inputs


def hf_greedy(hf, head, images, parts) -> list[int]:
    inputs = hf_inputs(head, images, parts)
    return hf.generate(**inputs, max_new_tokens=10, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()


def prompt_with(head: list[int], images, parts: list[list[int]]) -> dict:
    ids = list(head)
    for text in parts:
        ids += [BOI] + text
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


def test_images_are_cut_as_gemma3s_processor_cuts_them(gemma3, tmp_path):
    """Resized to the square (bilinear, aspect not kept) and normalized: HF's pixels, patch for patch; pan and
    scan refused by name."""
    from ridge.models.spec import spec_from_hf_config
    from ridge.multimodal.images import ImageProcessing, preprocess_image

    path, _ = gemma3
    images = pictures((60, 90), (300, 120))
    tower = spec_from_hf_config(json.loads((path / "config.json").read_text()), path.name).vision
    processing = ImageProcessing.of_model(path, tower)
    for image, pixels in zip(images, hf_processor()(images=images, return_tensors="pt")["pixel_values"],
                             strict=True):
        ours = preprocess_image(image, processing)
        assert ours.grid == (1, SIDE // 14, SIDE // 14)
        grid = pixels.unfold(1, 14, 14).unfold(2, 14, 14).permute(1, 2, 0, 3, 4)  # [16, 16, 3, 14, 14]
        units = grid.reshape(4, 4, 4, 4, -1).transpose(1, 2)  # 4x4 patches a token, each unit's consecutive
        assert torch.equal(units.reshape(ours.patches.shape), ours.patches)
    config = json.loads((path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**config, "do_pan_and_scan": True}))
    with pytest.raises(ValueError, match="do_pan_and_scan: Gemma 3's pan and scan .* is not supported"):
        ImageProcessing.of_model(tmp_path, tower)


def test_the_tower_equals_hf(gemma3):
    from ridge.models.loader import load_model
    from ridge.multimodal.images import ImageProcessing, preprocess_image

    path, hf = gemma3
    images = pictures((60, 90), (300, 120))
    loaded = load_model(path, torch.float32, progress=False)
    ours = [preprocess_image(image, ImageProcessing.of_model(path, loaded.config.vision)) for image in images]
    with torch.no_grad():
        pixels = hf_processor()(images=images, return_tensors="pt")["pixel_values"]
        expected = hf.model.get_image_features(pixels).pooler_output.flatten(0, 1)
        got = loaded.model.visual(torch.cat([o.patches for o in ours]), [o.grid for o in ours])
    assert got.shape == (2 * TOKENS, 1, expected.shape[-1])
    assert (got[:, 0] - expected).abs().max().item() < 1e-5 * expected.abs().max().item()


def test_image_tokens_attend_both_ways_as_hf(gemma3, make_llm_for_test):
    """Two images in a prompt: HF's prompt log-probabilities with an image's tokens attending to each other both
    ways (on the windowed layer and the global one), not HF's causal ones; greedy tokens; and the same in steps of
    at most 24 tokens, which end before an image rather than inside it."""
    path, hf = gemma3
    images = pictures((60, 90), (300, 120))
    head, parts = [5, 17, 40, 41], [[77, 78, 79], [90, 91, 92, 93, 94]]
    prompt = prompt_with(head, images, parts)
    llm = make_llm_for_test(path, dtype="float32")
    ids, ours = prompt_logprobs(llm, prompt)
    assert ids == laid_out(head, parts)
    assert (ours - hf_prompt_logprobs(hf, hf_inputs(head, images, parts))).abs().max().item() < 1e-4
    assert (ours - hf_prompt_logprobs(hf, hf_inputs(head, images, parts, bidirectional=False))).abs().max() > 1e-2
    expected = hf_greedy(hf, head, images, parts)
    assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == expected
    chunked = make_llm_for_test(path, dtype="float32", enforce_eager=True, max_num_batched_tokens=24)
    scheduler, ends = chunked.engine.scheduler, set()
    schedule = scheduler.schedule

    def recording():  # where each step's chunks end
        step = schedule()
        ends.update(seq.num_computed + n for seq, n in zip(step.seqs, step.num_tokens, strict=True))
        return step

    scheduler.schedule = recording
    assert [o.outputs[0].token_ids for o in chunked.generate([prompt, prompt], GREEDY)] == [expected, expected]
    at = [i for i, token in enumerate(ids) if token == IMAGE]
    spans = [(at[0], at[TOKENS - 1] + 1), (at[TOKENS], at[-1] + 1)]
    assert len(ends) > 4 and not any(lo < end < hi for end in ends for lo, hi in spans)


def test_a_cache_hit_inside_an_image_reads_the_rest_of_it(gemma3, make_llm_for_test):
    """The same prompt twice, its image's tokens at 23-38 of 43: the second finds two blocks of 16 (the last one's
    token is never a hit), up to the middle of the image, and computes the rest of it (its queries seeing the
    image's end) and the text: HF's tokens both times. An image larger than a step's budget is refused by name;
    the engine serves on."""
    path, hf = gemma3
    image = pictures((60, 90))
    head, parts = list(range(40, 60)), [[70]]
    llm = make_llm_for_test(path, dtype="float32", block_size=16)
    expected = hf_greedy(hf, head, image, parts)
    scored = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    outs = [llm.generate(prompt_with(head, image, parts), scored)[0].outputs[0] for _ in range(2)]
    assert [o.token_ids for o in outs] == [expected, expected]
    first = len(head) + len(NEWLINES) + 1
    assert first < llm.generate(prompt_with(head, image, parts), GREEDY)[0].num_cached_tokens == 32 < first + TOKENS
    for computed, cached in zip(outs[0].logprobs, outs[1].logprobs, strict=True):  # the hit's: the same numbers
        assert max(abs(computed[token] - cached[token]) for token in computed) < 1e-5
    small = make_llm_for_test(path, dtype="float32", max_num_batched_tokens=12)
    with pytest.raises(ValueError, match=r"images: an image's 16 tokens, computed in one step, are over "
                                         r"max_num_batched_tokens \(12\)"):
        small.generate(prompt_with(head, image, parts), GREEDY)
    assert small.generate({"prompt_token_ids": head}, GREEDY)[0].outputs[0].token_ids


def test_chat_places_the_image_and_batch_invariance_refuses_it(gemma3, make_llm_for_test):
    """LLM.chat's image_url part: the template's <start_of_image> widened, HF's tokens. batch_invariant's kernel
    reads each token's own prefix: images are refused by name there."""
    path, hf = gemma3
    image = pictures((60, 90))
    llm = make_llm_for_test(path, dtype="float32")
    chat = llm.chat([{"role": "user", "content": [{"type": "text", "text": "look"},
                                                  {"type": "image_url", "image_url": {"url": data_url(image[0])}}]}],
                    GREEDY)[0]
    encode = llm.tokenizer.encode
    assert chat.outputs[0].token_ids == hf_greedy(hf, encode("<start_of_turn>user\nlook"), image,
                                                  [encode("<end_of_turn>\n")])
    invariant = make_llm_for_test(path, dtype="float32", batch_invariant=True)
    with pytest.raises(ValueError, match="images: not supported with batch_invariant"):
        invariant.generate(prompt_with([5], image, [[6]]), GREEDY)


def test_plan_counts_the_tower(gemma3):
    from ridge.models.spec import spec_from_hf_config
    from ridge.plan.arithmetic import count_parameters

    path, hf = gemma3
    spec = spec_from_hf_config(json.loads((path / "config.json").read_text()), path.name)
    towers = (hf.model.vision_tower, hf.model.multi_modal_projector)
    heads = sum(p.numel() for name, p in hf.model.vision_tower.named_parameters() if ".head." in f".{name}")
    assert count_parameters(spec).vision == sum(p.numel() for t in towers for p in t.parameters()) - heads


def test_bench_vision_runs_gemma3_beside_hf(gemma3, capsys):
    """`ridge bench vision` on a Gemma 3 folder: both engines' images per second (HF's image tokens typed, so that
    they attend both ways there too), and their first tokens, which agree."""
    from ridge.cli import main

    path, _ = gemma3
    assert main(["bench", "vision", "--model", str(path), "--dtype", "float32", "--num-images", "2", "--image-size",
                 "56", "--text-len", "4", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["image_tokens"] == TOKENS and report["prompt_tokens"] == 2 * len(NEWLINES) + 2 + TOKENS + 4
    assert report["first_tokens_agree"] == 2 and all(r["images_s"] > 0 for r in report["rows"])
