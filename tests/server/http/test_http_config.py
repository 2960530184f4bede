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


def test_the_error_table_of_docs_http_lists_every_status_the_front_answers():
    """Every HTTP status the front can answer has its row in docs/http.md's error table (405 was missing), and
    the table's code column is the gRPC status the errors module maps to it."""
    import re
    from pathlib import Path

    from retopk_server.http.errors import STATUS

    text = (Path(__file__).resolve().parents[3] / "docs" / "http.md").read_text()
    rows = dict(re.findall(r"^\| (\d{3}) \| `(\w+)` \|", text, re.M))
    unreachable = {"PERMISSION_DENIED", "CANCELLED", "DEADLINE_EXCEEDED"}  # no HTTP request gets these
    answered = {str(status) for code, (status, _) in STATUS.items() if code not in unreachable} | {"405", "413"}
    assert set(rows) == answered
    for status, code in rows.items():
        if status not in ("405", "413"):
            assert STATUS[code.upper()][0] == int(status), (status, code)


def test_a_message_names_its_field_once():
    from retopk_server.service.wire import InvalidArgument

    said = "sampling.temperature: must be >= 0"
    assert str(InvalidArgument("sampling.temperature", "temperature must be >= 0")) == said
    said = "method.params['sink']: must be an int"
    assert str(InvalidArgument("method.params['sink']", "sink must be an int")) == said
    assert str(InvalidArgument("text", "too long: 9 tokens")) == "text: too long: 9 tokens"
    assert str(InvalidArgument("top_k", "top_kx is not top_k")) == "top_k: top_kx is not top_k"
