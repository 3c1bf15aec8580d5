"""Quantized checkpoints: the GPTQ / AWQ / fp8 layouts ridge writes, decoded here independently of ridge's
packing code (word by word, as the formats' specifications read), loaded back by ridge, and loaded by HF
transformers itself (GPTQ / AWQ through gptqmodel's CPU kernels, fp8 through its own loader)."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_awq_folding_keeps_the_model, layerwise_walk, random_prompts
from ridge.quant import checkpoint
from ridge.quant.rtn import (
    QuantizedWeight,
    cut_quantized,
    dequantize,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from ridge.quantize.export import quantize_to_dir
from test_models_random import VOCAB, byte_tokenizer, hf_config

pytestmark = pytest.mark.slow  # 34 s: calibrated quantization of random models, HF loading the checkpoints

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _nibbles(words: torch.Tensor, bits: int) -> np.ndarray:
    """uint32 words [..., W] -> codes [..., W, 32 / bits], field i = bits [bits i, bits (i + 1))."""
    w = words.numpy().view(np.uint32).astype(np.uint64)
    return np.stack([(w >> (bits * i)) & (2**bits - 1) for i in range(32 // bits)], axis=-1).astype(np.int64)


def reference_gptq(t: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    codes = _nibbles(t["qweight"], bits)  # [K / per, N, per]: code of input row (word * per + field)
    codes = codes.transpose(0, 2, 1).reshape(-1, codes.shape[1])  # [K, N]
    zeros = (_nibbles(t["qzeros"], bits).reshape(t["qzeros"].shape[0], -1) + 1) % 2**bits  # stored zero - 1
    g = t["g_idx"].long().numpy()
    scales = t["scales"].float().numpy()
    return torch.from_numpy((scales[g] * (codes - zeros[g])).T.copy()).float()  # [N, K]


def reference_awq(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    def unpack(words: torch.Tensor) -> np.ndarray:
        fields = _nibbles(words, 4)  # [R, N / 8, 8]: field i of word j is column 8 j + AWQ_ORDER[i]
        out = np.empty_like(fields)
        out[..., AWQ_ORDER] = fields
        return out.reshape(fields.shape[0], -1)

    codes, zeros = unpack(t["qweight"]), unpack(t["qzeros"])  # [K, N], [G, N]
    rows = np.arange(codes.shape[0]) // group
    return torch.from_numpy((t["scales"].float().numpy()[rows] * (codes - zeros[rows])).T.copy()).float()


@pytest.mark.parametrize("shape", [(48, 128), (40, 320), (8, 64)])
def test_gptq_layout_decodes_to_the_same_weights(shape):
    torch.manual_seed(0)
    w = torch.randn(shape)
    int4 = [(quantize_int4(w, group, integer_zeros=True), 4) for group in (32, 64)]
    for qw, bits in (*int4, (quantize_int8(w), 8)):
        tensors = checkpoint.pack_gptq(qw)
        assert tensors["qweight"].shape == (shape[1] * bits // 32, shape[0])
        assert tensors["qweight"].dtype == tensors["qzeros"].dtype == torch.int32
        torch.testing.assert_close(reference_gptq(tensors, bits), dequantize(qw), rtol=0, atol=0)
        config = checkpoint.quantization_config("gptq", bits, qw.group_size)
        back = dict(checkpoint.read_quantized(iter((f"m.{k}", v) for k, v in tensors.items()), config))["m.weight"]
        assert isinstance(back, QuantizedWeight) and torch.equal(dequantize(back), dequantize(qw))


def test_awq_and_fp8_layouts_decode_to_the_same_weights():
    torch.manual_seed(1)
    w = torch.randn(40, 192)
    qw = quantize_int4(w, 64, integer_zeros=True)
    tensors = checkpoint.pack_awq(qw)
    assert tensors["qweight"].shape == (192, 5) and tensors["scales"].dtype == torch.float16
    torch.testing.assert_close(reference_awq(tensors, 64), dequantize(qw), rtol=0, atol=0)
    back = dict(checkpoint.read_quantized(iter((f"m.{k}", v) for k, v in tensors.items()),
                                          checkpoint.quantization_config("awq", 4, 64)))["m.weight"]
    assert torch.equal(dequantize(back), dequantize(qw))
    fp8 = quantize_fp8(w)
    tensors = checkpoint.pack_fp8(fp8)
    assert tensors["weight"].dtype == torch.float8_e4m3fn
    full = tensors["weight"].float() * tensors["weight_scale_inv"].repeat_interleave(checkpoint.FP8_BLOCK_COLUMNS, 1)
    torch.testing.assert_close(full, dequantize(fp8), rtol=0, atol=0)
    assert (dequantize(fp8) - w).abs().max() <= w.abs().max() / 16  # e4m3: 3 mantissa bits


def test_act_order_groups_and_bad_checkpoints():
    """A GPTQ checkpoint whose g_idx is not column // group (act-order without static groups) has no
    kernel here: it loads as the dequantized matrix, equal to the specification's."""
    torch.manual_seed(2)
    qw = quantize_int4(torch.randn(16, 128), 32, integer_zeros=True)
    tensors = checkpoint.pack_gptq(qw)
    tensors["g_idx"] = tensors["g_idx"][torch.randperm(128)]
    back = dict(checkpoint.read_quantized(iter((f"m.{k}", v) for k, v in tensors.items()),
                                          checkpoint.quantization_config("gptq", 4, 32)))["m.weight"]
    assert isinstance(back, torch.Tensor)
    torch.testing.assert_close(back, reference_gptq(tensors, 4), rtol=0, atol=0)
    with pytest.raises(ValueError, match="quant_method"):
        list(checkpoint.read_quantized(iter([]), {"quant_method": "exl2"}))
    with pytest.raises(ValueError, match="bits"):
        list(checkpoint.read_quantized(iter([]), {"quant_method": "gptq", "bits": 3}))
    with pytest.raises(ValueError, match="not all of"):
        list(checkpoint.read_quantized(iter([("m.qweight", tensors["qweight"])]), {"quant_method": "gptq"}))


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory):
    """A tiny random llama without GQA (so AWQ also folds o_proj's scales into v), saved as HF safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = hf_config("llama", False)
    config.num_key_value_heads = config.num_attention_heads
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("llama-mha")
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path


def _dequantized_hf(out, method: str, group_size: int):
    """HF transformers' float model holding the checkpoint's weights as the specification decodes them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(out)
    del config.quantization_config
    tensors = load_file(str(out / "model.safetensors"))
    state = {}
    for name, t in tensors.items():
        module, _, part = name.rpartition(".")
        if part in ("qzeros", "scales", "g_idx", "weight_scale_inv"):
            continue
        if part == "qweight":
            parts = {p: tensors[f"{module}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")
                     if f"{module}.{p}" in tensors}
            state[f"{module}.weight"] = (reference_awq(parts, group_size) if method == "awq"
                                         else reference_gptq(parts, 4))
        elif t.dtype == torch.float8_e4m3fn:
            scales = tensors[f"{module}.weight_scale_inv"].repeat_interleave(checkpoint.FP8_BLOCK_COLUMNS, 1)
            state[name] = t.float() * scales
        else:
            state[name] = t.float()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    return model


