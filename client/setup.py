"""Build hook of the client-only distribution: generate the gRPC stubs before packaging.

All metadata lives in client/pyproject.toml. The stubs are generated from ../proto by
../scripts/gen_proto.py (the same script as the root build). Building from an unpacked client sdist,
where ../proto is absent, packages the stubs the sdist carries (sdist generates them first and
MANIFEST.in includes them).
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
GEN_SCRIPT = HERE.parent / "scripts" / "gen_proto.py"
PROTO_DIR = HERE.parent / "proto"
OUT_DIR = HERE / "retopk_proto"


def _gen_proto():
    spec = importlib.util.spec_from_file_location("_retopk_gen_proto", GEN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _can_generate() -> bool:
    return GEN_SCRIPT.is_file() and PROTO_DIR.is_dir()


class BuildPyWithProto(build_py):
    """build_py that first (re)generates retopk_proto and adds its packages."""

    def run(self):
        if _can_generate():
            gen = _gen_proto()
            gen.generate(PROTO_DIR, OUT_DIR)
            packages = gen.generated_packages(OUT_DIR, "retopk_proto")
        elif (OUT_DIR / "__init__.py").is_file():
            packages = sorted(
                "retopk_proto" + "".join("." + part for part in p.parent.relative_to(OUT_DIR).parts)
                for p in OUT_DIR.rglob("__init__.py")
            )
        else:
            raise RuntimeError(f"cannot generate the gRPC stubs: neither {PROTO_DIR} nor {OUT_DIR} exists")
        for name in packages:
            if name not in self.packages:
                self.packages.append(name)
        super().run()


class SdistWithProto(sdist):
    """sdist that generates the stubs first, so the archive builds without ../proto."""

    def run(self):
        if _can_generate():
            _gen_proto().generate(PROTO_DIR, OUT_DIR)
        super().run()


setup(cmdclass={"build_py": BuildPyWithProto, "sdist": SdistWithProto})
