"""Build hook of the root distribution: generate the gRPC stubs from proto/ before packaging.

All metadata lives in pyproject.toml; this file only swaps in a build_py that runs
scripts/gen_proto.py into client/retopk_proto (gitignored: the public wire package ``retopk_proto``
that the server and the client both import) and packages the result. It runs for wheels, sdists and
editable installs alike.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
GEN_SCRIPT = HERE / "scripts" / "gen_proto.py"
PROTO_DIR = HERE / "proto"
OUT_DIR = HERE / "client" / "retopk_proto"


def _gen_proto():
    spec = importlib.util.spec_from_file_location("_retopk_gen_proto", GEN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProto(build_py):
    """build_py that first (re)generates retopk_proto and adds its packages."""

    def run(self):
        gen = _gen_proto()
        gen.generate(PROTO_DIR, OUT_DIR)
        # A fresh tree has no client/retopk_proto when pyproject's package search runs: map it here (for this
        # build and for an editable install's finder, which reads the distribution's mapping).
        for package_dir in (self.package_dir, self.distribution.package_dir):
            package_dir.setdefault("retopk_proto", OUT_DIR.relative_to(HERE).as_posix())
        for name in gen.generated_packages(OUT_DIR, "retopk_proto"):
            if name not in self.packages:
                self.packages.append(name)
        super().run()


setup(cmdclass={"build_py": BuildPyWithProto})
