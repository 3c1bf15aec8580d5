"""`ridge bench vision`: prompts with an image each, prefilled by ridge and by HF transformers side by side.

--num-images random images of --image-size pixels a side, each in a prompt of its own (the image, then --text-len text
tokens), run to their first token: by ridge's LLM.generate (the batch at once: the vision tower over the images, then
the language model's prefill; the prefix cache off, so that every round runs the tower) and by HF transformers' model in
one batched forward (the same ids, pixels and weights, HF's processor's M-RoPE positions), in the engine's dtype, the
two in turn for --repeats rounds (each one's median). A random-weight model (random:qwen3-vl-2b, -4b, -8b,
random:qwen2.5-vl-3b, -7b, random:qwen2-vl-2b: the published shapes, weights drawn once by HF's initialiser for both
engines, the language model cut to --lm-layers layers: the tower, where an image's cost lies, whole;
random:mistral-small-3.1, Mistral 3's Pixtral encoder; random:gemma-3-4b, Gemma 3's SigLIP) or a Qwen2-VL / Qwen2.5-VL /
Qwen3-VL / Mistral 3 / Gemma 3 HF folder. Per engine: images per second, the matmul FLOP/s of the tower and the language
model's layers on those images (2 x their linear parameters a patch or token, plus the attention's products) as a
fraction of the machine's measured matmul peak (the better of a measure before the rounds and one after them); and
whether the two engines' first tokens agree. The question it answers: what an image costs to read, and how near ridge
reads it to the compute roofline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ridge.bench.embed import add_rounds_args
from ridge.multimodal.images import ImageProcessing
from ridge.plan import arithmetic, roofline

# the published shapes (HF's config.json of each), the vocabulary as large as theirs
_QWEN_TEXT = {"vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
_QWEN25_VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "window_size": 112,
                  "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "patch_size": 14,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "tokens_per_second": 2}
_QWEN3_TEXT = {"vocab_size": 151936, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "head_dim": 128,
               "num_key_value_heads": 8,
               "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True}}
_QWEN3_SMALL_VISION = {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                       "hidden_act": "gelu_pytorch_tanh", "patch_size": 16, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 2304,
                       "deepstack_visual_indexes": [5, 11, 17]}
PRESETS = {
    "qwen2.5-vl-3b": ("qwen2_5_vl", {**_QWEN_TEXT, "hidden_size": 2048, "intermediate_size": 11008,
                                     "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
                                     "tie_word_embeddings": True},
                      {**_QWEN25_VISION, "out_hidden_size": 2048}),
    "qwen2.5-vl-7b": ("qwen2_5_vl", {**_QWEN_TEXT, "vocab_size": 152064, "hidden_size": 3584,
                                     "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                                     "num_key_value_heads": 4, "tie_word_embeddings": False},
                      {**_QWEN25_VISION, "out_hidden_size": 3584}),
    "qwen2-vl-2b": ("qwen2_vl", {**_QWEN_TEXT, "hidden_size": 1536, "intermediate_size": 8960,
                                 "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                                 "tie_word_embeddings": True},
                    {"depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "hidden_size": 1536,
                     "hidden_act": "quick_gelu", "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}),
    "qwen3-vl-2b": ("qwen3_vl", {**_QWEN3_TEXT, "hidden_size": 2048, "intermediate_size": 6144,
                                 "num_hidden_layers": 28, "num_attention_heads": 16, "tie_word_embeddings": True},
                    {**_QWEN3_SMALL_VISION, "out_hidden_size": 2048}),
    "qwen3-vl-4b": ("qwen3_vl", {**_QWEN3_TEXT, "hidden_size": 2560, "intermediate_size": 9728,
                                 "num_hidden_layers": 36, "num_attention_heads": 32, "tie_word_embeddings": True},
                    {**_QWEN3_SMALL_VISION, "out_hidden_size": 2560}),
    "qwen3-vl-8b": ("qwen3_vl", {**_QWEN3_TEXT, "hidden_size": 4096, "intermediate_size": 12288,
                                 "num_hidden_layers": 36, "num_attention_heads": 32, "tie_word_embeddings": False},
                    {**_QWEN3_SMALL_VISION, "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                     "deepstack_visual_indexes": [8, 16, 24], "out_hidden_size": 4096}),
}
PRESETS["mistral-small-3.1"] = (
    "mistral3", {"model_type": "mistral", "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768,
                 "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1e9, "sliding_window": None,
                 "tie_word_embeddings": False},
    {"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
     "num_attention_heads": 16, "head_dim": 64, "patch_size": 14, "image_size": 1540, "hidden_act": "silu"})
PRESETS["gemma-3-4b"] = (
    "gemma3", {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240,
               "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "sliding_window": 1024,
               "query_pre_attn_scalar": 256, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "tie_word_embeddings": True},
    {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
     "num_attention_heads": 16, "patch_size": 14, "image_size": 896, "vision_use_head": False})
VISION_KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "mistral3", "gemma3")
# the kinds whose llama.cpp files ridge writes and reads (--gguf: models/mmproj.py), and their rows
LLAMA_CPP_KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gemma3", "mistral3")
GGUF_ROW, LLAMA_CPP_ROW = "ridge (GGUF + mmproj)", "llama.cpp (GGUF + mmproj)"
DEFAULT_LM_LAYERS = 4
# Qwen's special tokens' ids (their tokenizer's)
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 151652, 151653, 151655, 151656
# Mistral 3's image tokens, named in the tokenizer (the engine finds the row break and end by name): the random
# models' last ids, past the bench's byte tokens
MISTRAL_IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")


def saved_random_vision_model(name: str, lm_layers: int, folder: Path, seed: int = 0) -> Path:
    """PRESETS[name] with lm_layers language-model layers, weights drawn by HF's initialiser, saved as an HF folder
    with a byte-level tokenizer (Mistral 3's image tokens named in it) and no preprocessor config (its family's
    defaults)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ridge.tokenizer import byte_level_tokenizer

    kind, text, vision = PRESETS[name]
    text = {**text, "num_hidden_layers": lm_layers}
    vocab = text["vocab_size"]
    if kind == "mistral3":
        config = AutoConfig.for_model(kind, text_config=text, vision_config=vision, image_token_index=vocab - 3,
                                      tie_word_embeddings=text["tie_word_embeddings"])
    elif kind == "gemma3":  # its image tokens' ids are its config's (the engine frames an image by them)
        config = AutoConfig.for_model(kind, text_config=text, vision_config=vision, mm_tokens_per_image=256)
    else:
        config = AutoConfig.for_model(kind, text_config=text, vision_config=vision, image_token_id=IMAGE_PAD,
                                      video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                                      vision_end_token_id=VISION_END, tie_word_embeddings=text["tie_word_embeddings"])
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    if kind == "gemma3":  # HF's initialiser leaves the projector's matrix at zero: every image would read alike
        model.model.multi_modal_projector.mm_input_projection_weight.data.normal_(0, 0.02)
    model.save_pretrained(folder)
    tokenizer = json.loads(byte_level_tokenizer(vocab)[0].to_str())
    if kind == "mistral3":  # the last three placeholder ids renamed, and special
        names = dict(zip(range(vocab - 3, vocab), MISTRAL_IMAGE_TOKENS, strict=True))
        tokenizer["model"]["vocab"] = {names.get(i, token): i for token, i in tokenizer["model"]["vocab"].items()}
        tokenizer["added_tokens"] = [{"id": i, "content": token, "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True}
                                     for i, token in names.items()]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def noise_images(count: int, size: int, seed: int = 0) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


@dataclass(frozen=True)
class ImageWork:
    """What one image's prompt costs in matmul FLOPs: its tower pass and the language model's prefill of its
    prompt (vocabulary projection left out: one row)."""

    tower_flops: float
    lm_flops: float
    image_tokens: int

    @classmethod
    def of(cls, loaded, grid: tuple[int, int, int], prompt_tokens: int) -> ImageWork:
        """loaded: the engine's LoadedModel (its spec counts the language model's linears, which the engine may
        hold packed for its kernels)."""
        model = loaded.model
        tower = model.visual
        cfg = tower.cfg
        patches = grid[0] * grid[1] * grid[2]
        if cfg.family == "pixtral":  # the encoder's matrices read each patch, the projector's each merged token
            encoder = tower.vision_tower
            per_patch = _matrices(encoder.patch_conv, *encoder.transformer.layers)
            per_token = _matrices(tower.multi_modal_projector)
        elif cfg.family == "siglip":
            per_patch = _matrices(tower.vision_tower.embeddings.patch_embedding, *tower.vision_tower.encoder.layers)
            per_token = _matrices(tower.multi_modal_projector)
        else:  # DeepStack's mergers (Qwen3-VL's) read every merged token too
            per_patch = _matrices(tower.patch_embed, *tower.blocks)
            per_token = _matrices(tower.merger, *tower.deepstack_merger_list)
        linears = 2 * patches * per_patch + 2 * patches // cfg.merge_size**2 * per_token
        whole = patches
        window = min(patches, (cfg.window_size // cfg.patch_size) ** 2) if cfg.window_size else patches
        spans = [whole if cfg.window_size is None or i in cfg.full_attention_blocks else window
                 for i in range(cfg.depth)]
        attention = sum(4 * patches * span * cfg.width for span in spans)  # q.k and p.v, each a product a pair
        counts = arithmetic.count_parameters(loaded.spec)
        layers = counts.active - counts.embeddings - counts.output_head - counts.norms - counts.per_layer_table
        lm = 2 * prompt_tokens * layers + sum(4 * prompt_tokens * prompt_tokens / 2 * model.cfg.num_heads
                                              * model.cfg.head_dim for _ in range(model.cfg.num_layers))
        return cls(linears + attention, lm, patches // cfg.merge_size**2)


def _matrices(*modules: torch.nn.Module) -> int:
    """The weights of these modules' matmuls (a patch convolution's among them), their norms and biases left out."""
    return sum(p.numel() for module in modules for p in module.parameters() if p.dim() >= 2)


def cmd_vision(args: argparse.Namespace) -> int:
    name = args.model.removeprefix("random:")
    if args.model.startswith("random:"):
        if name not in PRESETS:
            raise ValueError(f"--model: {args.model!r} is not random: one of {', '.join(PRESETS)} (or give a "
                             "Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Mistral 3 / Gemma 3 HF folder)")
        layers = args.lm_layers or DEFAULT_LM_LAYERS
        with tempfile.TemporaryDirectory(prefix="ridge-bench-vision-") as folder:
            print(f"[bench] drawing {args.model}'s weights ({layers} language-model layers) for both engines ...",
                  file=sys.stderr)
            saved = saved_random_vision_model(name, layers, Path(folder))
            shown = f"{args.model} (language model cut to {layers} layers)"
            return _bench(args, saved, shown)
    if args.lm_layers is not None:
        raise ValueError("--lm-layers: cuts a random: model's language model; a model folder runs as it is")
    path = Path(args.model)
    kind = json.loads((path / "config.json").read_text()).get("model_type") if path.is_dir() else None
    if kind not in VISION_KINDS:
        raise ValueError(f"--model: {args.model!r} is not a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Mistral 3 / Gemma 3 HF "
                         f"folder or random: one of {', '.join(PRESETS)}")
    return _bench(args, path, args.model)


def _bench(args: argparse.Namespace, path: Path, shown: str) -> int:
    if not args.gguf:
        return _run(args, path, shown, None)
    kind = json.loads((path / "config.json").read_text()).get("model_type")
    if kind not in LLAMA_CPP_KINDS:
        raise ValueError(f"--gguf: llama.cpp's files of {kind} are not written here ({', '.join(LLAMA_CPP_KINDS)})")
    with tempfile.TemporaryDirectory(prefix="ridge-bench-vision-gguf-") as scratch:
        print("[bench] writing the model as llama.cpp's files (a GGUF and its mmproj, float16) ...", file=sys.stderr)
        return _run(args, path, shown, llama_cpp_files(path, Path(scratch)))


def llama_cpp_files(path: Path, folder: Path) -> tuple[Path, Path]:
    """The HF folder's model as llama.cpp's files in `folder`: its language model a GGUF and its tower an mmproj,
    float16 (as llama.cpp's converter writes them by default), the vocabulary its tokenizer.json's with the image
    tokens named (a random model's byte tokenizer has placeholders there; llama.cpp and ridge find them by name)."""
    from ridge.bench.mmproj_gguf import write_mmproj
    from ridge.bench.random_gguf import write_gguf, write_vocabulary
    from ridge.models.loader import load_model

    config = json.loads((path / "config.json").read_text())
    qwen = (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"))
    names = {"gemma3": (("boi_token_index", "<start_of_image>"), ("eoi_token_index", "<end_of_image>"),
                        ("image_token_index", "<image_soft_token>")),
             "mistral3": ()}.get(config["model_type"], qwen)  # (Mistral 3's random tokenizers name its tokens)
    named = {int(config[key]): name for key, name in names if key in config}
    loaded = load_model(path, torch.float16, progress=False)  # the file's form, held once
    vocabulary = write_vocabulary(path / "tokenizer.json", folder / "vocabulary.gguf", loaded.spec.vocab_size, named)
    model = write_gguf(loaded, folder / "model.gguf", vocabulary)
    del loaded
    return model, write_mmproj(path, folder / "mmproj.gguf", float16=True)


def _run(args: argparse.Namespace, path: Path, shown: str, files: tuple[Path, Path] | None) -> int:
    from ridge import LLM, SamplingParams
    from ridge.flags import engine_kwargs

    # the prefix cache off: each round's prompts (the same images) would be found in it, their towers not run
    kwargs = {**engine_kwargs(args), "enable_prefix_caching": False}
    llm = LLM(str(path), progress=not args.json, **kwargs)
    engines = {"ridge": llm}
    if files is not None:
        engines[GGUF_ROW] = LLM(str(files[0]), progress=not args.json, **{**kwargs, "mmproj": str(files[1])})
    engine = llm.engine
    dtype = engine.config.torch_dtype
    images = noise_images(args.num_images, args.image_size)
    config = json.loads((path / "config.json").read_text())
    text = [10 + i % 200 for i in range(args.text_len)]  # byte tokens: in any vocabulary
    vision = engine.loaded.config.vision
    image = vision.start_token_id or engine.loaded.config.image_token_id  # (Gemma 3's placeholder: its start token)
    opening = ([config["vision_start_token_id"], image, config["vision_end_token_id"]]
               if "vision_start_token_id" in config else [image])
    prompts = [{"prompt_token_ids": opening + text, "multi_modal_data": {"image": image}} for image in images]
    first = engine.images.place(prompts[0]["prompt_token_ids"], [images[0]])
    work = ImageWork.of(engine.loaded, first.images[0].image.grid, len(first.token_ids))
    print(f"[bench] measuring the {dtype} matmul peak ...", file=sys.stderr)
    peak = roofline.measure_matmul(dtype)
    greedy = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompts[:1], greedy)  # warm-up
    widened = [engine.images.place(p["prompt_token_ids"], [image]).token_ids
               for p, image in zip(prompts, images, strict=True)]
    hf = None if args.skip_peer else HFVision.load(path, dtype, engine.config.device, engine.images.processing,
                                                   images, widened)
    if isinstance(hf, str):
        print(f"[bench] HF transformers: {hf}", file=sys.stderr)
        hf = None
    for other in list(engines.values())[1:]:
        other.generate(prompts[:1], greedy)  # warm-up
    seconds: dict[str, list[float]] = {**{name: [] for name in engines}, "HF transformers": []}
    firsts: dict[str, list[int]] = {}
    theirs = None
    for _ in tqdm(range(args.repeats), desc="rounds", disable=args.json):
        for name, runner in engines.items():
            start = time.perf_counter()
            firsts[name] = [o.outputs[0].token_ids[0] for o in runner.generate(prompts, greedy)]
            seconds[name].append(time.perf_counter() - start)
        if hf is not None:
            start = time.perf_counter()
            theirs = hf.first_tokens()
            seconds["HF transformers"].append(time.perf_counter() - start)
    ours = firsts["ridge"]
    if files is not None:
        llama = _llama_cpp(args, files, prompts, images, widened, engine)
        if isinstance(llama, str):
            print(f"[bench] llama.cpp: {llama}", file=sys.stderr)
        else:
            seconds[LLAMA_CPP_ROW], firsts[LLAMA_CPP_ROW] = llama
    peak = max(peak, roofline.measure_matmul(dtype))  # again after the rounds: the shared machine's drift
    rows = [_row(engine_name, statistics.median(times), args.num_images, work, peak)
            for engine_name, times in seconds.items() if times]
    for row in rows:  # each engine's first tokens against ridge's on the HF folder
        got = theirs if row["engine"] == "HF transformers" else firsts.get(row["engine"])
        if got is not None and row["engine"] != "ridge":
            row["first_tokens_agree_with_ridge"] = sum(a == b for a, b in zip(ours, got, strict=True))
    report = {"benchmark": "vision", "model": shown, "dtype": str(dtype).removeprefix("torch."),
              "num_images": args.num_images, "image_size": args.image_size, "image_tokens": work.image_tokens,
              "prompt_tokens": len(first.token_ids), "tower_gflop_per_image": work.tower_flops / 1e9,
              "lm_gflop_per_image": work.lm_flops / 1e9, "repeats": args.repeats, "matmul_peak_gflop_s": peak,
              "rows": rows}
    by_engine = {row["engine"]: row for row in rows}
    if theirs is not None:
        report["first_tokens_agree"] = sum(a == b for a, b in zip(ours, theirs, strict=True))
        report["speedup"] = rows[0]["images_s"] / by_engine["HF transformers"]["images_s"]
    if GGUF_ROW in by_engine and LLAMA_CPP_ROW in by_engine:
        report["gguf_speedup_over_llama_cpp"] = (by_engine[GGUF_ROW]["images_s"]
                                                 / by_engine[LLAMA_CPP_ROW]["images_s"])
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\n{shown}: {args.num_images} images of {args.image_size}x{args.image_size} ({work.image_tokens} tokens "
          f"each) in prompts of {report['prompt_tokens']} tokens, {report['dtype']}; a prompt is "
          f"{report['tower_gflop_per_image']:.0f} GFLOP in the tower and {report['lm_gflop_per_image']:.0f} in the "
          f"language model; matmul peak {peak:.0f} GFLOP/s")
    for line in vision_table(report):
        print(line)
    if theirs is not None:
        print(f"\nridge / HF: {report['speedup']:.2f}x the images per second; first tokens agree on "
              f"{report['first_tokens_agree']} of {args.num_images}")
    if "gguf_speedup_over_llama_cpp" in report:
        print(f"ridge / llama.cpp on the same GGUF and mmproj: {report['gguf_speedup_over_llama_cpp']:.2f}x the images "
              "per second")
    return 0


def _llama_cpp(args: argparse.Namespace, files: tuple[Path, Path], prompts: list[dict], images: list,
               widened: list[list[int]], engine) -> tuple[list[float], list[int]] | str:
    """llama.cpp (llama-cpp-python's mtmd, in its peer's interpreter) on the same files and prompts: each round's
    seconds and its first tokens; or why it did not run. mtmd writes an image's own begin and end tokens, so it is
    given the text before them and the prompt's ids after them (Gemma 3's framing newlines as text)."""
    from ridge.bench.cli import find_peers, run_peer

    python = find_peers([], all_installed=True).get("llamacpp")
    if python is None:
        return "not installed (../shared/peers/install.sh llamacpp); left out"
    vision = engine.loaded.config.vision
    with tempfile.TemporaryDirectory(prefix="ridge-bench-vision-images-") as folder:
        jobs = []
        for i, (prompt, image) in enumerate(zip(prompts, images, strict=True)):
            image.save(Path(folder) / f"{i}.png")
            ids = prompt["prompt_token_ids"]
            if vision.family == "siglip":  # ridge's "\n\n<start_of_image>" ... "<end_of_image>\n\n", then the text
                newlines = list(engine.tokenizer.encode("\n\n", add_special_tokens=False))
                before, after = "\n\n", newlines + ids[1:]
            elif vision.family == "pixtral":  # [IMG], then the text (mtmd's rows end in [IMG_END] as ridge's do)
                before, after = "", ids[1:]
            else:  # <|vision_start|> <|image_pad|> <|vision_end|>, then the text
                before, after = "", ids[3:]
            jobs.append({"before": before, "after_ids": after, "image": str(Path(folder) / f"{i}.png")})
        job = {"mode": "vision", "gguf": str(files[0]), "mmproj": str(files[1]), "prompts": jobs,
               "repeats": args.repeats, "n_ctx": max(len(ids) for ids in widened) + 64}
        result = run_peer("llamacpp", python, job, timeout=3600)
    if result.error:
        return f"failed: {result.error}"
    if (counts := result.figures["prompt_tokens"]) != [len(ids) for ids in widened]:
        print(f"[bench] llama.cpp's prompts were {counts} tokens long where ridge's were {[len(i) for i in widened]}: "
              "its own image sizing or layout", file=sys.stderr)
    return result.figures["seconds"], result.figures["first_tokens"]


class HFVision:
    """HF transformers' model of the same folder, prefilling every prompt in one batched forward (the prompts are
    of one length: no padding) and taking each one's greedy first token."""

    def __init__(self, model: torch.nn.Module, inputs: dict) -> None:
        self.model, self.inputs = model, inputs

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype, device: str, processing: ImageProcessing, images: list,
             prompts: list[list[int]]) -> HFVision | str:
        """The model on ridge's device, its inputs prepared there: the prompts' ids with their images widened
        (ridge's placement, which the tests hold to HF's processors) and the pixels of HF's image processor under
        ridge's settings (the folder's preprocessor_config.json, or its family's defaults); or the reason it cannot
        run."""
        try:
            from transformers import AutoModelForImageTextToText
            from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
            from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        except ImportError:
            return "transformers is not installed; left out"
        print("[bench] loading HF transformers' model ...", file=sys.stderr)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device).eval()
        input_ids = torch.tensor(prompts)
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        common = {"image_mean": list(processing.mean), "image_std": list(processing.std)}
        if processing.square is not None:  # Gemma 3's: the square, the image tokens typed (they attend both ways)
            features = Gemma3ImageProcessorPil(size={"height": processing.square, "width": processing.square},
                                               **common)(images=images, return_tensors="pt")
            inputs.update(pixel_values=features["pixel_values"].to(dtype),
                          token_type_ids=(input_ids == model.config.image_token_id).long())
        elif processing.longest_edge is not None:  # Mistral 3's: Pixtral's processor, sides of a merged token
            features = PixtralImageProcessorPil(size={"longest_edge": processing.longest_edge}, **common)(
                images=images, return_tensors="pt", patch_size=processing.factor)
            inputs.update(pixel_values=features["pixel_values"].to(dtype), image_sizes=features["image_sizes"])
        else:
            features = Qwen2VLImageProcessorPil(
                patch_size=processing.patch_size, temporal_patch_size=processing.temporal_patch_size,
                merge_size=processing.merge_size, min_pixels=processing.min_pixels,
                max_pixels=processing.max_pixels, **common)(images=images, return_tensors="pt")
            inputs.update(mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
                          pixel_values=features["pixel_values"].to(dtype), image_grid_thw=features["image_grid_thw"])
        hf = cls(model, {key: value.to(device) for key, value in inputs.items()})
        hf.first_tokens()  # the first call's one-off costs
        return hf

    @torch.inference_mode()
    def first_tokens(self) -> list[int]:
        logits = self.model(**self.inputs, logits_to_keep=1).logits
        return logits[:, -1].argmax(-1).tolist()


def _row(engine: str, seconds: float, images: int, work: ImageWork, peak: float) -> dict:
    gflop_s = images * (work.tower_flops + work.lm_flops) / seconds / 1e9
    return {"engine": engine, "seconds": seconds, "images_s": images / seconds, "gflop_s": gflop_s,
            "roofline_fraction": gflop_s / peak}


def vision_table(report: dict) -> list[str]:
    lines = ["| engine | images/s | s an image | GFLOP/s (matmuls) | of matmul peak | first tokens as ridge's |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['engine']} | {r['images_s']:.2f} | {1 / r['images_s']:.2f} | {r['gflop_s']:.0f} | "
              f"{r['roofline_fraction']:.0%} | {_agreement(r, report['num_images'])} |" for r in report["rows"]]
    return lines


def _agreement(row: dict, images: int) -> str:
    agree = row.get("first_tokens_agree_with_ridge")
    return "-" if agree is None else f"{agree} of {images}"


def add_vision_parser(bsub, add_engine_args) -> None:
    p = bsub.add_parser("vision", help="prompts with an image each, prefilled beside HF transformers",
                        description=__doc__.split("\n\n", 1)[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--num-images", type=int, default=4, help="prompts, an image each (default %(default)s)")
    p.add_argument("--image-size", type=int, default=448, help="pixels a side (default %(default)s: 256 tokens)")
    p.add_argument("--text-len", type=int, default=32, help="text tokens after the image (default %(default)s)")
    p.add_argument("--lm-layers", type=int, default=None, help="a random model's language-model layers (default "
                   f"{DEFAULT_LM_LAYERS}; its tower is whole)")
    p.add_argument("--gguf", action="store_true",
                   help="also run the model from llama.cpp's files (its language model a GGUF, its tower an mmproj, "
                   "written float16 as llama.cpp's converter writes them): ridge with --mmproj, and llama.cpp's mtmd "
                   "where its peer is installed (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3, Mistral 3)")
    add_rounds_args(p)
    p.set_defaults(func=cmd_vision)
