"""--http-port / RETOPK_HTTP_PORT: off by default, a port, or 0 for any free one; bad values exit with a message."""

from __future__ import annotations

import pytest

from retopk_server.cli import config_from


def test_http_port_flag_and_environment():
    assert config_from([], {}).http_port is None  # off unless asked for
    assert config_from(["--http-port", "8000"], {}).http_port == 8000
    assert config_from([], {"RETOPK_HTTP_PORT": "0"}).http_port == 0
    assert config_from(["--http-port", "none"], {"RETOPK_HTTP_PORT": "8000"}).http_port is None  # flags win


@pytest.mark.parametrize("value", ["70000", "-1", "http"])
def test_bad_http_port_exits_with_a_message(value, capsys):
    with pytest.raises(SystemExit) as info:
        config_from(["--http-port", value], {})
    assert info.value.code == 2
    assert "http" in capsys.readouterr().err