def _hf_loads(out):
    """HF transformers loading a GPTQ / AWQ directory itself, on gptqmodel's plain torch kernels. They decode
    weights in float16 (scale x code rounded to float16, ~5e-4 relative), so its logits differ from the exact
    decode by that rounding: hence the looser tolerance against it than against the specification."""
    from transformers import AutoModelForCausalLM, AwqConfig, GPTQConfig

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    config = (GPTQConfig.from_dict({**config, "backend": "gptq_torch"}) if config["quant_method"] == "gptq"
              else AwqConfig.from_dict({**config, "backend": "torch_awq"}))
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, device_map="cpu",
                                                quantization_config=config).eval()


@pytest.mark.parametrize(("method", "fp8"), [("rtn", False), ("gptq", False), ("awq", False), ("fp8", False),
                                             ("gptq", True)], ids=["rtn", "gptq", "awq", "fp8", "gptq-fp8"])
def test_quantize_writes_a_checkpoint_ridge_loads(method, fp8, random_llama, tmp_path, make_llm_for_test):
    """`ridge quantize` -> a directory whose config and tensors follow the layouts; ridge's logits on it equal
    HF transformers' on the same weights decoded by the specification (float32 noise), and those of HF
    transformers loading the directory itself (GPTQ / AWQ: float16 noise, see _hf_loads)."""
    fp8 = fp8 or method == "fp8"
    bits, group = (8, None) if fp8 else (4, 32)
    out = tmp_path / method
    report = quantize_to_dir(random_llama, method, bits, group, out, num_windows=2, progress=False, fp8=fp8)
    assert report.layers == 3 * 7  # q, k, v, o, gate, up, down per layer
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == ("fp8" if fp8 else {"rtn": "gptq", "gptq": "gptq", "awq": "awq"}[method])
    reference = _dequantized_hf(out, method, group)
    llm = make_llm_for_test(out, dtype="float32")
    assert "safetensors " + config["quant_method"] in llm.engine.loaded.weight_format
    hf = _hf_loads(out) if not fp8 else None
    for ids in random_prompts(2, VOCAB, 5, 40, seed=3):
        with torch.inference_mode():
            ref = reference(torch.tensor([ids])).logits[0]
        ours = llm.engine.prompt_logits(ids)
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        if hf is not None:
            with torch.inference_mode():
                theirs = hf(torch.tensor([ids])).logits[0]
            # no argmax check: this random model's logits have near-ties that float16 noise may flip
            assert (ours - theirs).abs().max().item() < 5e-3 * theirs.abs().max().item()
    with pytest.raises(ValueError, match="already holds a model"):
        quantize_to_dir(random_llama, method, bits, group, out, num_windows=2, progress=False, fp8=fp8)


