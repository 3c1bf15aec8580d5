"""Mistral 3 with images (Pixtral's encoder, Mistral 3's projector, images laid out row by row between break
tokens): preprocessing, the tower, prompt log-probabilities and greedy tokens against HF transformers on a small
random config; chunked prefill across an image's rows, the prefix cache and chat against the same; ridge plan's
count of the tower."""

import dataclasses
import json

import pytest
import torch
from test_vision import GREEDY, data_url, hf_prompt_logprobs, pictures, prompt_logprobs, saved_with_tokenizer

from test_models_random import with_drawn_norms

SPECIALS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"]
IMG, IMG_BREAK, IMG_END = 256, 257, 258
PATCH, MERGE, LONGEST_EDGE = 14, 2, 140
TEMPLATE = ("{% for m in messages %}[INST]{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for c in m.content %}{% if c.type in ('image', 'image_url') %}[IMG]{% elif c.type == 'text' %}"
            "{{ c.text }}{% endif %}{% endfor %}{% endif %}[/INST]{% endfor %}")


def hf_processor():
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    return PixtralImageProcessorPil(patch_size=PATCH, size={"longest_edge": LONGEST_EDGE})


def hf_features(images) -> dict:
    """HF's pixels: resized to multiples of a merged token (Mistral 3's processor passes patch x merge)."""
    return hf_processor()(images=images, return_tensors="pt", patch_size=PATCH * MERGE)


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    return random_mistral3(tmp_path_factory.mktemp("mistral3"))


