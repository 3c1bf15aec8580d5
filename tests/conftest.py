"""Shared fixtures: real models (pulled on first use), their HF references, and the KV-leak check.

Every engine goes through `make_llm` (fixtures that share one across tests) or `make_llm_for_test` (an
engine one test builds, freed when it ends: 24 GiB do not hold every engine of the session); after each
test, the block accounting of every live engine is checked, so a leak fails the test that caused it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

# Without a GPU, ridge's Triton kernels (the CUDA path) run under Triton's interpreter, on CPU tensors: set
# before any kernel is decorated, which reads it then.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ridge import LLM, SamplingParams, hub
from ridge.kernels import cpu_ops

_ENGINES: list[LLM] = []

# the tests' one-off HTTP calls: httpx.get / post build a client per call, and with it a TLS context (loading CA
# certificates, for plain http too) that the loops polling a starting server paid at every poll; no connection is
# kept alive between calls, as with a client per call (a server may have been restarted since)
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Give me a tip for learning to cook.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle.",
    "What is 12 times 12?",
    "Describe a rainy day in one sentence.",
]


# every test that runs a real model reaches one of these
MODEL_FIXTURES = {"smollm2_path", "qwen_path", "gemma3_path", "alias_path"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `unit` every test that reaches no model fixture, by name or as a parameter naming one: `make
    test-fast` runs those (less the `slow` ones) alone. _unit_tests_load_no_model holds them to it."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {}).values()
        wanted = set(getattr(item, "fixturenames", ())) | {p for p in params if isinstance(p, str)}
        if not MODEL_FIXTURES & wanted:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def _unit_tests_load_no_model(request, monkeypatch) -> None:
    """A `unit` test that asks for a pulled model by its alias fails here, not in a fast run without models."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(alias: str) -> Path:
        raise AssertionError(f"a unit test reached the model {alias!r}: take it from a model path "
                             "fixture, so that the test is not counted as unit")

    monkeypatch.setattr(hub, "alias_path", refuse)


@pytest.fixture(scope="session")
def ops():
    """ridge's C++ CPU kernels, which every test machine must be able to build."""
    module = cpu_ops.load()
    assert module is not None, "the C++ kernels failed to build (is a C++ compiler installed?)"
    return module


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return hub.pull("smollm2", progress=False)


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return hub.pull("qwen2.5-coder-0.5b", progress=False)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return hub.pull("gemma3-270m", progress=False)


@pytest.fixture
def alias_path(request) -> Path:
    """The model of the alias the test is parametrized with (indirect=True)."""
    return hub.pull(request.param, progress=False)


@pytest.fixture(scope="session")
def make_llm() -> Callable[..., LLM]:
    def make(model: str | Path, **engine_args) -> LLM:
        engine_args.setdefault("kv_cache_memory", "256MiB")  # many engines live in one test session
        engine_args.setdefault("debug_kv_checks", True)
        llm = LLM(str(model), progress=False, **engine_args)
        _ENGINES.append(llm)
        return llm

    return make


def module_engine(make_llm: Callable[..., LLM], model: str | Path, **engine_args) -> Iterator[LLM]:
    """An engine for one module's tests (a module fixture yields from this): its accounting checked and the engine
    dropped from the session's when they are done, not held to the session's end as make_llm's are."""
    llm = make_llm(model, **engine_args)
    yield llm
    llm.engine.check_integrity()
    _ENGINES.remove(llm)


@pytest.fixture
def make_llm_for_test(make_llm) -> Iterator[Callable[..., LLM]]:
    """make_llm for engines only one test needs: checked and freed when it ends (every engine of the session
    held at once does not fit in 24 GiB). An engine is freed by reference counting; the collection after the
    test is for what a failure's traceback ties in cycles, over the objects made since it started only (gc.freeze:
    a full one walks every object of the session; docs/notes/test-suite.md)."""
    made: list[LLM] = []
    gc.freeze()

    def make(model: str | Path, **engine_args) -> LLM:
        made.append(make_llm(model, **engine_args))
        return made[-1]

    yield make
    for llm in made:
        llm.engine.check_integrity()
        _ENGINES.remove(llm)
    made.clear()
    gc.collect()
    gc.unfreeze()


