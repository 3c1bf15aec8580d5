"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL with images: preprocessing, the vision tower and greedy tokens against HF
transformers on small random configs; the engine's paths (chunked prefill across an image, the prefix cache, the
server) against the plain one; refusals by name."""

import base64
import dataclasses
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import AddedToken

from conftest import running_server
from ridge import SamplingParams
from ridge.config import EngineConfig
from ridge.multimodal.images import ImageProcessing, load_image, preprocess_image
from ridge.serve.gateway import ServerConfig
from test_models_random import byte_tokenizer, with_drawn_norms

# the byte-level tokenizer's 256 symbols, then these special tokens
SPECIALS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>"]
VISION_START, IMAGE_PAD, VISION_END = 256, 257, 258
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
            "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PIXELS = {"min_pixels": 28 * 28 * 2, "max_pixels": 28 * 28 * 20}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def hf_processor(kind: str = "qwen2_vl"):
    """HF's image processor of a model of this kind (Qwen3-VL's: 16-pixel patches, its own mean and deviation)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if kind.startswith("qwen3_vl"):
        return Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                        min_pixels=32 * 32 * 2, max_pixels=32 * 32 * 20)
    return Qwen2VLImageProcessorPil(**PIXELS)


def pictures(*sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def random_vision_model(kind: str, path):
    """A 2-layer language model beside a 2- or 3-block vision tower (Qwen2.5-VL's with windows of 2x2 merged
    tokens and one full-attention block; Qwen3-VL's with its position table and two DeepStack mergers, and
    interleaved M-RoPE; Qwen3-VL-MoE's language model of 4 experts), saved with its tokenizer (the vision and chat
    special tokens) and image processor: (its folder, HF's model)."""
    import transformers

    text = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, tie_word_embeddings=False,
                initializer_range=0.2)  # logits far from uniform: a token's rotary positions show in them
    ids = dict(image_token_id=IMAGE_PAD, video_token_id=259, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END)
    if kind == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64)
    elif kind == "qwen2_5_vl":
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, window_size=56,
                      fullatt_block_indexes=[1])
    else:
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=16,
                      num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
        del text["rope_theta"], text["rope_scaling"]
        text.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [2, 3, 3], "mrope_interleaved": True})
        if kind == "qwen3_vl_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    names = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL", "qwen3_vl_moe": "Qwen3VLMoe"}
    config = getattr(transformers, names[kind] + "Config")(text_config=text, vision_config=vision, **ids)
    torch.manual_seed(0)
    hf = getattr(transformers, names[kind] + "ForConditionalGeneration")(config)
    hf = with_drawn_norms(hf.float().eval())
    return saved_with_tokenizer(hf, path, hf_processor(kind), SPECIALS, TEMPLATE), hf


def saved_with_tokenizer(hf, path, processor, specials: list[str], template: str):
    """HF's model saved with its image processor and a byte-level tokenizer of these special tokens (ids 256 on)
    and this chat template: the folder."""
    hf.save_pretrained(path)
    processor.save_pretrained(path)
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return path


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def vision_model(request, tmp_path_factory):
    return random_vision_model(request.param, tmp_path_factory.mktemp(request.param))


def hf_inputs(hf, head: list[int], images, parts: list[list[int]], mrope: bool = True) -> dict:
    """HF's inputs: head, then each image (widened by HF's processor) followed by its part of text. mrope False:
    every token turned at its index, as a plain rotary would (HF's positions given, the image tokens' types not)."""
    features = hf_processor(hf.config.model_type)(images=images, return_tensors="pt")
    ids = list(head)
    for grid, text in zip(features["image_grid_thw"], parts, strict=True):
        ids += [VISION_START] + [IMAGE_PAD] * (int(grid.prod()) // 4) + [VISION_END] + text
    input_ids = torch.tensor([ids])
    types = ({"mm_token_type_ids": (input_ids == IMAGE_PAD).int()} if mrope
             else {"position_ids": torch.arange(len(ids)).unsqueeze(0)})
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), **types,
            "pixel_values": features["pixel_values"], "image_grid_thw": features["image_grid_thw"]}


