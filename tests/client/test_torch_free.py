"""The client installs alone (`pip install client/`) into a fresh venv without torch and talks to a server.

The venv has no system site packages and no pip of its own: this venv's pip installs into it
(``pip --python``), with build isolation, so the build pulls only setuptools and grpcio-tools and
the install only grpcio and protobuf (from the local package index when the machine has one).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

from tests._live_server import REPO

SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys
    import retopk_client
    from retopk_client import Client
    missing = [m for m in ("torch", "transformers", "triton", "retopk_core", "retopk_server", "grpc_tools")
               if importlib.util.find_spec(m) is not None]
    assert not missing, f"installed but must not be: {missing}"
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("torch imported")
    with Client(sys.argv[1], timeout=300) as client:
        health = client.health()
        done = client.complete(messages=[{"role": "user", "content": "What is the capital of France?"}],
                               max_new_tokens=10, temperature=0.0)
    print(json.dumps({"file": retopk_client.__file__, "health": health, "text": done.text,
                      "generated": done.usage.generated_tokens}))
    """
)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("RETOPK_")}


def test_client_installs_without_torch_and_talks_to_the_server(tmp_path, live_server):
    src = tmp_path / "src"  # a copy, so the in-tree build writes nothing into the repository
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", "retopk_proto")
    shutil.copytree(REPO / "client", src / "client", ignore=ignore)
    shutil.copytree(REPO / "proto", src / "proto", ignore=ignore)
    (src / "scripts").mkdir()
    shutil.copy2(REPO / "scripts" / "gen_proto.py", src / "scripts" / "gen_proto.py")

    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", str(src / "client")],
        capture_output=True, text=True, timeout=600, env=_clean_env(),
    )
    assert install.returncode == 0, install.stdout + install.stderr

    torch = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path, env=_clean_env())
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr

    run = subprocess.run([str(python), "-c", SCRIPT, live_server], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path, env=_clean_env())
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["file"].startswith(str(env_dir)), out["file"]  # the installed copy, not the source tree
    assert out["health"] == "SERVING" and "Paris" in out["text"] and out["generated"] > 0

    cli = env_dir / "bin" / "retopk"  # the console script of the client distribution
    health = subprocess.run([str(cli), "health", "--address", live_server], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, env=_clean_env())
    assert health.returncode == 0 and health.stdout.strip() == "SERVING", health.stderr