def test_gptq_and_awq_at_load_quantize_every_layer(random_llama, make_llm_for_test):
    """The engine's own path: calibrate at load, quantize every linear layer and the head (float minimums,
    no checkpoint). On this tiny random model int4 itself is far from the float model (~50% of the logits'
    norm); calibrated on text, GPTQ and AWQ must stay within 1.2x of RTN's error on text (a layer given
    another's statistics, or scales folded into the wrong producer, is far worse). Their gain over RTN on a
    real model is test_gptq's."""
    from ridge.linear import KernelLinear

    plain = make_llm_for_test(random_llama, dtype="float32")
    ids = plain.tokenizer.encode("The quality of mercy is not strained; it droppeth as the gentle rain from heaven")
    exact = plain.engine.prompt_logits(ids)
    errors = {}
    for method in ("int4", "gptq", "awq"):
        llm = make_llm_for_test(random_llama, dtype="float32", quantization=method, quantization_group_size=32,
                                calibration_windows=2)
        model = llm.engine.loaded.model
        assert not any(isinstance(m, torch.nn.Linear) for m in model.layers.modules())
        assert isinstance(model.output_projection, KernelLinear)
        assert llm.engine.loaded.weight_format.endswith(f"-> {method} g32")
        errors[method] = float((llm.engine.prompt_logits(ids) - exact).norm() / exact.norm())
    assert 0 < errors["gptq"] < 1.2 * errors["int4"] and 0 < errors["awq"] < 1.2 * errors["int4"], errors


