"""The safetensors format (https://github.com/huggingface/safetensors) written and read without copying the
tensors' bytes: a session artifact's payload (engine/session_artifact.py) is hundreds of MiB, and the
library's ``save`` copies them twice into one ``bytes`` and its ``load`` once more out of it.

The format, as the library defines it:

    8 bytes     N, the header's length, unsigned little-endian
    N bytes     the header: a JSON object, name -> {"dtype": "BF16", "shape": [...], "data_offsets": [b, e]}
                and "__metadata__" -> {str: str}; padded with spaces to a multiple of 8
    the rest    every tensor's bytes (little-endian, row-major) at [b, e) of it, back to back, no gaps

``payload_parts`` lays the tensors out in the order the library's writer does (the larger element first,
then by name) and writes the header as it does (compact JSON, the metadata first), so the parts joined are
byte for byte what ``safetensors.torch.save`` returns (tests/server/test_safetensors_parts.py compares
them): any safetensors reader reads the payload. The tensors' parts are views of their memory, not copies.

``read_payload`` is the inverse over a buffer already in memory: it checks the header as the library's
reader does (known dtypes, sizes that match the shapes, offsets back to back over the whole data, nothing
past the buffer; ``PayloadError`` naming what is wrong) and returns tensors that view the buffer. A writable
buffer gives writable tensors; a read-only one (``bytes``) is copied once first, since torch does not
support tensors over read-only memory.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import torch

# dtype <-> the format's name, in the order the library's writer lays tensors out (larger elements first).
DTYPES: tuple[tuple[torch.dtype, str], ...] = (
    (torch.int64, "I64"), (torch.float64, "F64"), (torch.float32, "F32"), (torch.int32, "I32"),
    (torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.int16, "I16"), (torch.int8, "I8"),
    (torch.uint8, "U8"), (torch.bool, "BOOL"),
)
_NAME = {dtype: name for dtype, name in DTYPES}
_DTYPE = {name: dtype for dtype, name in DTYPES}
_RANK = {dtype: rank for rank, (dtype, _) in enumerate(DTYPES)}


class PayloadError(ValueError):
    """The bytes are not a well-formed safetensors payload (the message says what is wrong)."""


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as a flat byte view (kept alive by the view)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def payload_parts(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[bytes | memoryview]:
    """The safetensors payload of ``tensors`` (contiguous, on the CPU, dtypes of DTYPES) and ``metadata``:
    the 8-byte length and header, then each tensor's bytes as a view, in the file's order (module docstring)."""
    order = sorted(tensors, key=lambda name: (_RANK[tensors[name].dtype], name))
    header: dict[str, object] = {"__metadata__": metadata}
    views, at = [], 0
    for name in order:
        t = tensors[name]
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"tensor {name!r} must be contiguous and on the CPU")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAME[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
        if nbytes:
            views.append(_bytes_of(t))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the tensors' bytes start 8-aligned
    return [struct.pack("<Q", len(text)) + text, *views]


def read_payload(buffer, max_header_bytes: int) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a safetensors payload held whole in ``buffer`` (bytes, bytearray or a uint8
    numpy array); the tensors view the buffer (module docstring). PayloadError when it is malformed."""
    data = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer
    if not data.flags.writeable:
        data = data.copy()
    if len(data) < 8:
        raise PayloadError("truncated payload")
    (n,) = struct.unpack("<Q", data[:8].tobytes())
    if n > min(max_header_bytes, len(data) - 8):
        raise PayloadError("corrupted payload header")
    try:
        header = json.loads(data[8:8 + n].tobytes())
    except ValueError:
        raise PayloadError("the payload header is not JSON") from None
    if not isinstance(header, dict):
        raise PayloadError("the payload header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise PayloadError("the payload's __metadata__ must map names to strings")
    entries = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = _DTYPE[entry["dtype"]], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise PayloadError(f"tensor {name!r}: not a dtype, shape and data_offsets") from None
        if not all(type(x) is int and x >= 0 for x in (*shape, begin, end)) or not isinstance(shape, list):
            raise PayloadError(f"tensor {name!r}: shape and offsets must be non-negative integers")
        if end - begin != math.prod(shape) * _itemsize(dtype):
            raise PayloadError(f"tensor {name!r}: {end - begin} bytes do not hold {entry['dtype']} {shape}")
        entries.append((begin, end, name, dtype, shape))
    entries.sort(key=lambda e: (e[0], e[1]))
    base, at = 8 + n, 0
    for begin, end, name, _, _ in entries:
        if begin != at:
            raise PayloadError(f"tensor {name!r}: its bytes do not follow the previous tensor's")
        at = end
    if base + at != len(data):
        raise PayloadError(f"the tensors' bytes end at {base + at}, the payload at {len(data)}")
    return metadata, {name: _view(data, base + begin, base + end, dtype, shape)
                      for begin, end, name, dtype, shape in entries}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _view(data: np.ndarray, begin: int, end: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if begin == end:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_numpy(data[begin:end])
    if raw.data_ptr() % _itemsize(dtype):  # a writer that did not align it: a copy, aligned
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)
