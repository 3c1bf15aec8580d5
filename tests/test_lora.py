"""LoRA adapters (lora/): PEFT's own adapters over random Qwen2, Gemma 4 and Qwen2-MoE models, checked against PEFT's
model in HF transformers (logits and greedy tokens, float32; the real SmolLM2 file's check is in
tests/test_real_models.py); a batch that mixes adapters against each prompt alone; max_loras, the prefix cache's
separation, quantized weights, tensor parallelism, refusals by name, and the server's `model` field and runtime
loading."""

import asyncio
import copy
import json

import httpx
import pytest
import torch

from conftest import random_prompts, running_server
from ridge import LoRARequest, SamplingParams
from ridge.config import EngineConfig
from ridge.engine.outputs import OutputKind
from ridge.serve.gateway import ServerConfig, guard
from ridge.serve.protocol import RequestError
from test_models_random import VOCAB, byte_tokenizer, hf_config

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(base, folder, seed: int, **lora_args):
    """PEFT's adapter over a copy of `base`, drawn (not PEFT's zero B), saved to `folder`: (folder, PEFT's model)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **lora_args)).eval()
    model.save_pretrained(folder)
    return folder, model


def hf_greedy(model, ids: list[int], tokens: int = 12) -> list[int]:
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def qwen2_adapters(tmp_path_factory):
    """A random Qwen2 (biased q / k / v) and two adapters: every projection at rank 8 with a per-module alpha, and
    q / v alone at rank 4 with rsLoRA's scaling."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(hf_config("qwen2", False), dtype=torch.float32).eval()
    for layer in base.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)
    root = tmp_path_factory.mktemp("lora")
    base.save_pretrained(root / "base")
    byte_tokenizer().save(str(root / "base" / "tokenizer.json"))
    every = peft_adapter(base, root / "every", 1, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS,
                         alpha_pattern={"down_proj": 4})
    qv = peft_adapter(base, root / "qv", 2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True)
    return root / "base", base, {"every": every, "qv": qv}


def test_logits_and_tokens_match_peft(qwen2_adapters, make_llm_for_test):
    path, base, adapters = qwen2_adapters
    llm = make_llm_for_test(path, dtype="float32", enable_lora=True, max_num_batched_tokens=16)
    for i, (name, (folder, peft)) in enumerate(adapters.items()):
        request = LoRARequest(name, i + 1, str(folder))
        for ids in random_prompts(2, VOCAB, 5, 50, seed=i):
            ours = llm.engine.prompt_logits(ids, request)
            with torch.inference_mode():
                ref = peft(input_ids=torch.tensor([ids])).logits[0]
                plain = base(torch.tensor([ids])).logits[0]
            assert (ref - plain).abs().max() > 1e-2, "the adapter changes nothing: the check would be empty"
            assert (ours - ref).abs().max().item() < 1e-4 * max(ref.abs().max().item(), 1.0)
            # chunked prefill (16-token chunks) and decode steps
            out = llm.generate([ids], GREEDY, lora_request=request)[0].outputs[0].token_ids
            assert out == hf_greedy(peft, ids)


