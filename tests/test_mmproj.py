"""llama.cpp's multimodal projector files (`--mmproj`): a GGUF language model (qwen2vl, gemma3) and its vision tower in
an mmproj GGUF, written as llama.cpp's converter writes them from small random Qwen2-VL, Qwen2.5-VL and Gemma 3
checkpoints (the tower's names from the gguf package's own table: bench/mmproj_gguf.py), against HF transformers
on the checkpoint; the text-only language model; refusals by name."""

import json

import pytest
import test_gemma3_images as gemma3_images
import test_pixtral as pixtral_images
import test_vision as qwen_images
import torch
from gguf import GGUFWriter

from ridge import SamplingParams
from ridge.bench.mmproj_gguf import write_mmproj
from ridge.bench.random_gguf import write_gguf, write_vocabulary
from ridge.models.loader import load_model


def gguf_pair(folder):
    """The HF folder's language model as a GGUF (float32, its tokenizer.json's vocabulary) and its tower as a
    projector file: (model, mmproj)."""
    loaded = load_model(folder, torch.float32, progress=False)
    vocabulary = write_vocabulary(folder / "tokenizer.json", folder / "vocabulary.gguf", loaded.spec.vocab_size)
    return (write_gguf(loaded, folder / "model.gguf", vocabulary, float16=False),
            write_mmproj(folder, folder / "mmproj.gguf"))


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def qwen_files(request, tmp_path_factory):
    folder, hf = qwen_images.random_vision_model(request.param, tmp_path_factory.mktemp(request.param))
    return (*gguf_pair(folder), folder, hf)


def test_a_qwen_vl_gguf_with_its_mmproj_reads_images_as_hf(qwen_files, make_llm_for_test):
    """Prompt log-probabilities with two images of different shapes: the GGUF pair's equal the HF folder's in ridge
    and HF transformers' on the checkpoint; greedy tokens equal HF's; a chat with an image the folder's."""
    model, mmproj, folder, hf = qwen_files
    images = qwen_images.pictures((56, 84), (84, 56))
    head, parts = [1, 2, 3], [[4, 5], [6, 7, 8]]
    prompt = qwen_images.prompt_with(head, images, parts)
    llm = make_llm_for_test(model, mmproj=mmproj, dtype="float32", kv_cache_memory="16MiB")
    assert llm.engine.loaded.config.vision.family == "qwen"
    ids, ours = qwen_images.prompt_logprobs(llm, prompt)
    from_folder_llm = make_llm_for_test(folder, dtype="float32", kv_cache_memory="16MiB")
    folder_ids, from_folder = qwen_images.prompt_logprobs(from_folder_llm, prompt)
    assert ids == folder_ids
    assert (ours - from_folder).abs().max().item() < 1e-5
    expected = qwen_images.hf_prompt_logprobs(hf, qwen_images.hf_inputs(hf, head, images, parts))
    assert (ours - expected).abs().max().item() < 1e-4
    assert (llm.generate(prompt, qwen_images.GREEDY)[0].outputs[0].token_ids
            == qwen_images.hf_greedy(hf, head, images, parts))
    # chat: the GGUF's template (copied from the folder's) places an OpenAI image_url part as the folder's does
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": qwen_images.data_url(
        images[0])}}, {"type": "text", "text": "what is it"}]}]
    chats = [engine.chat(messages, qwen_images.GREEDY)[0] for engine in (llm, from_folder_llm)]
    assert chats[0].prompt_token_ids == chats[1].prompt_token_ids
    assert chats[0].outputs[0].token_ids == chats[1].outputs[0].token_ids


def test_the_language_model_alone_serves_text_and_refuses_images(qwen_files, make_llm_for_test):
    """Without its projector a qwen2vl file is a text model (M-RoPE's three positions are equal on text): the same
    greedy tokens as with it; an image is refused by name, and the engine serves on."""
    model, mmproj, _, _ = qwen_files
    text = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = make_llm_for_test(model, dtype="float32", kv_cache_memory="16MiB")
    paired = make_llm_for_test(model, mmproj=mmproj, dtype="float32", kv_cache_memory="16MiB")
    prompt = {"prompt_token_ids": [1, 2, 3, 40, 41]}
    assert alone.generate(prompt, text)[0].outputs[0].token_ids == paired.generate(prompt, text)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="image"):
        alone.generate(qwen_images.prompt_with([1], qwen_images.pictures((56, 56)), [[4]]), text)
    assert len(alone.generate(prompt, text)[0].outputs[0].token_ids) == 8


