"""ridge's GGUF header reader against gguf's own reader and writer: the same keys, values, tensor table and bytes."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from ridge.models.gguf_file import read_gguf


def _same_as_gguf_reader(path) -> None:
    ours, theirs = read_gguf(path), GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # the reader's own header entries
    assert list(ours.fields) == keys
    for key in keys:
        assert ours.fields[key] == theirs.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(reversed(b.shape.tolist()))
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name


def test_smollm2_reads_as_gguf_reads_it(smollm2_path):
    _same_as_gguf_reader(smollm2_path)


def test_every_value_type_and_tensor_kind_round_trips(tmp_path):
    path = tmp_path / "kinds.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_uint8("u8", 200)
    writer.add_int8("i8", -7)
    writer.add_uint16("u16", 60000)
    writer.add_int16("i16", -300)
    writer.add_uint32("u32", 4_000_000_000)
    writer.add_int32("i32", -5)
    writer.add_uint64("u64", 2**40)
    writer.add_int64("i64", -(2**40))
    writer.add_float32("f32", 0.5)
    writer.add_float64("f64", 1e-300)
    writer.add_bool("flag", True)
    writer.add_string("text", "héllo, wörld")
    writer.add_array("words", ["a", "", "ü"])
    writer.add_array("ints", [1, -2, 3])
    writer.add_key_value("floats", [0.25, 1.5], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    rng = np.random.default_rng(0)
    writer.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal(7).astype(np.float16))
    q8 = quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("blocks", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    _same_as_gguf_reader(path)
    gguf = read_gguf(path)
    assert gguf.fields["u64"] == 2**40 and gguf.fields["f64"] == 1e-300 and gguf.fields["flag"] is True
    assert gguf.fields["words"] == ["a", "", "ü"] and gguf.fields["text"] == "héllo, wörld"
    assert "words" not in gguf.metadata and gguf.metadata["i8"] == -7
    blocks = next(t for t in gguf.tensors if t.name == "blocks")
    assert blocks.shape == (4, 64) and blocks.data.shape == (4, 2 * 34)  # two 34-byte Q8_0 blocks a row


@pytest.mark.parametrize("header, message", [
    (b"GGML" + bytes(20), "not a GGUF file"),
    (b"GGUF" + (7).to_bytes(4, "little") + bytes(16), "version 7"),
])
def test_not_gguf_names_what_it_found(tmp_path, header, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(header)
    with pytest.raises(ValueError, match=message):
        read_gguf(path)
