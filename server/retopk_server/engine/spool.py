"""An artifact's bytes as they arrive, in an anonymous file in memory that the safetensors library then maps.

ImportSession's chunks are written here one after another (one copy, out of the gRPC messages), and the file is
parsed as a saved session's is (session_file.read, safetensors_parts.open_payload_file): the tensors map its
pages instead of being copied out of a joined buffer (joining the chunks is a copy of the whole artifact, and the
library's load out of the join another). On Linux the file is a memfd (``os.memfd_create``: memory only, never on a
disk, gone once it is closed and no tensor maps it); elsewhere a temporary file deleted when closed.
"""

from __future__ import annotations

import os
import tempfile


class Spool:
    """A write-only anonymous file (module docstring): ``write`` pieces in order, ``path`` opens it, ``close``."""

    def __init__(self) -> None:
        if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
            fd = os.memfd_create("retopk-artifact", os.MFD_CLOEXEC)
            self._file = os.fdopen(fd, "wb", buffering=0)
            self.path = f"/proc/self/fd/{fd}"
        else:
            self._file = tempfile.NamedTemporaryFile(prefix="retopk-artifact-", buffering=0)  # noqa: SIM115
            self.path = self._file.name
        self.size = 0  # bytes written

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            view = view[self._file.write(view):]  # a file's write may take less than all
        self.size += memoryview(data).nbytes

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