def test_a_batch_mixing_adapters_gives_each_prompt_its_own_tokens(qwen2_adapters, make_llm_for_test):
    path, base, adapters = qwen2_adapters
    requests = [LoRARequest(name, i + 1, str(folder)) for i, (name, (folder, _)) in enumerate(adapters.items())]
    prompts = random_prompts(6, VOCAB, 5, 40, seed=7)
    chosen = [requests[0], None, requests[1], requests[0], requests[1], None]
    references = [hf_greedy(base if r is None else adapters[r.lora_name][1], ids)
                  for ids, r in zip(prompts, chosen, strict=True)]
    llm = make_llm_for_test(path, dtype="float32", enable_lora=True)
    outs = llm.generate(prompts, GREEDY, lora_request=chosen)
    assert [o.outputs[0].token_ids for o in outs] == references
    # one adapter at a time: the scheduler passes over the other adapter's prompts until the first's are done
    one = make_llm_for_test(path, dtype="float32", lora_modules=(f"every={adapters['every'][0]}",
                                                                 f"qv={adapters['qv'][0]}"), max_loras=1)
    engine = one.engine
    ids = [engine.add_request(p, GREEDY, lora_request=r) for p, r in zip(prompts, chosen, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    mixed = 0
    while engine.has_unfinished:
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.samples[0].token_ids)
        running = {s.adapter for s in engine.scheduler.running if s.adapter is not None}
        assert len(running) <= 1, f"{running}: more adapters running than max_loras=1"
        mixed += bool(running) and any(s.adapter is None for s in engine.scheduler.running)
    assert [tokens[i] for i in ids] == references
    assert mixed, "no step ran an adapter beside the base model: max_loras would count the base"


def test_prefix_cache_keeps_adapters_apart(qwen2_adapters, make_llm_for_test):
    path, base, adapters = qwen2_adapters
    llm = make_llm_for_test(path, dtype="float32", enable_lora=True)
    every = LoRARequest("every", 1, str(adapters["every"][0]))
    prompt = random_prompts(1, VOCAB, 70, 71, seed=3)[0]
    first = llm.generate([prompt], GREEDY)[0]
    adapted = llm.generate([prompt], GREEDY, lora_request=every)[0]
    again = llm.generate([prompt], GREEDY, lora_request=every)[0]
    assert adapted.num_cached_tokens == 0, "the adapter's request read the base model's cached KV"
    assert again.num_cached_tokens == 64, "the adapter's own prefix was not cached"
    assert adapted.outputs[0].token_ids == again.outputs[0].token_ids == hf_greedy(adapters["every"][1], prompt)
    assert first.outputs[0].token_ids == hf_greedy(base, prompt)


def _edited(folder, target, **settings):
    """A copy of an adapter's directory with its adapter_config.json's settings changed."""
    import shutil

    shutil.copytree(folder, target)
    config = json.loads((target / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**config, **settings}))
    return target


def test_bad_adapters_are_refused_by_name_and_the_engine_serves_on(qwen2_adapters, make_llm_for_test, tmp_path):
    path, base, adapters = qwen2_adapters
    every = adapters["every"][0]
    llm = make_llm_for_test(path, dtype="float32", enable_lora=True, max_lora_rank=4)
    cases = [
        (LoRARequest("none", 1, str(tmp_path / "missing")), "lora_path"),
        (LoRARequest("big", 2, str(every)), "max_lora_rank"),  # rank 8 over max_lora_rank 4
        (LoRARequest("dora", 3, str(_edited(adapters["qv"][0], tmp_path / "dora", use_dora=True))), "use_dora"),
        (LoRARequest("saved", 4, str(_edited(adapters["qv"][0], tmp_path / "saved", modules_to_save=["lm_head"]))),
         "modules_to_save"),
    ]
    for request, field in cases:
        with pytest.raises(ValueError, match=field):
            llm.generate([[5, 6, 7]], GREEDY, lora_request=request)
    qv = LoRARequest("qv", 5, str(adapters["qv"][0]))
    with pytest.raises(ValueError, match="lora_name"):  # a loaded name, another directory
        llm.generate([[5, 6, 7], [5, 6, 7]], GREEDY, lora_request=[qv, LoRARequest("qv", 6, str(every))])
    assert llm.generate([[5, 6, 7, 8]], GREEDY, lora_request=qv)[0].outputs[0].token_ids == \
        hf_greedy(adapters["qv"][1], [5, 6, 7, 8])
    with pytest.raises(ValueError, match="enable_lora"):
        make_llm_for_test(path, dtype="float32").generate([[5, 6]], GREEDY, lora_request=qv)
    with pytest.raises(ValueError, match="lora_modules"):
        EngineConfig(model=str(path), lora_modules=("qv",))
    for unsafe in ({"quantization": "awq"}, {"batch_invariant": True}):  # each would change what an adapter sees
        with pytest.raises(ValueError, match="enable_lora"):
            EngineConfig(model=str(path), enable_lora=True, **unsafe)


