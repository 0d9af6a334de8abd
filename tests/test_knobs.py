"""RAYFLEX_* knobs: what a user may set, and the error for what they may not."""

import pytest

from rayflex.constants import knob


@pytest.mark.parametrize("name", ["UPLOAD_NICE", "ACTIVATION_PROBE_EVERY"])
def test_zero_is_a_setting_where_the_docs_say_so(monkeypatch, name):
    monkeypatch.setenv(f"RAYFLEX_{name}", "0")
    assert knob(name) == 0


@pytest.mark.parametrize("name,raw,message", [
    ("UPLOAD_NICE", "-1", "RAYFLEX_UPLOAD_NICE='-1' must be >= 0"),
    ("POLL_INTERVAL_S", "0", "RAYFLEX_POLL_INTERVAL_S='0' must be > 0"),
    ("HEARTBEAT_TIMEOUT_S", "soon", "RAYFLEX_HEARTBEAT_TIMEOUT_S='soon' is not a number"),
])
def test_a_bad_value_names_the_variable_and_what_it_must_be(monkeypatch, name, raw, message):
    monkeypatch.setenv(f"RAYFLEX_{name}", raw)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        knob(name)

