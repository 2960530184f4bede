"""Launch a real `retopk-server` process for tests (any conftest may import this module).

    server = launch_server("--max-running", "4")      # waits for "listening on" and health SERVING
    channel = grpc.insecure_channel(server.address)   # "127.0.0.1:PORT"
    ...
    server.stop()                                     # SIGTERM, wait, return code

The server binds port 0 (the kernel picks a free one, no race) and its printed "listening on" line
tells the port. The child imports this working tree (server/, client/ and the root on PYTHONPATH)
and starts from a clean RETOPK_* environment so a developer's settings cannot change test results, but for
RETOPK_CPU_ISA: a run that asks for a lower SIMD level (to see an AVX2 machine's results on an AVX-512 one) asks
it of its servers too.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"listening on (\S+):(\d+)")


def served_weight_format() -> str:
    """ModelInfo.weight_format of a launched server on the embedded model: its GGUF blocks as stored (int4, the
    LM head int8), with the block products' activations that the default "auto" resolves to on this machine
    (under this process's RETOPK_CPU_ISA, which the server inherits): bf16x2 where the CPU has AMX-BF16, int16 with
    AVX-512 VNNI, float32 (shown by nothing) elsewhere (llama.cpu_activations)."""
    from retopk_server.runtime.decoder.llama import cpu_activations, shown_activations

    return "int4, lm_head int8" + shown_activations(cpu_activations()[0])


def free_port() -> int:
    """A TCP port that was free a moment ago (for a second listener, e.g. --metrics-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_parent_death_signal(command: list[str]) -> list[str]:
    """``command`` run under ``setpriv --pdeathsig TERM`` where util-linux has it (Linux): the child gets SIGTERM
    when the thread that started it dies, so no server outlives the test process. A prefix, not a
    ``preexec_fn``: Popen with a preexec_fn must fork() the whole test process, and late in the suite its
    address space is large enough that the kernel may refuse the fork's commit (ENOMEM); without one Popen
    uses vfork, which copies nothing."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return [setpriv, "--pdeathsig", "TERM", *command] if setpriv else command


def _child_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RETOPK_") or k == "RETOPK_CPU_ISA"}
    paths = [str(REPO), str(REPO / "server"), str(REPO / "client")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    # OpenMP threads that sleep at a barrier instead of spinning: the suite's machines are small and shared
    # (2 cores, several processes), and a server whose thread spins while the core it waits for runs someone
    # else slows each decode step many times over (tests/server/http/test_openai_structured.py's 20 requests were the
    # suite's slowest test); with free cores both threads still work. A caller's environment may set it.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.update(extra or {})
    return env


class LiveServer:
    """A server process: ``address`` "127.0.0.1:PORT", ``port``, ``process``, ``output()`` (its log so far)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.address = ""
        self.port = 0
        self._lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, name="live-server-log", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.append(line)
            match = LISTENING.search(line)
            if match and not self._ready.is_set():
                self.port = int(match.group(2))
                self.address = f"127.0.0.1:{self.port}"
                self._ready.set()
        self._ready.set()  # the process ended (maybe before it was ready)

    def output(self) -> str:
        return "".join(self._lines)

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout) or not self.address:
            self.kill()
            raise RuntimeError(f"retopk-server did not start within {timeout} s; its output:\n{self.output()}")
        wait_serving(self.address, timeout)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful drain) and wait; returns the exit code (kills it after ``timeout``)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def wait_serving(address: str, timeout: float) -> None:
    """Poll grpc.health.v1 until the server says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{address} is not SERVING after {timeout} s")
            time.sleep(0.1)


def _spawn(args: tuple[str, ...], env: dict[str, str] | None) -> LiveServer:
    command = [sys.executable, "-m", "retopk_server.cli", "--host", "127.0.0.1", "--port", "0",
               "--metrics-port", "0", *args]
    process = subprocess.Popen(with_parent_death_signal(command), cwd=REPO, env=_child_env(env),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    return LiveServer(process)


def launch_server(*args: str, env: dict[str, str] | None = None, timeout: float = 180.0) -> LiveServer:
    """Start `python -m retopk_server.cli --host 127.0.0.1 --port 0 --metrics-port 0 *args` and wait
    until it serves. Later flags win, so ``args`` may override the port options."""
    server = _spawn(args, env)
    server.wait_ready(timeout)
    return server


def launch_servers(count: int, *args: str, env: dict[str, str] | None = None,
                   timeout: float = 180.0) -> list[LiveServer]:
    """``count`` servers started together (their model loads overlap), each waited for as in
    ``launch_server``. Call it from the thread that outlives them: the children get SIGTERM when the
    thread that started them ends (PR_SET_PDEATHSIG is per thread)."""
    servers = [_spawn(args, env) for _ in range(count)]
    try:
        for server in servers:
            server.wait_ready(timeout)
    except BaseException:
        for server in servers:
            server.kill()
        raise
    return servers