@pytest.fixture(scope="session")
def smollm2(make_llm, smollm2_path) -> LLM:
    """SmolLM2 in float32 on the default (paged) backend: the reference-comparable engine."""
    return make_llm(smollm2_path, dtype="float32")


@pytest.fixture(scope="session")
def qwen_float32(make_llm, qwen_path) -> LLM:
    """Qwen2.5-Coder-0.5B's file dequantized to float32: the reference for HF checks and native-format ones."""
    return make_llm(qwen_path, dtype="float32")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path, tmp_path_factory):
    return hf_model_from_gguf(smollm2_path, tmp_path_factory.mktemp("hf"))


def hf_model_from_gguf(path: Path, scratch: Path):
    """HF transformers' model of a GGUF file, read by transformers' own GGUF loader from a copy of the file
    without the tokenizer's arrays (weights_only_gguf): gguf's reader parses those entry by entry, three
    times per load, which was 80 of the 110 s that loading Qwen's 151k-token vocabulary took."""
    from transformers import AutoModelForCausalLM

    copy = weights_only_gguf(path, scratch / path.name)
    return AutoModelForCausalLM.from_pretrained(copy.parent, gguf_file=copy.name, dtype=torch.float32).eval()


GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
GGUF_STRING, GGUF_ARRAY, GGUF_UINT32 = 8, 9, 4


def weights_only_gguf(src: Path, dst: Path) -> Path:
    """A byte-for-byte copy of a GGUF file (v2/v3: header, key-values, tensor infos, aligned data) less its
    tokenizer.ggml.* arrays, with `{arch}.vocab_size` added as their token count where the file lacks it
    (transformers would count the tokens). The tensor infos and data are copied as they are, so the weights are the
    file's own; the key-values are walked by the format's spec, not by ridge's reader."""
    import struct

    data = memoryview(src.read_bytes())
    pos = 24  # magic, version, tensor count, key-value count

    def take(fmt: str) -> int:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value

    def skip_string() -> bytes:
        nonlocal pos
        length = take("<Q")
        pos += length
        return bytes(data[pos - length:pos])

    def skip_value(kind: int) -> int:  # the array's length for arrays
        if kind == GGUF_STRING:
            skip_string()
        elif kind == GGUF_ARRAY:
            item, count = take("<I"), take("<Q")
            for _ in range(count):
                skip_value(item)
            return count
        else:
            take(GGUF_SCALARS[kind])
        return 0

    magic, version, tensors, pairs = struct.unpack_from("<4sIQQ", data, 0)
    assert magic == b"GGUF" and version in (2, 3), (magic, version)
    kept, keys, tokens, arch, alignment = [], set(), 0, None, 32  # the format's default alignment
    for _ in range(pairs):
        start = pos
        key = skip_string().decode()
        kind = take("<I")
        value_at = pos
        count = skip_value(kind)
        if key == "general.architecture":
            arch = bytes(data[value_at + 8:pos]).decode()
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", data, value_at)[0]
        if key.startswith("tokenizer.ggml.") and kind == GGUF_ARRAY:
            tokens = count if key == "tokenizer.ggml.tokens" else tokens
        else:
            kept.append(bytes(data[start:pos]))
            keys.add(key)
    if tokens and f"{arch}.vocab_size" not in keys:
        key = f"{arch}.vocab_size".encode()
        kept.append(struct.pack("<Q", len(key)) + key + struct.pack("<II", GGUF_UINT32, tokens))
    infos_start = pos
    for _ in range(tensors):
        skip_string()
        dims = take("<I")
        pos += 8 * dims + 4 + 8  # the dims, type and offset
    infos = bytes(data[infos_start:pos])
    data_start = -(-pos // alignment) * alignment
    with dst.open("wb") as out:
        out.write(struct.pack("<4sIQQ", magic, version, tensors, len(kept)))
        for pair in kept:
            out.write(pair)
        out.write(infos)
        out.write(b"\0" * (-out.tell() % alignment))
        out.write(data[data_start:])
    return dst


@pytest.fixture(autouse=True)
def _kernel_tests_on_every_core(request, monkeypatch) -> Iterator[None]:
    """`make test` runs two pytest workers of one thread each (OMP_NUM_THREADS=1, read by torch and by the engine);
    a `threaded` module (the kernels', whose work is split across threads) runs on every core all the same, so
    that the split is what it checks."""
    if request.node.get_closest_marker("threaded") is None or os.environ.get("OMP_NUM_THREADS") is None:
        yield
        return
    cores, before = os.cpu_count() or 1, torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores))  # engines made in the test take it too
    torch.set_num_threads(cores)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_leaked_blocks() -> Iterator[None]:
    yield
    for llm in _ENGINES:
        llm.engine.check_integrity()


