"""Compile the fused CPU kernel (retopk_cpu.cpp, with the decoder's ops of decoder_ops.cpp and the whole-step
layer loop of decode_layers.cpp) beside this file:
``python -m retopk_core.cpu.build``.

``make install`` / ``make test`` and docker/Dockerfile.cpu run it after installing the project. It needs a
C++ compiler with OpenMP (g++), ninja and the installed torch; the result is ``_build/retopk_cpu.so`` and a
stamp holding the hash of what it was built from (``build_key``), which ``retopk_core.cpu.launch`` compares
before loading, so an edited source or another torch is never loaded stale. A build whose stamp matches
returns at once (no torch import), so running it on every ``make`` costs nothing. Exit status 1 on failure.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import shutil
import sys
from pathlib import Path

NAME = "retopk_cpu"
HERE = Path(__file__).resolve().parent
SOURCES = (HERE / f"{NAME}.cpp", HERE / "decoder_ops.cpp", HERE / "decode_layers.cpp")
HEADERS = (HERE / "library_ops.h", HERE / "key_select.h")  # the entries one source calls in another; the Top-K cuts
BUILD_DIR = HERE / "_build"
LIBRARY = BUILD_DIR / f"{NAME}.so"
STAMP = BUILD_DIR / f"{NAME}.key"
# -fopenmp: at::parallel_for's OpenMP regions and `omp simd` reductions; the process shares torch's
# libgomp (same soname). No -march: the hot loops carry their own x86-64-v3 clones (see the source).
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def build_key() -> str:
    """Hash of the sources and headers, the flags, the installed torch and the Python version it compiles against."""
    h = hashlib.sha256(b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS)))
    h.update(repr((CFLAGS, LDFLAGS, importlib.metadata.version("torch"), sys.version_info[:2])).encode())
    return h.hexdigest()


def up_to_date() -> bool:
    """Whether the library exists and its stamp matches ``build_key``."""
    return LIBRARY.exists() and STAMP.exists() and STAMP.read_text().strip() == build_key()


def build(verbose: bool = False) -> Path:
    """Compile into BUILD_DIR and write the stamp; returns the library path (raises on failure)."""
    from torch.utils.cpp_extension import load

    if STAMP.exists():
        STAMP.unlink()
    BUILD_DIR.mkdir(exist_ok=True)
    load(name=NAME, sources=[str(source) for source in SOURCES], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
         build_directory=str(BUILD_DIR), verbose=verbose)  # lists: load() extends them in place
    STAMP.write_text(build_key() + "\n")
    return LIBRARY


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verbose", action="store_true", help="print the compiler commands")
    p.add_argument("--clean", action="store_true", help="remove the build folder first (a full rebuild)")
    args = p.parse_args(argv)
    if args.clean:
        shutil.rmtree(BUILD_DIR, ignore_errors=True)
    elif up_to_date():
        print(f"retopk_core.cpu.build: {LIBRARY} is up to date")
        return 0
    try:
        path = build(args.verbose)
    except Exception as e:  # compiler missing, compile error, ninja missing: say so, exit non-zero
        print(f"retopk_core.cpu.build: failed: {e}", file=sys.stderr)
        return 1
    print(f"retopk_core.cpu.build: built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
