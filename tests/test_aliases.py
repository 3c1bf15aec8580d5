"""`ridge pull`'s aliases and the architectures ridge runs cannot drift apart: every alias loads and generates."""

import pytest

from ridge import SamplingParams, hub
from ridge.models.registry import check_supported


def test_every_alias_names_an_architecture_ridge_runs():
    for alias, artifact in hub.ALIASES.items():
        assert artifact.architecture is not None, alias
        check_supported(artifact.architecture)


@pytest.mark.parametrize("alias_path", list(hub.ALIASES), indirect=True)
def test_every_alias_loads_and_generates(alias_path, make_llm_for_test, request):
    alias = request.node.callspec.params["alias_path"]
    # on the file's own blocks (the form a GGUF file is served in): the 1.5B model's float32 load, beside another
    # test's engine and HF model in the suite's other worker, does not fit the machine's memory, and its bfloat16
    # one spends most of its time dequantizing (the smaller models' dequantized loads are the other tests')
    llm = make_llm_for_test(alias_path, quantization="gguf", kv_cache_memory="64MiB", max_model_len=512)
    assert llm.engine.loaded.config.architecture == hub.ALIASES[alias].architecture
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].text.strip()


def test_a_gguf_of_another_architecture_is_refused_before_loading(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    from ridge import LLM

    path = tmp_path / "phi2.gguf"
    writer = GGUFWriter(str(path), "phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'phi2' is not supported; supported: llama, .*gemma3"):
        LLM(str(path), progress=False)