@pytest.fixture(autouse=True)
def _server_idle_and_whole(request):
    """After each test of a module with a `server` fixture, its engine drains and its KV accounting holds
    (every block free)."""
    yield
    if "server" not in request.fixturenames:
        return
    srv = request.getfixturevalue("server")
    if srv.engine.error is not None:
        return
    deadline = time.monotonic() + 30
    while srv.engine.num_unfinished or not (state := srv.engine.state()).idle:
        assert time.monotonic() < deadline, "the server did not drain"
        time.sleep(0.02)
    assert state.integrity_error is None, state.integrity_error
    assert state.num_free_blocks == state.num_blocks


# Granite's scalars on the embeddings, the residual branches, the attention scores and the logits, for the random
# Granite configs (binary fractions: a GGUF header's float32 holds them exactly)
GRANITE_SCALARS = dict(embedding_multiplier=6.0, residual_multiplier=0.375, attention_multiplier=0.1875,
                       logits_scaling=2.0)


def hf_greedy_disagreements(model, prompt_ids: list[int], tokens: list[int]) -> list[str]:
    """Where ridge's greedy continuation `tokens` is not HF transformers' greedy choice, judged in one forward
    pass over the prompt and `tokens` (teacher forcing: a generate() call costs a step per token). A token counts
    as HF's choice when its logit is within float32 noise (1e-4 of the row's scale) of the row's maximum: two
    logits that close are a tie that the order of a sum decides, in HF itself between its cached and whole-prompt
    passes. Empty exactly when HF's greedy decoding could have produced `tokens`, stop token included."""
    ids = torch.tensor([prompt_ids + tokens[:-1]], device=next(model.parameters()).device)
    with torch.inference_mode():
        logits = model(ids, logits_to_keep=len(tokens)).logits[0].float().cpu()
    best = logits.max(-1)
    tolerance = 1e-4 * logits.abs().amax(-1).clamp(min=1.0)
    chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    return [f"token {i}: ridge {tokens[i]} ({chosen[i]:.5f}), HF {int(best.indices[i])} ({best.values[i]:.5f})"
            for i in torch.nonzero(chosen < best.values - tolerance).flatten().tolist()]


