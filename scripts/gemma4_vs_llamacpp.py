"""Gemma 4 by hand against llama.cpp (docs/notes/gemma4.md): a random Gemma 4 drawn by HF transformers (its norms,
layer scalars and router scales away from 1, so that a tensor in another's place shows) written as an HF directory
and as ridge's gemma4 GGUF of it, then llama.cpp's logits over a prompt against ridge's (and ridge's against HF's):

    .venv/bin/python scripts/gemma4_vs_llamacpp.py write dense --out /tmp/g4 --tokens 100
    $PEERS/llamacpp/bin/python scripts/gemma4_vs_llamacpp.py compare --out /tmp/g4

`compare` runs in llama-cpp-python's environment (../shared/peers/install.sh llamacpp), with a float32 KV cache.
Kinds: dense (31B-like: keys as values, one global KV head), ple (per-layer embeddings), shared (and 3 KV-shared
layers), moe (26B-A4B-like: 8 experts, top 2, beside the dense MLP). `--ones NAME,...` sets the parameters whose
names end so to 1 (per_expert_scale, say).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

BASE = dict(vocab_size=49152, vocab_size_per_layer_input=49152, hidden_size=256, intermediate_size=512,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128, sliding_window=32,
            max_position_embeddings=4096, initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            hidden_size_per_layer_input=0, final_logit_softcapping=30.0, num_hidden_layers=6)
ALTERNATING = ["sliding_attention", "sliding_attention", "full_attention"] * 2
KINDS = {
    "dense": dict(layer_types=["sliding_attention"] * 5 + ["full_attention"], num_global_key_value_heads=1,
                  attention_k_eq_v=True),
    "ple": dict(layer_types=ALTERNATING, hidden_size_per_layer_input=32),
    # (HF runs KV-shared layers only beside per-layer embeddings, as Google's E models have them)
    "shared": dict(layer_types=ALTERNATING, hidden_size_per_layer_input=32, num_kv_shared_layers=3),
    "moe": dict(layer_types=["sliding_attention"] * 5 + ["full_attention"], num_global_key_value_heads=1,
                attention_k_eq_v=True, enable_moe_block=True, num_experts=8, top_k_experts=2,
                moe_intermediate_size=128),
}


def write(kind: str, out: Path, tokens: int, ones: list[str]) -> None:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    from ridge import LLM
    from ridge.bench.random_gguf import write_gguf

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Gemma4TextConfig(**{**BASE, **KINDS[kind]}), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                param.uniform_(0.6, 1.4)
            if name.endswith(tuple(ones)):
                param.fill_(1.0)
        for name, buffer in hf.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    Tokenizer(models.WordLevel({f"<{i}>": i for i in range(BASE["vocab_size"])}, unk_token="<0>")).save(
        str(out / "tokenizer.json"))  # never used: the prompt is token ids
    llm = LLM(str(out), dtype="float32")
    vocabulary = Path.home() / ".cache/ridge/models/SmolLM2-135M-Instruct.Q4_1.gguf"  # 49,152 tokens (make models)
    write_gguf(llm.engine.loaded, out / "model.gguf", vocabulary, float16=False)
    rng = random.Random(3)
    ids = [rng.randrange(100, 49000) for _ in range(tokens)]
    ours = llm.engine.prompt_logits(ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    print(f"ridge vs HF: max |diff| {float((ours - ref).abs().max()):.3g} of {float(ref.abs().max()):.3g}")
    torch.save({"ids": ids, "logits": ours}, out / "ridge.pt")


def compare(out: Path) -> None:
    import llama_cpp
    import numpy as np
    import torch

    saved = torch.load(out / "ridge.pt")
    ids, ours = saved["ids"], saved["logits"].numpy()
    llm = llama_cpp.Llama(model_path=str(out / "model.gguf"), n_ctx=512, n_threads=2, logits_all=True, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)])
    print(f"llama.cpp vs ridge: max |diff| {np.abs(theirs - ours).max():.3g} of {np.abs(ours).max():.3g}; argmax "
          f"equal {(theirs.argmax(-1) == ours.argmax(-1)).mean():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    writing = sub.add_parser("write", help="the model, its GGUF and ridge's logits (ridge's environment)")
    writing.add_argument("kind", choices=KINDS)
    writing.add_argument("--tokens", type=int, default=100, help="the prompt's length (the window is 32)")
    writing.add_argument("--ones", default="", help="parameter name endings set to 1, comma-separated")
    comparing = sub.add_parser("compare", help="llama.cpp's logits against ridge's (llama-cpp-python's environment)")
    for command in (writing, comparing):
        command.add_argument("--out", type=Path, default=Path("/tmp/gemma4-vs-llamacpp"))
    args = parser.parse_args()
    if args.command == "write":
        write(args.kind, args.out, args.tokens, [name for name in args.ones.split(",") if name])
    else:
        compare(args.out)


if __name__ == "__main__":
    main()