def test_an_adapter_of_another_model_is_refused(qwen2_adapters, make_llm_for_test, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _, _ = qwen2_adapters
    config = hf_config("qwen2", False)
    config.intermediate_size = 80
    other = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder, _ = peft_adapter(other, tmp_path / "other", 5, r=4, lora_alpha=4, target_modules=["up_proj"])
    llm = make_llm_for_test(path, dtype="float32", enable_lora=True)
    with pytest.raises(ValueError, match="another model"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("other", 1, str(folder)))
    head, _ = peft_adapter(other, tmp_path / "head", 6, r=4, lora_alpha=4, target_modules=["lm_head"])
    with pytest.raises(ValueError, match="vocabulary projection"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("head", 2, str(head)))


def test_an_adapter_over_quantized_weights_moves_the_logits_as_peft_s(qwen2_adapters, make_llm_for_test):
    """The products are added to whatever kernel made the base output: over int4 weights, the logits land near
    PEFT's float model with the adapter, far from the base model's."""
    path, base, adapters = qwen2_adapters
    folder, peft = adapters["every"]
    llm = make_llm_for_test(path, dtype="float32", quantization="int4", enable_lora=True)
    ids = random_prompts(1, VOCAB, 40, 41, seed=11)[0]
    ours = llm.engine.prompt_logits(ids, LoRARequest("every", 1, str(folder)))
    with torch.inference_mode():
        adapted, plain = peft(input_ids=torch.tensor([ids])).logits[0], base(torch.tensor([ids])).logits[0]
    assert (ours - adapted).norm() < 0.5 * (ours - plain).norm()


def test_gemma4_s_kv_shared_layers_take_an_adapter_as_peft_does(tmp_path_factory, make_llm_for_test):
    """Gemma 4's E models: the KV-shared layers run only the rows whose logits are read (the adapters' rows kept
    with them), and their k / v factors change nothing, in HF's model as in ridge's."""
    from test_gemma4 import EDGE, random_hf_model

    path, base = random_hf_model("edge-lora", EDGE, tmp_path_factory)
    folder, peft = peft_adapter(base, path.parent / "edge-adapter", 3, r=8, lora_alpha=16,
                                target_modules=ALL_PROJECTIONS)
    llm = make_llm_for_test(path, dtype="float32", enable_lora=True, max_num_batched_tokens=32)
    request = LoRARequest("edge", 1, str(folder))
    prompts = random_prompts(4, VOCAB, 20, 60, seed=5)
    ours = llm.engine.prompt_logits(prompts[0], request)
    with torch.inference_mode():
        ref = peft(input_ids=torch.tensor([prompts[0]])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4 * max(ref.abs().max().item(), 1.0)
    chosen = [request, None, request, None]
    outs = llm.generate(prompts, GREEDY, lora_request=chosen)
    for ids, adapter, out in zip(prompts, chosen, outs, strict=True):
        reference = peft if adapter is not None else base
        assert out.outputs[0].token_ids == hf_greedy(reference, ids), "a mixed batch's prompt parted from HF's"


def test_the_server_serves_adapters_by_model_name_and_loads_them_at_run_time(qwen2_adapters, tmp_path):
    """A request's `model` picks an adapter of --lora-modules (its reply says so), /v1/models lists it with the base
    model as parent, another name gets a 404 listing those served; vLLM's /v1/load_lora_adapter and
    /v1/unload_lora_adapter, on a server that allows them: a bad adapter gets a 400 naming what does not fit, an
    unloaded one 404s."""
    path, base, adapters = qwen2_adapters
    config = EngineConfig(model=str(path), dtype="float32", kv_cache_memory="64MiB",
                          lora_modules=(f"every={adapters['every'][0]}",))
    prompt = random_prompts(1, VOCAB, 20, 21, seed=9)[0]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with running_server(config, ServerConfig("base", allow_runtime_lora_updating=True)) as srv:
        def post(route, json):
            return httpx.post(srv.url + route, json=json, timeout=60)

        listed = httpx.get(srv.url + "/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [("base", None), ("every", "base")]
        for model, reference in (("every", adapters["every"][1]), ("base", base)):
            reply = post("/v1/completions", {**body, "model": model}).json()
            assert reply["model"] == model
            assert reply["choices"][0]["token_ids"] == hf_greedy(reference, prompt)
        missing = post("/v1/completions", {**body, "model": "qv"})
        assert missing.status_code == 404 and "`every`" in missing.json()["error"]["message"]
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'ridge:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
        loaded = post("/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(adapters["qv"][0])})
        assert loaded.status_code == 200, loaded.text
        reply = post("/v1/completions", {**body, "model": "qv"}).json()
        assert reply["choices"][0]["token_ids"] == hf_greedy(adapters["qv"][1], prompt)
        assert "qv" in [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
        again = post("/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(adapters["qv"][0])})
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
        bad = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "nowhere")})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        gateway = srv.uvicorn.config.app.state.gateway
        resolved = gateway.adapter_for("qv")  # a request that named qv before the unload, and reaches the engine after
        assert post("/v1/unload_lora_adapter", {"lora_name": "qv"}).status_code == 200
        assert post("/v1/completions", {**body, "model": "qv"}).status_code == 404
        assert post("/v1/unload_lora_adapter", {"lora_name": "qv"}).status_code == 404
        with pytest.raises(RequestError) as late:  # not loaded again behind the unload's back
            asyncio.run(gateway.collect([prompt], SamplingParams(max_tokens=2), "late", adapter=resolved))
        assert late.value.status == 404 and "unloaded" in late.value.message

        async def late_stream() -> list:  # a stream's: an error event (its status has gone out), not a crash
            return [item async for item in guard(gateway.run([prompt], SamplingParams(max_tokens=2), "late-stream",
                                                             kind=OutputKind.DELTA, adapter=resolved))]

        ((_, error),) = asyncio.run(late_stream())
        assert isinstance(error, RequestError) and error.status == 404
        assert post("/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(adapters["qv"][0])}).is_success
        assert gateway.adapters["qv"].lora_int_id > resolved.lora_int_id  # the engine tells them apart
        reply = post("/v1/completions", {**body, "model": "qv"}).json()
        assert reply["choices"][0]["token_ids"] == hf_greedy(adapters["qv"][1], prompt)
        assert srv.engine.state().idle
    plain = EngineConfig(model=str(path), dtype="float32", kv_cache_memory="64MiB")
    with pytest.raises(ValueError, match="allow_runtime_lora_updating"), running_server(
            plain, ServerConfig("base", allow_runtime_lora_updating=True)):
        pass


def test_an_adapter_over_a_mixture_s_attention_and_shared_expert_matches_peft(tmp_path_factory, make_llm_for_test):
    """Qwen2-MoE: attention, the shared expert and the one dense layer's MLP adapted (PEFT's names reach them all;
    the mixture then runs in Python, whose shared expert calls its hooked projections); greedy tokens against PEFT's
    with speculation on the prompt's n-grams (the drafts' rows take the adapter too)."""
    from test_moe import random_hf_model

    path, base = random_hf_model("qwen2_moe", tmp_path_factory)
    folder, peft = peft_adapter(base, path.parent / "moe-adapter", 6, r=8, lora_alpha=16,
                                target_modules=ALL_PROJECTIONS)
    llm = make_llm_for_test(path, dtype="float32", enable_lora=True, speculate="ngram")
    request = LoRARequest("moe", 1, str(folder))
    adapted = {p for p in llm.engine.adapters.adapters[llm.engine.adapters.index(request)].modules}
    assert {"layers.0.mlp.shared_expert.gate_up", "layers.1.mlp.gate_up", "layers.2.attn.qkv"} <= adapted
    prompts = [ids * 3 for ids in random_prompts(3, VOCAB, 8, 16, seed=12)]  # repeats for the n-gram drafter
    outs = llm.generate(prompts, GREEDY, lora_request=request)
    for ids, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(peft, ids)


def test_adapters_over_two_tensor_parallel_ranks_match_peft(qwen2_adapters, make_llm_for_test):
    """Each rank keeps its part of every factor (B's rows of its heads and MLP columns, A's columns of the
    row-parallel projections, whose partial products the layers' all-reduces add up); an adapter loaded after the
    start reaches every rank."""
    path, base, adapters = qwen2_adapters
    requests = [LoRARequest(name, i + 1, str(folder)) for i, (name, (folder, _)) in enumerate(adapters.items())]
    prompts = random_prompts(4, VOCAB, 5, 40, seed=13)
    chosen = [requests[0], None, requests[1], requests[0]]
    expected = [hf_greedy(base if r is None else adapters[r.lora_name][1], ids)
                for ids, r in zip(prompts, chosen, strict=True)]
    two = make_llm_for_test(path, dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2,
                            lora_modules=(f"every={adapters['every'][0]}",))
    assert [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, lora_request=chosen)] == expected
    ours = two.engine.prompt_logits(prompts[0], requests[1])
    with torch.inference_mode():
        ref = adapters["qv"][1](input_ids=torch.tensor([prompts[0]])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4 * max(ref.abs().max().item(), 1.0)
    two.engine.unload_adapter("qv")  # every rank frees it; loaded again, every rank holds it again
    assert two.generate([prompts[2]], GREEDY, lora_request=requests[1])[0].outputs[0].token_ids == expected[2]