def random_mistral3(path):
    """A 2-layer Mistral language model beside a 2-layer Pixtral encoder (14-pixel patches, images of at most 140
    pixels a side) and Mistral 3's projector, saved with its tokenizer and image processor: (its folder, HF's
    model)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(model_type="mistral", vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
                sliding_window=None)  # (Mistral Small 3.1's, without windows)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, head_dim=16, patch_size=PATCH, image_size=LONGEST_EDGE,
                  initializer_range=0.2)  # attention far from uniform: the rotary shows in the output
    torch.manual_seed(0)
    hf = Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision,
                                                         image_token_index=IMG, spatial_merge_size=MERGE,
                                                         tie_word_embeddings=False))
    hf = with_drawn_norms(hf.float().eval())
    return saved_with_tokenizer(hf, path, hf_processor(), SPECIALS, TEMPLATE), hf


def laid_out(head: list[int], images, parts: list[list[int]]) -> list[int]:
    """HF's PixtralProcessor's layout of each image's placeholder: its rows of merged tokens, a break after each
    row, the end token in place of the last break."""
    ids = list(head)
    for (height, width), text in zip(hf_features(images)["image_sizes"].tolist(), parts, strict=True):
        rows, columns = height // (PATCH * MERGE), width // (PATCH * MERGE)
        span = ([IMG] * columns + [IMG_BREAK]) * rows
        span[-1] = IMG_END
        ids += span + text
    return ids


def hf_inputs(head: list[int], images, parts: list[list[int]]) -> dict:
    features = hf_features(images)
    input_ids = torch.tensor([laid_out(head, images, parts)])
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "pixel_values": features["pixel_values"], "image_sizes": features["image_sizes"]}


def hf_greedy(hf, head, images, parts, max_new_tokens=10) -> list[int]:
    inputs = hf_inputs(head, images, parts)
    out = hf.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def prompt_with(head: list[int], images, parts: list[list[int]]) -> dict:
    ids = list(head)
    for text in parts:
        ids += [IMG] + text
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


def test_images_are_cut_as_pixtrals_processor_cuts_them(mistral3):
    """Resized within the longest edge (one image shrunk to it, one grown to a merged token's multiple), normalized:
    HF's pixels, patch for patch; a preprocessor config whose patches are not the tower's refused."""
    from ridge.models.spec import spec_from_hf_config
    from ridge.multimodal.images import ImageProcessing, preprocess_image

    path, _ = mistral3
    images = pictures((60, 90), (300, 120))
    features = hf_features(images)
    tower = spec_from_hf_config(json.loads((path / "config.json").read_text()), path.name).vision
    processing = ImageProcessing.of_model(path, tower)
    for image, pixels, (height, width) in zip(images, features["pixel_values"], features["image_sizes"].tolist(),
                                              strict=True):
        ours = preprocess_image(image, processing)
        assert ours.grid == (1, height // PATCH, width // PATCH)
        grid = pixels[:, :height, :width].unfold(1, PATCH, PATCH).unfold(2, PATCH, PATCH).permute(1, 2, 0, 3, 4)
        units = grid.reshape(height // PATCH // MERGE, MERGE, width // PATCH // MERGE, MERGE, -1)
        assert torch.equal(units.transpose(1, 2).reshape(ours.patches.shape), ours.patches)
    other = dataclasses.replace(tower, patch_size=16)
    with pytest.raises(ValueError, match="patch_size 14 is not the vision tower's 16"):
        ImageProcessing.of_model(path, other)


def test_the_tower_equals_hf(mistral3):
    """Two images of different shapes in one pass: each its own attention, its tokens row by row."""
    from ridge.models.loader import load_model
    from ridge.multimodal.images import ImageProcessing, preprocess_image

    path, hf = mistral3
    images = pictures((60, 90), (300, 120))
    features = hf_features(images)
    loaded = load_model(path, torch.float32, progress=False)
    ours = [preprocess_image(image, ImageProcessing.of_model(path, loaded.config.vision)) for image in images]
    with torch.no_grad():
        expected = torch.cat(list(hf.model.get_image_features(features["pixel_values"], features["image_sizes"])
                                  .pooler_output))
        got = loaded.model.visual(torch.cat([o.patches for o in ours]), [o.grid for o in ours])
    assert got.shape == (expected.shape[0], 1, expected.shape[1])
    assert (got[:, 0] - expected).abs().max().item() < 1e-5 * expected.abs().max().item()


def test_greedy_tokens_with_images_equal_hf(mistral3, make_llm_for_test):
    """Two images in a prompt, laid out as HF's processor lays them out: HF's prompt log-probabilities and greedy
    tokens, and the same chunked through the images' rows (budgets of 7 tokens: chunks that end on a row break, in
    a row, on the end token) two prompts at a time."""
    path, hf = mistral3
    images = pictures((60, 90), (300, 120))
    head, parts = [5, 17, 40, 41], [[77, 78, 79], [90, 91, 92, 93, 94]]
    expected = hf_greedy(hf, head, images, parts)
    prompt = prompt_with(head, images, parts)
    llm = make_llm_for_test(path, dtype="float32")
    assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == expected
    ids, ours = prompt_logprobs(llm, prompt)
    assert ids == laid_out(head, images, parts)
    assert (ours - hf_prompt_logprobs(hf, hf_inputs(head, images, parts))).abs().max().item() < 1e-4
    chunked = make_llm_for_test(path, dtype="float32", enforce_eager=True, max_num_batched_tokens=7)
    outs = chunked.generate([prompt, prompt], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [expected, expected]


def test_the_prefix_cache_and_chat_tell_images_apart(mistral3, make_llm_for_test):
    """The same text with two images: each its own (HF's) tokens; the first again hits the cache. LLM.chat's
    image_url part placed by the template: the tokens of the same prompt given with its ids."""
    path, hf = mistral3
    first, second = pictures((60, 90)), pictures((60, 90), seed=1)
    head, parts = list(range(40, 80)), [[70, 71, 72]]
    llm = make_llm_for_test(path, dtype="float32", block_size=16)
    outs = [llm.generate(prompt_with(head, images, parts), GREEDY)[0] for images in (first, second, first)]
    assert outs[0].outputs[0].token_ids == hf_greedy(hf, head, first, parts)
    assert outs[1].outputs[0].token_ids == hf_greedy(hf, head, second, parts)
    assert outs[2].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert outs[1].num_cached_tokens == 32 < outs[2].num_cached_tokens
    chat = llm.chat([{"role": "user", "content": [{"type": "text", "text": "look"},
                                                  {"type": "image_url", "image_url": {"url": data_url(first[0])}}]}],
                    GREEDY)[0]
    encode = llm.tokenizer.encode
    assert chat.outputs[0].token_ids == hf_greedy(hf, encode("[INST]look"), first, [encode("[/INST]")])


def test_plan_counts_the_tower(mistral3):
    """`ridge plan`'s count of the encoder and projector: HF's."""
    from ridge.models.spec import spec_from_hf_config
    from ridge.plan.arithmetic import count_parameters

    path, hf = mistral3
    spec = spec_from_hf_config(json.loads((path / "config.json").read_text()), path.name)
    towers = (hf.model.vision_tower, hf.model.multi_modal_projector)
    assert count_parameters(spec).vision == sum(p.numel() for tower in towers for p in tower.parameters())


def test_bench_vision_runs_mistral3_beside_hf(mistral3, capsys):
    """`ridge bench vision` on a Mistral 3 folder: both engines' images per second, and their first tokens, which
    agree (random presets: tests/test_vision.py)."""
    from ridge.cli import main

    path, _ = mistral3
    args = ["--dtype", "float32", "--num-images", "2", "--image-size", "56", "--text-len", "4", "--repeats", "1",
            "--json"]
    assert main(["bench", "vision", "--model", str(path), *args]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["image_tokens"] == 4 and report["prompt_tokens"] == 2 * 3 + 4  # two rows of two tokens and a break
    assert report["first_tokens_agree"] == 2 and all(r["images_s"] > 0 for r in report["rows"])
