"""engine/safetensors_parts.py against the safetensors library itself (the reference): the hand-written parts
joined are the bytes ``safetensors.torch.save`` writes, ``open_payload_file`` (the library's parser) reads them into
the same tensors, and a malformed payload is refused naming what is wrong."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save

from retopk_server.engine.safetensors_parts import DTYPES, PayloadError, open_payload_file, payload_parts


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"t.{name}": (torch.randn(3, 5, generator=g) * 50).to(dtype) for dtype, name in DTYPES}
    out |= {"kv.k": torch.randn(2, 3, 4, 7, generator=g).bfloat16(), "token_ids": torch.arange(9),
            "state.empty": torch.zeros(0, 4), "odd": torch.ones(3, dtype=torch.int8), "scalar": torch.tensor(1.5)}
    return out


META = {"retopk": json.dumps({"text": 'quotes " and \\ and \n and é'})}


def test_the_parts_are_the_bytes_the_library_writes():
    t = tensors()
    parts = payload_parts(t, META)
    assert b"".join(parts) == save(t, metadata=META)
    assert all(isinstance(p, memoryview) for p in parts[1:])  # views of the tensors, not copies


def with_header(data: bytes, change) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n:]


@pytest.mark.parametrize(("name", "change", "words"), [
    ("unknown dtype", lambda h: h["token_ids"].update(dtype="Q7"), "unknown variant `Q7`"),
    ("size not the shape's", lambda h: h["token_ids"].update(shape=[10]), "invalid shape, data type, or offset"),
    ("a gap", lambda h: h["token_ids"].update(data_offsets=[h["token_ids"]["data_offsets"][0] + 8,
                                                            h["token_ids"]["data_offsets"][1] + 8]),
     "invalid offset for tensor `token_ids`"),
    ("negative shape", lambda h: h["token_ids"].update(shape=[-9]), "integer `-9`"),
    ("metadata not strings", lambda h: h.update(__metadata__={"a": 1}), "expected a string"),
    ("not a tensor entry", lambda h: h.update(extra=5), "expected struct TensorInfo"),
])
def test_malformed_headers_are_refused(name, change, words, tmp_path):
    (tmp_path / "f").write_bytes(with_header(save(tensors(), metadata=META), change))
    with pytest.raises(PayloadError, match=words):
        open_payload_file(str(tmp_path / "f"), 1 << 20)


def test_open_payload_file_maps_the_file_into_the_same_tensors(tmp_path):
    t = tensors()
    (tmp_path / "f").write_bytes(b"".join(payload_parts(t, META)))
    metadata, got = open_payload_file(str(tmp_path / "f"), 1 << 20)
    assert metadata == META and set(got) == set(t)
    for name, want in t.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    (tmp_path / "plain").write_bytes(save(t))
    assert open_payload_file(str(tmp_path / "plain"), 1 << 20)[0] == {}  # no metadata
    for bad, words in ((b"\0" * 5, "truncated"), (save(t)[:-1], "incomplete"), (save(t), "header exceeds 16 bytes")):
        (tmp_path / "bad").write_bytes(bad)
        with pytest.raises(PayloadError, match=words):
            open_payload_file(str(tmp_path / "bad"), 16 if words.startswith("header") else 1 << 20)


def test_truncated_or_oversized_payloads_are_refused(tmp_path):
    data = save(tensors(), metadata=META)
    for bad, words in ((data[:5], "truncated"), (data[:-1], "not fully covered"),
                       (data + b"\0" * 8, "not fully covered"),
                       (struct.pack("<Q", 1 << 40) + data[8:], "header exceeds"),
                       (struct.pack("<Q", 8) + b"not json", "invalid JSON")):
        (tmp_path / "bad").write_bytes(bad)
        with pytest.raises(PayloadError, match=words):
            open_payload_file(str(tmp_path / "bad"), 1 << 20)
