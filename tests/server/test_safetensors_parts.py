"""engine/safetensors_parts.py against the safetensors library itself (the reference): the parts joined are the
bytes ``safetensors.torch.save`` writes, ``read_payload`` reads what the library writes into the same tensors,
and a malformed payload is refused naming what is wrong."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load, save

from retopk_server.engine.safetensors_parts import DTYPES, PayloadError, payload_parts, read_payload


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


def test_read_payload_reads_what_the_library_writes_as_views_of_the_buffer():
    t = tensors()
    data = np.frombuffer(bytearray(save(t, metadata=META)), dtype=np.uint8)
    metadata, got = read_payload(data, 1 << 20)
    assert metadata == META and set(got) == set(t)
    reference = load(save(t, metadata=META))
    for name, want in reference.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    k = got["kv.k"]
    assert data.ctypes.data <= k.data_ptr() < data.ctypes.data + len(data)  # no copy
    assert read_payload(save(t, metadata=META), 1 << 20)[1].keys() == got.keys()  # bytes: copied once, same


def with_header(data: bytes, change) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n:]


@pytest.mark.parametrize(("name", "change", "words"), [
    ("unknown dtype", lambda h: h["token_ids"].update(dtype="Q7"), "not a dtype"),
    ("size not the shape's", lambda h: h["token_ids"].update(shape=[10]), "do not hold"),
    ("a gap", lambda h: h["token_ids"].update(data_offsets=[h["token_ids"]["data_offsets"][0] + 8,
                                                            h["token_ids"]["data_offsets"][1] + 8]), "follow"),
    ("negative shape", lambda h: h["token_ids"].update(shape=[-9]), "non-negative"),
    ("metadata not strings", lambda h: h.update(__metadata__={"a": 1}), "__metadata__"),
])
def test_malformed_headers_are_refused(name, change, words):
    data = save(tensors(), metadata=META)
    with pytest.raises(PayloadError, match=words):
        read_payload(with_header(data, change), 1 << 20)


def test_truncated_or_oversized_payloads_are_refused():
    data = save(tensors(), metadata=META)
    for bad, words in ((data[:5], "truncated"), (data[:-1], "end at"), (data + b"\0" * 8, "end at"),
                       (struct.pack("<Q", 1 << 40) + data[8:], "corrupted payload header"),
                       (struct.pack("<Q", 8) + b"not json", "not JSON")):
        with pytest.raises(PayloadError, match=words):
            read_payload(bad, 1 << 20)
    with pytest.raises(PayloadError, match="corrupted payload header"):
        read_payload(data, 16)  # a header past the caller's bound
