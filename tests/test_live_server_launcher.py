"""The test launcher's children die with the test process (tests/_live_server.py), without a fork of it."""

import subprocess
import sys

import pytest

from tests._live_server import with_parent_death_signal

# Prints the calling process's parent-death signal (prctl PR_GET_PDEATHSIG = 2), 0 when none is set.
READ_PDEATHSIG = (
    "import ctypes; libc = ctypes.CDLL('libc.so.6'); sig = ctypes.c_int(-1); "
    "libc.prctl(2, ctypes.byref(sig)); print(sig.value)"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_gets_sigterm_when_its_parent_dies():
    """The prefix sets SIGTERM (15) as the child's parent-death signal, and the exec keeps it."""
    command = with_parent_death_signal([sys.executable, "-c", READ_PDEATHSIG])
    assert command[-3:] == [sys.executable, "-c", READ_PDEATHSIG]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout
    assert int(out) == 15
