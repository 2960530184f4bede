"""The server's CPU thread count: the cgroup quota read, the default, the option and its bounds."""

from __future__ import annotations

import os

import pytest
import torch

from retopk_core.params import ParamError
from retopk_server.cli import config_from
from retopk_server.config import ServerConfig
from retopk_server.runtime.cpu_threads import apply_threads, available_cpus, cgroup_cpu_limit


@pytest.mark.parametrize("text, limit", [("max 100000\n", None), ("150000 100000\n", 2), ("200000 100000", 2),
                                         ("50000 100000", 1), ("", None), ("garbage here", None)])
def test_the_cgroup_quota_is_rounded_up_to_whole_cpus(tmp_path, text, limit):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text)
    assert cgroup_cpu_limit(cpu_max) == limit


def test_no_cgroup_file_is_no_limit(tmp_path):
    assert cgroup_cpu_limit(tmp_path / "absent") is None


def test_the_quota_caps_the_affinity(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("100000 100000")
    assert available_cpus(cpu_max) == 1
    cpu_max.write_text(f"{100000 * (cpus + 5)} 100000")  # a quota above the CPUs it may run on: the CPUs
    assert available_cpus(cpu_max) == cpus
    assert available_cpus(tmp_path / "absent") == cpus


def test_apply_threads_sizes_torch_and_returns_the_count():
    before = torch.get_num_threads()
    try:
        assert apply_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_the_option_reaches_the_config_and_is_bounded():
    assert config_from([], {}).threads is None
    assert config_from(["--threads", "3"], {}).threads == 3
    assert config_from([], {"RETOPK_THREADS": "2"}).threads == 2
    assert config_from(["--threads", "none"], {}).threads is None
    for bad in (0, -1, 1025, True):
        with pytest.raises(ParamError, match="threads"):
            ServerConfig(threads=bad)