def hf_greedy(hf, head: list[int], images, parts: list[list[int]], max_new_tokens: int = 10) -> list[int]:
    inputs = hf_inputs(hf, head, images, parts)
    out = hf.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def prompt_logprobs(llm, prompt) -> tuple[list[int], torch.Tensor]:
    """The prompt's tokens (its images widened) and ridge's log-probability of each after the first."""
    scored = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ids = scored.prompt_token_ids
    return ids, torch.tensor([entry[token] for entry, token in zip(scored.prompt_logprobs[1:], ids[1:], strict=True)])


def hf_prompt_logprobs(hf, inputs: dict) -> torch.Tensor:
    """HF's log-probability of each prompt token after the first."""
    with torch.no_grad():
        logits = hf(**inputs).logits[0, :-1].log_softmax(-1)
    return logits.gather(1, inputs["input_ids"][0, 1:].unsqueeze(1)).squeeze(1)


def llm_tokenizer(path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    return lambda text: tokenizer.encode(text).ids


def prompt_with(head: list[int], images, parts: list[list[int]]) -> dict:
    """vLLM's prompt dict: each image's one placeholder (ridge widens it) between the texts."""
    ids = list(head)
    for text in parts:
        ids += [VISION_START, IMAGE_PAD, VISION_END] + text
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"])
def test_images_are_cut_into_the_patches_hf_makes(kind, tmp_path):
    """Resized within the pixel budget (one image grown to it, one shrunk to it), normalized, laid out in merge
    units: the patches and grids of HF's Qwen2VLImageProcessor (Qwen3-VL's settings too, read from its saved
    preprocessor_config.json), exactly; an extreme aspect ratio refused."""
    from ridge.multimodal.vision_config import VisionConfig

    images = pictures((60, 90), (20, 30), (300, 400))
    processor = hf_processor(kind)
    features = processor(images=images, return_tensors="pt")
    processor.save_pretrained(tmp_path)
    tower = VisionConfig(depth=1, width=32, num_heads=2, intermediate_size=64, output_size=64, activation="silu",
                         gated_mlp=False, rms_norm=False, patch_size=processor.patch_size)
    processing = ImageProcessing.of_model(tmp_path, tower)
    ours = [preprocess_image(image, processing) for image in images]
    assert [list(o.grid) for o in ours] == features["image_grid_thw"].tolist()
    assert torch.equal(torch.cat([o.patches for o in ours]), features["pixel_values"])
    other = dataclasses.replace(tower, patch_size=30 - processor.patch_size)  # 14 <-> 16
    with pytest.raises(ValueError, match=rf"merge_size \({processor.patch_size}, 2, 2\) are not the vision tower's"):
        ImageProcessing.of_model(tmp_path, other)
    with pytest.raises(ValueError, match="aspect ratio of 250 is over the limit of 200"):
        preprocess_image(pictures((2, 500))[0], ImageProcessing(**PIXELS))


def test_the_vision_tower_equals_hf(vision_model):
    """Two images of different shapes in one pass (Qwen2.5-VL: its windows, one cut short at an edge; Qwen3-VL: its
    position table resampled to each, and DeepStack's rows)."""
    from ridge.models.loader import load_model

    path, hf = vision_model
    images = pictures((60, 90), (120, 50))
    features = hf_processor(hf.config.model_type)(images=images, return_tensors="pt")
    model = load_model(path, torch.float32, progress=False).model
    with torch.no_grad():
        output = hf.model.get_image_features(features["pixel_values"], features["image_grid_thw"])
        levels = [output.pooler_output, *getattr(output, "deepstack_features", [])]
        expected = torch.stack([torch.cat(list(level)) for level in levels], dim=1)
        got = model.visual(features["pixel_values"], [tuple(g) for g in features["image_grid_thw"].tolist()])
    assert got.shape == expected.shape
    assert got.shape[1] == (3 if hf.config.model_type == "qwen3_vl" else 1)
    assert (got - expected).abs().max().item() < 1e-5


def test_greedy_tokens_with_images_equal_hf(vision_model, make_llm_for_test):
    """Two images in a prompt (M-RoPE's positions on their grids, the text after them resuming past them): HF's
    prompt log-probabilities (which a plain rotary's positions would miss) and tokens, in the fused decode step, and
    chunked through the images two prompts at a time on the plain path."""
    path, hf = vision_model
    images = pictures((60, 90), (120, 50))
    head, parts = [5, 17, 40, 41], [[77, 78, 79], [90, 91, 92, 93, 94]]
    expected = hf_greedy(hf, head, images, parts)
    prompt = prompt_with(head, images, parts)
    llm = make_llm_for_test(path, dtype="float32")
    assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == expected
    ids, ours = prompt_logprobs(llm, prompt)
    assert ids == hf_inputs(hf, head, images, parts)["input_ids"][0].tolist()
    for mrope, close in ((True, True), (False, False)):
        theirs = hf_prompt_logprobs(hf, hf_inputs(hf, head, images, parts, mrope))
        assert ((ours - theirs).abs().max().item() < 1e-4) == close
    # a budget of 7 tokens a step: chunks end inside both images
    chunked = make_llm_for_test(path, dtype="float32", enforce_eager=True, max_num_batched_tokens=7)
    outs = chunked.generate([prompt, prompt], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [expected, expected]


def test_qwen3_vl_moe_reads_images_as_hf(make_llm_for_test, tmp_path):
    """Qwen3-VL-MoE: Qwen3-VL's tower, DeepStack and interleaved M-RoPE beside a mixture-of-experts language model:
    HF's greedy tokens."""
    path, hf = random_vision_model("qwen3_vl_moe", tmp_path)
    images = pictures((60, 90), (120, 50))
    head, parts = [5, 17, 40, 41], [[77, 78, 79], [90, 91, 92, 93, 94]]
    llm = make_llm_for_test(path, dtype="float32")
    expected = hf_greedy(hf, head, images, parts)
    assert llm.generate(prompt_with(head, images, parts), GREEDY)[0].outputs[0].token_ids == expected


def test_the_prefix_cache_tells_images_apart(vision_model, make_llm_for_test):
    """Two prompts of the same tokens with different images: each its own tokens (HF's), not the cached other's;
    the same image again reuses the cached blocks, up to the middle of the image (the tower runs again, its last
    rows read)."""
    path, hf = vision_model
    first, second = pictures((60, 90)), pictures((60, 90), seed=1)
    head, parts = list(range(40, 84)), [[70, 71, 72]]  # the image's 6 tokens at 45-50: across blocks 2 and 3 of 16
    llm = make_llm_for_test(path, dtype="float32", block_size=16)
    outs = [llm.generate(prompt_with(head, images, parts), GREEDY)[0] for images in (first, second, first)]
    assert outs[0].outputs[0].token_ids == hf_greedy(hf, head, first, parts)
    assert outs[1].outputs[0].token_ids == hf_greedy(hf, head, second, parts)
    assert outs[2].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert outs[1].num_cached_tokens == 32  # the text blocks before the image
    assert outs[2].num_cached_tokens == 48  # and the block holding the image's first 3 tokens


def test_chat_places_images_where_the_template_puts_them(vision_model, make_llm_for_test, tmp_path):
    """LLM.chat with OpenAI's image_url parts (a data: URL, a path) and HF's image part: the template writes each
    image's placeholder, the images widen them in order; the tokens of the same prompt given with its ids."""
    path, hf = vision_model
    images = pictures((60, 90), (120, 50))
    images[1].save(tmp_path / "second.png")
    llm = make_llm_for_test(path, dtype="float32")
    content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": data_url(images[0])}},
               {"type": "text", "text": "and"}, {"type": "image_url", "image_url": str(tmp_path / "second.png")}]
    chat = llm.chat([{"role": "user", "content": content}], GREEDY)[0]
    encode = llm.tokenizer.encode
    head = encode("<|im_start|>user\nlook")
    parts = [encode("and"), encode("<|im_end|>\n<|im_start|>assistant\n")]
    assert chat.prompt_token_ids[:len(head)] == head
    assert chat.outputs[0].token_ids == hf_greedy(hf, head, images, parts)
    pil = llm.chat([{"role": "user", "content": [{"type": "text", "text": "look"},
                                                  {"type": "image", "image": images[0]},
                                                  {"type": "text", "text": "and"},
                                                  {"type": "image_pil", "image_pil": images[1]}]}], GREEDY)[0]
    assert pil.outputs[0].token_ids == chat.outputs[0].token_ids


@pytest.mark.parametrize("vision_model", ["qwen2_5_vl"], indirect=True)  # the plumbing: one model
def test_images_are_refused_by_name(vision_model, make_llm_for_test, smollm2_path):
    """Placeholders and images miscounted, video, a detail level, an unreadable image, images under a draft model,
    images to a text model: ValueErrors naming the field; the engine serves on."""
    path, _ = vision_model
    llm = make_llm_for_test(path, dtype="float32")
    image = pictures((60, 90))[0]
    with pytest.raises(ValueError, match=r"2 image placeholder tokens \(id 257\) for 1 images"):
        llm.generate({"prompt_token_ids": [IMAGE_PAD, 5, IMAGE_PAD], "multi_modal_data": {"image": image}}, GREEDY)
    with pytest.raises(ValueError, match=r"multi_modal_data: only images are supported .* got \['video'\]"):
        llm.generate({"prompt_token_ids": [IMAGE_PAD], "multi_modal_data": {"video": [image]}}, GREEDY)
    with pytest.raises(ValueError, match=r"messages.0.content.0.image_url.detail: 'high' is not supported"):
        llm.chat([{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": data_url(image), "detail": "high"}}]}], GREEDY)
    with pytest.raises(ValueError, match="image_url: not a readable image"):
        llm.generate(prompt_with([5], ["data:image/png;base64," + base64.b64encode(b"not a png").decode()], [[6]]),
                     GREEDY)
    with pytest.raises(ValueError, match="image_url: the data: URL's base64 does not decode"):
        load_image("data:image/png;base64,@@@")
    assert llm.generate(prompt_with([5], [image], [[6]]), GREEDY)[0].outputs[0].token_ids  # still serving
    drafted = make_llm_for_test(path, dtype="float32", speculate="draft", draft_model=str(path))
    with pytest.raises(ValueError, match="images: not supported with a draft model"):
        drafted.generate(prompt_with([5], [image], [[6]]), GREEDY)
    text = make_llm_for_test(smollm2_path, dtype="float32")
    with pytest.raises(ValueError, match=r"multi_modal_data: this model \(llama\) reads no images"):
        text.generate({"prompt": "hi", "multi_modal_data": {"image": image}}, GREEDY)


@pytest.mark.parametrize("vision_model", ["qwen2_5_vl"], indirect=True)  # the plumbing: one model
def test_the_server_reads_image_url_parts(vision_model, tmp_path):
    """/v1/chat/completions with a data: URL image: HF's tokens, and /v1/responses' input_image the same reply; a
    local path outside --allowed-local-media-path and an unreadable image are 400s naming messages, and the server
    serves on (the image's blocks cached)."""
    import openai

    path, hf = vision_model
    image = pictures((60, 90))[0]
    image.save(tmp_path / "cat.png")
    config = EngineConfig(model=str(path), dtype="float32", kv_cache_memory="16MiB")
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                             {"type": "image_url", "image_url": {"url": data_url(image)}}]}]
    with running_server(config, ServerConfig("vl", allowed_local_media_path=tmp_path / "media")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="vl", messages=messages, max_tokens=10, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        encode = llm_tokenizer(path)
        head, tail = encode("<|im_start|>user\nlook"), encode("<|im_end|>\n<|im_start|>assistant\n")
        assert reply.choices[0].token_ids == hf_greedy(hf, head, [image], [tail])
        response = client.responses.create(model="vl", max_output_tokens=10, temperature=0, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "look"},
                                         {"type": "input_image", "image_url": data_url(image)}]}])
        assert response.output_text == reply.choices[0].message.content  # the Responses API's input_image parts
        local = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(tmp_path / "cat.png")}}]}]
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="vl", messages=local, max_tokens=2)
        assert caught.value.body["param"] == "messages"
        assert "--allowed-local-media-path" in caught.value.body["message"]
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="vl", messages=messages, max_tokens=2,
                                           extra_body={"use_beam_search": True, "n": 2})
        assert caught.value.body["param"] == "use_beam_search"
        broken = [{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="vl", messages=broken, max_tokens=2)
        assert "not a readable image" in caught.value.body["message"]
        again = client.chat.completions.create(model="vl", messages=messages, max_tokens=10, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        assert again.choices[0].token_ids == reply.choices[0].token_ids
        assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_bench_vision_runs_both_engines_on_the_same_images(tmp_path, capsys, monkeypatch):
    """`ridge bench vision` on a model folder (Qwen2.5-VL's): ridge's (also on the folder written as llama.cpp's
    files, --gguf) and HF's images per second, the FLOPs an image costs, and their first tokens (which agree); on a
    random preset (Qwen3-VL's cut small here), its weights drawn
    for both."""
    from ridge.bench import vision
    from ridge.cli import main

    path, _ = random_vision_model("qwen2_5_vl", tmp_path)
    args = ["--dtype", "float32", "--num-images", "2", "--image-size", "56", "--text-len", "4", "--repeats", "1",
            "--json"]
    assert main(["bench", "vision", "--model", str(path), "--gguf", *args]) == 0
    report = json.loads(capsys.readouterr().out)
    # (llama.cpp's row where its peer is installed: not in the suite's environment)
    assert [r["engine"] for r in report["rows"]][:3] == ["ridge", "ridge (GGUF + mmproj)", "HF transformers"]
    assert report["image_tokens"] == 4 and report["prompt_tokens"] == 4 + 2 + 4
    assert report["first_tokens_agree"] == 2 and report["tower_gflop_per_image"] > 0
    assert report["rows"][1]["first_tokens_agree_with_ridge"] == 2
    assert all(r["images_s"] > 0 and r["roofline_fraction"] > 0 for r in report["rows"])
    assert main(["bench", "vision", "--model", str(path), "--lm-layers", "2", *args]) == 2  # a folder runs whole
    assert "--lm-layers: cuts a random: model's language model" in capsys.readouterr().err
    kind, text, tower = vision.PRESETS["qwen3-vl-2b"]
    small_text = {**text, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 16,
                  "rope_parameters": {**text["rope_parameters"], "mrope_section": [2, 3, 3]}}
    small_tower = {**tower, "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                   "out_hidden_size": 32, "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]}
    monkeypatch.setitem(vision.PRESETS, "tiny", (kind, small_text, small_tower))
    assert main(["bench", "vision", "--model", "random:tiny", "--lm-layers", "1", *args]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "random:tiny (language model cut to 1 layers)" and report["first_tokens_agree"] == 2


def test_plan_counts_the_vision_tower(vision_model):
    """`ridge plan`'s arithmetic holds the tower's parameters (HF's count of them) in memory, in 16 bits beside an
    int4 language model, and out of what a decoded token reads."""
    from ridge.models.spec import spec_from_hf_config
    from ridge.plan.arithmetic import count_parameters, weight_bytes

    path, hf = vision_model
    spec = spec_from_hf_config(json.loads((path / "config.json").read_text()), path.name)
    counts = count_parameters(spec)
    assert counts.vision == sum(p.numel() for p in hf.model.visual.parameters()) > 0
    assert counts.stored - counts.active == counts.vision  # a dense model: only the tower sits out of decode
    assert weight_bytes(spec, "int4") == (counts.stored - counts.norms - counts.vision) * 0.5 + \
        (counts.norms + counts.vision) * 2


def test_two_tensor_parallel_ranks_read_images_as_one_process(tmp_path, make_llm_for_test):
    """Rank 0 runs the tower (whole on every rank) and sends the step's image rows (Qwen3-VL's: with DeepStack's)
    with its inputs; each rank turns its heads by M-RoPE: one process's tokens, chunked through the images, beside a
    text prompt."""
    path, _ = random_vision_model("qwen3_vl", tmp_path)
    prompts = [prompt_with([5, 17, 40, 41], pictures((60, 90), (120, 50)), [[77, 78, 79], [90, 91, 92]]),
               prompt_with(list(range(30, 60)), pictures((90, 60), seed=3), [[70, 71]]), [5, 6, 7, 8]]
    one = make_llm_for_test(path, dtype="float32")
    two = make_llm_for_test(path, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16)
    outs = [[o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] for llm in (one, two)]
    assert outs[0] == outs[1]
    two.engine.close()