def test_each_method_calibrates_on_its_own_windows_unless_told(random_llama, make_llm_for_test, monkeypatch):
    """GPTQ on 32 windows, AWQ on 64, int8 and fp8 on 8 (quantize/calibration.py's DEFAULT_WINDOWS), int4 on none,
    `calibration_windows` over each; the windows asked for are recorded, then 2 of them calibrate, to keep the
    test short. int8 on 0 windows is plain RTN: each row's scale from its largest weight."""
    import ridge.engine.loading as engine_module

    real, asked = engine_module.calibration_windows, []

    def recording(tokenizer, num_windows, window, progress=False):
        asked.append(num_windows)
        return real(tokenizer, 2, window, progress)

    monkeypatch.setattr(engine_module, "calibration_windows", recording)
    for method, windows in (("gptq", None), ("awq", None), ("awq", 3), ("int8", None), ("fp8", None), ("int4", None),
                            ("fp8", 5)):
        make_llm_for_test(random_llama, dtype="float32", quantization=method, calibration_windows=windows)
    assert asked == [32, 64, 3, 8, 8, 5]
    plain = make_llm_for_test(random_llama, dtype="float32")
    rtn = make_llm_for_test(random_llama, dtype="float32", quantization="int8", calibration_windows=0)
    assert asked == [32, 64, 3, 8, 8, 5]
    down = dequantize(quantize_int8(plain.engine.loaded.model.layers[0].mlp.down.weight))
    x = torch.randn(3, down.shape[1])
    torch.testing.assert_close(rtn.engine.loaded.model.layers[0].mlp.down(x), x @ down.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("carry_quantized", [True, False], ids=["gptq-order", "awq-order"])
def test_layerwise_calibration_sees_the_layers_before_it_as_carried(random_llama, make_llm_for_test,
                                                                     carry_quantized: bool):
    """quantize_layerwise: layer 0 sees the float model's inputs. In GPTQ's order a later layer's first
    linear (qkv) sees what the layers before it produce once quantized, the X^T X that one pass of the
    quantized model takes, and not the float model's; in AWQ's (carry_quantized=False) it sees the float
    model's. Either way the model is left holding the quantized weights."""
    from ridge.quantize.calibration import calibration_windows

    llm = make_llm_for_test(random_llama, dtype="float32")
    model = llm.engine.loaded.model
    seen, float_hessians, quantized_hessians = layerwise_walk(model, calibration_windows(llm.tokenizer, 2, 256),
                                                              carry_quantized)
    for key in (k for k in seen if k.startswith("layers.0.")):
        torch.testing.assert_close(seen[key], float_hessians[key], rtol=1e-6, atol=0)
    for i in range(1, len(model.layers)):
        key = f"layers.{i}.attn.qkv"
        expected, other = ((quantized_hessians, float_hessians) if carry_quantized
                           else (float_hessians, quantized_hessians))
        torch.testing.assert_close(seen[key], expected[key], rtol=1e-6, atol=0)
        assert not torch.allclose(seen[key], other[key], rtol=1e-3), key


def test_awq_folding_keeps_the_float_model(random_llama, make_llm_for_test):
    """Scaling columns up and folding the inverse into norms / v / up rows leaves the float function as it
    was, before any rounding; some layer's scales are not all ones."""
    from ridge.quantize.calibration import calibration_windows

    llm = make_llm_for_test(random_llama, dtype="float32")
    assert llm.engine.loaded.config.num_heads == llm.engine.loaded.config.num_kv_heads  # o_proj's scales into v too
    assert_awq_folding_keeps_the_model(llm, calibration_windows(llm.tokenizer, 2, 256),
                                       random_prompts(1, VOCAB, 30, 31, seed=4)[0])


def test_quantize_bad_arguments(random_llama, tmp_path):
    for kwargs, match in (({"method": "hqq", "bits": 4, "group_size": 32}, "method"),
                          ({"method": "awq", "bits": 8, "group_size": 32}, "bits"),
                          ({"method": "rtn", "bits": 4, "group_size": 48}, "group_size"),
                          ({"method": "rtn", "bits": 4, "group_size": 128}, "does not divide"),
                          ({"method": "awq", "bits": 8, "group_size": None, "fp8": True}, "fp8"),
                          ({"method": "gptq", "bits": 4, "group_size": 32, "fp8": True}, "bits")):
        with pytest.raises(ValueError, match=match):
            quantize_to_dir(random_llama, out=tmp_path / "x", progress=False, **kwargs)


def test_fp8_checkpoint_round_trip_through_hf(smollm2_path, tmp_path, make_llm_for_test):
    """SmolLM2 -> `ridge quantize --method fp8` -> HF transformers loads the directory itself (its fp8
    loader, which dequantizes on a CPU) and gives ridge's logits."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "fp8"
    quantize_to_dir(smollm2_path, "fp8", 8, None, out, progress=False)
    llm = make_llm_for_test(out, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf.float()  # its fp8 path keeps the checkpoint's float16 tensors as float16; widening them is exact
    ids = llm.tokenizer.encode("The quality of mercy is not strained; it droppeth as the gentle rain")
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = llm.engine.prompt_logits(ids)
    assert (ours - ref).abs().max().item() < 1e-3 * ref.abs().max().item()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("layout", ["fp8", "awq", "gptq-act-order"])
def test_a_checkpoint_over_two_ranks_equals_one_process(layout, random_llama, tmp_path, make_llm_for_test):
    """A quantized checkpoint's layers, kept as the file stores them, cut between tensor-parallel ranks: fp8's
    columns anywhere (a scale per row), GPTQ's and AWQ's on the checkpoint's groups of 32 (the plan cuts the MLP's
    96 columns 32 | 64, where an even cut would fall inside a group), and a layer no kernel here runs (the GPTQ
    checkpoint's first down_proj given act-order groups) as its dequantized matrix."""
    from safetensors.torch import save_file

    from ridge import SamplingParams

    out, method = tmp_path / layout, layout.removesuffix("-act-order")
    quantize_to_dir(random_llama, method, 8 if method == "fp8" else 4, None if method == "fp8" else 32, out,
                    progress=False)
    if layout.endswith("act-order"):
        tensors = load_file(str(out / "model.safetensors"))
        g_idx = tensors["model.layers.0.mlp.down_proj.g_idx"]
        tensors["model.layers.0.mlp.down_proj.g_idx"] = g_idx[torch.randperm(len(g_idx),
                                                                             generator=torch.Generator().manual_seed(0))]
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts(4, VOCAB, 5, 40, seed=4)
    one = make_llm_for_test(out, dtype="float32", kv_cache_memory="16MiB")
    tp = make_llm_for_test(out, dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2)
    assert "rank 0 of 2" in tp.engine.loaded.weight_format
    down = [layer.mlp.down for layer in tp.engine.loaded.model.layers]
    assert isinstance(down[0], torch.nn.Linear) == layout.endswith("act-order")  # kept quantized but there
    assert not isinstance(down[1], torch.nn.Linear) and down[1].in_features == (48 if method == "fp8" else 32)
    assert [o.outputs[0].token_ids for o in tp.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    tp.engine.close()


def test_a_checkpoint_layer_is_read_when_its_turn_comes_and_only_its_rows_kept(tmp_path):
    """The loader's view of a quantized checkpoint: every tensor found and none read until its layer's turn (a load
    holds one layer more than it has placed, never the whole file), then its rows equal to the bit the whole
    layer's decoded and cut; a layer's shape known from the header alone."""
    from safetensors.torch import save_file

    from ridge.models import loader

    torch.manual_seed(3)
    w = torch.randn(40, 128)
    layouts = {"gptq": checkpoint.pack_gptq(quantize_int4(w, 32, integer_zeros=True)),
               "awq": checkpoint.pack_awq(quantize_int4(w, 32, integer_zeros=True)),
               "fp8": checkpoint.pack_fp8(quantize_fp8(w))}
    rows = torch.tensor([1, 2, 3, 17, 30, 31])
    for layout, tensors in layouts.items():
        config = checkpoint.quantization_config(layout, 8 if layout == "fp8" else 4, None if layout == "fp8" else 32)
        (tmp_path / layout).mkdir()
        save_file({f"m.{k}": v for k, v in tensors.items()} | {"norm.weight": torch.ones(128)},
                  str(tmp_path / layout / "model.safetensors"))
        reads: list[str] = []

        def logged(name: str, stored, log=reads):
            return dataclasses.replace(stored, read=lambda rows: log.append(name) or stored.read(rows))

        found = [(name, logged(name, stored)) for name, stored in loader._safetensors(tmp_path / layout)]
        layers = dict(loader._checkpoint_layers(iter(found), config))
        assert not reads and layers.keys() == {"m.weight", "norm.weight"} and not layers["norm.weight"].quantized
        assert layers["m.weight"].shape == (40, 128) and layers["m.weight"].quantized
        part = layers["m.weight"].read(rows)
        assert sorted(reads) == sorted(f"m.{k}" for k in tensors)
        whole = dict(checkpoint.read_quantized(iter((f"m.{k}", v) for k, v in tensors.items()), config))["m.weight"]
        expected = cut_quantized("m.weight", whole, 0, rows)
        assert all(torch.equal(getattr(part, f), getattr(expected, f)) for f in ("qweight", "scales")), layout