def random_gemma3_for_gguf(path):
    """test_gemma3_images' Gemma 3 in a shape llama.cpp's gemma3 graph runs (which its files cannot describe
    otherwise): six layers, the sixth global; attention scaled by the head's width."""
    return gemma3_images.random_gemma3(path, num_hidden_layers=6, query_pre_attn_scalar=16,
                                       layer_types=["sliding_attention"] * 5 + ["full_attention"])


@pytest.mark.parametrize("family", ["gemma3", "mistral3"])
def test_gemma3_and_mistral3_ggufs_with_their_mmproj_read_images_as_hf(family, tmp_path, make_llm_for_test):
    """Two images of different shapes: Gemma 3's (each's tokens attending to each other both ways, on windowed and
    global layers, a prompt past the window) and Mistral 3's (rows of tokens between breaks; a llama GGUF, Pixtral's
    q / k rows permuted in the mmproj): HF transformers' prompt log-probabilities and greedy tokens."""
    module = gemma3_images if family == "gemma3" else pixtral_images
    folder, hf = random_gemma3_for_gguf(tmp_path) if family == "gemma3" else pixtral_images.random_mistral3(tmp_path)
    model, mmproj = gguf_pair(folder)
    llm = make_llm_for_test(model, mmproj=mmproj, dtype="float32", kv_cache_memory="16MiB")
    assert llm.engine.loaded.config.vision.family == ("siglip" if family == "gemma3" else "pixtral")
    images = qwen_images.pictures((60, 90), (300, 120))
    head, parts = [5, 17, 40, 41], [[77, 78, 79], [90, 91, 92, 93, 94]]
    prompt = module.prompt_with(head, images, parts)
    ids, ours = qwen_images.prompt_logprobs(llm, prompt)
    assert ids == (module.laid_out(head, parts) if family == "gemma3" else module.laid_out(head, images, parts))
    expected = qwen_images.hf_prompt_logprobs(hf, module.hf_inputs(head, images, parts))
    assert (ours - expected).abs().max().item() < 1e-4
    assert llm.generate(prompt, qwen_images.GREEDY)[0].outputs[0].token_ids == module.hf_greedy(
        hf, head, images, parts)


def test_projector_files_that_do_not_fit_are_refused_by_name(qwen_files, tmp_path, make_llm_for_test):
    from ridge import LLM

    model, mmproj, folder, _ = qwen_files
    with pytest.raises(ValueError, match="mmproj: a projector file goes with a GGUF language model"):
        LLM(str(folder), mmproj=str(mmproj))
    with pytest.raises(ValueError, match="mmproj: .*model.gguf is not a multimodal projector"):
        LLM(str(model), mmproj=str(model))
    with pytest.raises(ValueError, match="mmproj: .* is not a file"):
        LLM(str(model), mmproj=str(tmp_path / "missing.gguf"))
    for kind, refusal in [("llama4", "clip.projector_type 'llama4' is not supported"),
                          ("pixtral", "a pixtral projector goes with a llama / mistral3 language model; model is "
                                      "qwen[23]vl")]:
        other = tmp_path / f"{kind}.gguf"
        writer = GGUFWriter(str(other), "clip")
        writer.add_clip_projector_type(kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ValueError, match=refusal):
            LLM(str(model), mmproj=str(other))
    wide = tmp_path / "wide"
    wide.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["hidden_size"] = 128
    (wide / "config.json").write_text(json.dumps(config))
    for name in ("preprocessor_config.json", *[p.name for p in folder.glob("*.safetensors")]):
        (wide / name).symlink_to(folder / name)
    with pytest.raises(ValueError, match="projection_dim 128 is not the language model's width \\(64\\)"):
        LLM(str(model), mmproj=str(write_mmproj(wide, tmp_path / "wide.gguf")))


def test_gemma3_shapes_llama_cpp_would_run_otherwise_are_not_written(tmp_path):
    """A gemma3 GGUF cannot say which layers are global (llama.cpp's graph: every 6th): test_gemma3_images' model,
    global on its second layer, is refused by name rather than written as another model."""
    folder, _ = gemma3_images.random_gemma3(tmp_path)
    loaded = load_model(folder, torch.float32, progress=False)
    with pytest.raises(ValueError, match=r"gemma3 windows all but every 6th layer .* this model windows layers \[0\]"):
        write_gguf(loaded, tmp_path / "model.gguf", tmp_path / "unread.gguf", float16=False)