def assert_logits_match_hf(make_llm_for_test, path, hf, vocab: int, **engine_args) -> None:
    """A random-config model's float32 logits on 3 prompts of 5-80 tokens equal HF's within float32 noise."""
    llm = make_llm_for_test(path, dtype="float32", **engine_args)
    for ids in random_prompts(3, vocab, 5, 80, seed=1):
        ours = llm.engine.prompt_logits(ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max().item() < 1e-4 * max(ref.abs().max().item(), 1.0)


def assert_stack_equals_eager(make_llm_for_test, path, prompts: list[list[int]], params: SamplingParams,
                              serves_every_decode: bool = True, **engine_args):
    """Decode steps in the fused C++ stack give the Python path's (enforce_eager) tokens and log-probabilities to
    the last bit; the stack served every step after the prompts' (serves_every_decode), or some. Returns the stacked
    engine's LLM, for checks of its state."""
    stacked = make_llm_for_test(path, **engine_args)
    eager = make_llm_for_test(path, enforce_eager=True, **engine_args)
    stack = stacked.engine.runner.decode_stack
    assert stack is not None and eager.engine.runner.decode_stack is None
    served = []
    forward = stack.native.forward
    stack.native = type("Counted", (), {"forward": lambda _, *args: served.append(1) or forward(*args)})()
    for a, b in zip(stacked.generate(prompts, params), eager.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert len(served) >= (params.max_tokens - 1 if serves_every_decode else 1), len(served)
    return stacked


def greedy_batch_checked_against_hf(make_llm_for_test, path, hf, vocab: int):
    """A random-config model's 48 greedy tokens for a batch of 16 prompts of mixed lengths (one of 90-100 tokens:
    3 chunks of the 32-token budget), the first 5 checked against HF's choices and the first 2 run alone too:
    (the engine, the prompts, the sampling params, the batch's tokens) for the runtime checks that follow."""
    prompts = random_prompts(16, vocab, 4, 60, seed=2)
    prompts[0] = random_prompts(1, vocab, 90, 100, seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm = make_llm_for_test(path, dtype="float32", max_num_batched_tokens=32)
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for ids, tokens in zip(prompts[:5], batch, strict=False):
        assert not hf_greedy_disagreements(hf, ids, tokens)
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts[:2]]
    assert alone == batch[:2]
    return llm, prompts, params, batch


def layerwise_walk(model, windows: list[list[int]], carry_quantized: bool):
    """quantize_layerwise over `windows` with int4 RTN in groups of 32, checked to leave the model holding the
    quantized weights: (the X^T X the walk gave each linear, one pass's of the float model, one pass's of the
    quantized model)."""
    from ridge.quant.rtn import dequantize, quantize_int4
    from ridge.quantize.calibration import input_hessians, quantize_layerwise

    float_hessians = input_hessians(model, windows, torch.float32, "cpu", progress=False)
    seen: dict[str, torch.Tensor] = {}

    def rtn(key: str, weight: torch.Tensor, hessian: torch.Tensor):
        seen[key] = hessian
        return quantize_int4(weight, 32)

    fitted = quantize_layerwise(model, windows, rtn, torch.float32, "cpu", progress=False,
                                carry_quantized=carry_quantized)
    assert set(fitted) == set(seen) == {key for key in float_hessians if key.startswith("layers.")}
    for key, qw in fitted.items():
        assert torch.equal(model.get_submodule(key).weight, dequantize(qw))
    return seen, float_hessians, input_hessians(model, windows, torch.float32, "cpu", progress=False)


def assert_awq_folding_keeps_the_model(llm, windows: list[list[int]], prompt: list[int]) -> None:
    """AWQ's scales searched on each layer over `windows` (in the walk's order, in full precision) and folded into
    the norms and rows before the linears leave the float model's logits on `prompt` as they were; some layer's
    input norm changed (the scales are not all ones)."""
    from ridge.quantize.awq_layers import scale_layer
    from ridge.quantize.calibration import first_layer_inputs

    before = llm.engine.prompt_logits(prompt)
    model = llm.engine.loaded.model
    backend, inputs = first_layer_inputs(model, windows, torch.float32, "cpu")
    norms_before = [layer.input_norm.weight.clone() for layer in model.layers]
    with torch.inference_mode():
        for i, layer in enumerate(model.layers):
            scale_layer(layer, inputs, backend, 32, integer_zeros=False)
            for w in inputs:
                w.x, w.residual = w.through(layer, i, backend)
    assert any(not torch.equal(layer.input_norm.weight, norm)
               for layer, norm in zip(model.layers, norms_before, strict=True))
    torch.testing.assert_close(llm.engine.prompt_logits(prompt), before, rtol=1e-4, atol=1e-4)


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def declare_pooling(folder: Path, mode: str, width: int = 64) -> None:
    """Make an HF model folder a sentence-transformers one whose Pooling module sets `mode` (its config's flag,
    e.g. "pooling_mode_mean_tokens")."""
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": width, mode: True}))


@contextlib.contextmanager
def running_server(config, server_config, **kwargs):
    """A ridge server in a thread of this process, stopped when the block ends."""
    from ridge.serve.server import free_port, make_server, start_in_thread

    srv = make_server(config, server_config, port=free_port(), log_level="warning", progress=False, **kwargs)
    thread = start_in_thread(srv)
    try:
        yield srv
    finally:
        srv.uvicorn.should_exit = True
        thread.join(timeout=30)


def assert_family_matches_hf(make_llm_for_test, path, hf, vocab: int, longest: int = 60,
                             dtypes: tuple[str, ...] = ("float32", "bfloat16"), logits: bool = True) -> None:
    """A random-config model of a family: HF's float32 logits (unless `logits` is false: a caller that checks them
    its own way) and greedy tokens of a batch, and the fused decode step equal to the Python path in each of
    `dtypes` (prompts of up to `longest` tokens)."""
    if logits:
        assert_logits_match_hf(make_llm_for_test, path, hf, vocab)
    greedy_batch_checked_against_hf(make_llm_for_test, path, hf, vocab)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    for dtype in dtypes:
        assert_stack_equals_eager(make_llm_for_test, path, random_prompts(4, vocab, 5, longest, seed=4), params,
                                  dtype=dtype)


def assert_same_logits(from_file, drawn, tokens: int = 70) -> None:
    """Two engines of one model (a GGUF written from it, the weights ridge draws) give the same prompt logits."""
    ids = random_prompts(1, 49152, tokens, tokens + 1, seed=5)[0]
    assert torch.allclose(from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids), atol=1e-5)


def blocks_moved_between_engines(make_llm_for_test, path, vocab: int):
    """A prompt of 50-60 tokens prefilled and decoded by one engine, its blocks exported and imported into a second,
    which decodes it from them to the first's tokens: (the first engine, the prompt, the exported blocks, the
    import's count of blocks taken)."""
    from ridge.engine.kv_transfer import export_prefix, import_prefix

    common = {"dtype": "float32", "kv_cache_memory": "4MiB"}
    prefill, decode = make_llm_for_test(path, **common), make_llm_for_test(path, **common)
    (prompt,) = random_prompts(1, vocab, 50, 60, seed=21)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (expected,) = prefill.generate(prompt, params)
    blocks = export_prefix(prefill.engine, prompt, None)
    taken = import_prefix(decode.engine, blocks)
    (out,) = decode.generate(prompt, params)
    assert out.num_cached_tokens > 0 and out.outputs[0].token_ids == expected.outputs[0].token_ids
    return prefill, prompt, blocks, taken


def gguf_round_trip(config: dict, folder: Path, vocabulary: Path, make_llm_for_test):
    """A random model of HF `config` (its vocabulary that of the GGUF `vocabulary`) written under llama.cpp's names
    and header (bench/random_gguf.py, float32) into `folder`: (the engine on the file, the engine on the weights
    ridge draws for the config), to be compared."""
    import json

    from ridge.bench.random_gguf import write_random_gguf
    from ridge.models.random_weights import random_spec

    (folder / "config.json").write_text(json.dumps(config))
    spec = random_spec(f"random:{folder}")
    path = write_random_gguf(spec, folder / "model.gguf", vocabulary, seed=0, float16=False)
    return (make_llm_for_test(path, dtype="float32", kv_cache_memory="16MiB"),
            make_llm_for_test(f"random:{folder}", dtype="float32", kv_cache_memory="16MiB"))


def linears_of_one_decode(engine, prompt: list[int]) -> set[torch.nn.Module]:
    """The linear layers one batch-1 decode step of `prompt` runs (forward hooks over the Python path's modules),
    the request then run to its end: what a test of a mixture's decode reads counts."""
    from ridge import SamplingParams

    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4))
    engine.step()  # the prefill
    touched: set[torch.nn.Module] = set()
    hooks = [m.register_forward_hook(lambda module, *_: touched.add(module))
             for m in engine.loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        engine.step()  # one decode step
    finally:
        for hook in hooks:
            hook.remove()
    while engine.has_unfinished:
        engine.step()
    return touched
