"""A session artifact's payload in the safetensors format (https://github.com/huggingface/safetensors): read by
the library, written by hand as views of the tensors.

The format, as the library defines it:

    8 bytes     N, the header's length, unsigned little-endian
    N bytes     the header: a JSON object, name -> {"dtype": "BF16", "shape": [...], "data_offsets": [b, e]}
                and "__metadata__" -> {str: str}; padded with spaces to a multiple of 8
    the rest    every tensor's bytes (little-endian, row-major) at [b, e) of it, back to back, no gaps

``open_payload_file`` parses a payload that is a whole file with the library's ``safe_open``: a payload comes from
outside the process (an ImportSession stream, spooled to a file in memory by engine/spool.py; a file in
--session-dir), and the library's parser is the one the ecosystem keeps hardened against malformed headers (unknown
dtypes, sizes that do not match the shapes, gaps, overlaps, bytes past the end); its error becomes a
``PayloadError``. The tensors map the file instead of copying it (privately: writing one does not reach the file;
unlinking the file leaves them valid): Python's own copies of a large buffer fault in every page of fresh memory,
so reading a payload into ``bytes`` and the library's copy out of them (``safetensors.torch.load``) were most of a
load.

``payload_parts`` writes the payload without copying the tensors: the 8-byte length and the header, then a view
of each tensor's memory, laid out in the order the library's writer uses (the larger element first, then by
name) with the header it writes (compact JSON, the metadata first), so the parts joined are byte for byte what
``safetensors.torch.save`` returns (tests/server/test_safetensors_parts.py compares them). The library's writer
returns one ``bytes`` of the whole payload: for an 8,000-token session of the embedded model (205 MiB) that is
205 MiB more held while the artifact streams out or is written to disk, and the copy multiplies the encode's
time (``python -m bench.artifact_writer`` measures both), on the drain's handoff path whose time the issue
bounds. Writing needs no parser, so nothing hostile reaches this hand-written piece.
"""

from __future__ import annotations

import json
import struct

import safetensors
import torch

# dtype <-> the format's name, in the order the library's writer lays tensors out (larger elements first).
DTYPES: tuple[tuple[torch.dtype, str], ...] = (
    (torch.int64, "I64"), (torch.float64, "F64"), (torch.float32, "F32"), (torch.int32, "I32"),
    (torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.int16, "I16"), (torch.int8, "I8"),
    (torch.uint8, "U8"), (torch.bool, "BOOL"),
)
_NAME = {dtype: name for dtype, name in DTYPES}
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


def _header_bytes(n: int, max_header_bytes: int) -> int:
    if n > max_header_bytes:
        raise PayloadError(f"the payload header exceeds {max_header_bytes} bytes")
    return n


def open_payload_file(path: str, max_header_bytes: int) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of the safetensors file at ``path`` (nothing before or after its payload), parsed by the
    library, the tensors mapping the file (module docstring); a header longer than ``max_header_bytes`` is refused
    before it is parsed. PayloadError when it is malformed."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise PayloadError("truncated payload")
    _header_bytes(struct.unpack("<Q", head)[0], max_header_bytes)
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            return f.metadata() or {}, {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - no iterator
    except Exception as e:  # noqa: BLE001 - SafetensorError, or a dtype torch lacks: either way malformed here
        raise PayloadError(_reason(e)) from None


def _reason(e: Exception) -> str:
    return str(e).removeprefix("Error while deserializing: ")
