"""RAYFLEX_* knobs: what a user may set, and the error for what they may not."""

import pytest

from rayflex.constants import knob


@pytest.mark.parametrize("name", ["UPLOAD_NICE", "ACTIVATION_PROBE_EVERY"])
def test_zero_is_a_setting_where_the_docs_say_so(monkeypatch, name):
    monkeypatch.setenv(f"RAYFLEX_{name}", "0")
    assert knob(name) == 0


# Each knob declares its default, kind and bounds once (constants.Knob); knob() and the
# start-up check (which also says what to set instead) read the same declaration.
@pytest.mark.parametrize("name,raw,message,fix", [
    ("UPLOAD_NICE", "-1", "RAYFLEX_UPLOAD_NICE='-1' must be >= 0 and <= 19", "set a whole number >= 0 and <= 19"),
    ("UPLOAD_NICE", "20", "RAYFLEX_UPLOAD_NICE='20' must be >= 0 and <= 19", "set a whole number >= 0 and <= 19"),
    ("POLL_INTERVAL_S", "0", "RAYFLEX_POLL_INTERVAL_S='0' must be > 0", "set a number > 0"),
    ("HEARTBEAT_TIMEOUT_S", "soon", "RAYFLEX_HEARTBEAT_TIMEOUT_S='soon' is not a number", "set a number > 0"),
    ("STORAGE_RETRY_ATTEMPTS", "2.5", "RAYFLEX_STORAGE_RETRY_ATTEMPTS='2.5' is not a whole number",
     "set a whole number >= 1"),
    ("STORAGE_RETRY_ATTEMPTS", "0", "RAYFLEX_STORAGE_RETRY_ATTEMPTS='0' must be >= 1", "set a whole number >= 1"),
])
def test_a_bad_value_names_the_variable_and_what_it_must_be(monkeypatch, name, raw, message, fix):
    from rayflex.constants import check_knobs

    monkeypatch.setenv(f"RAYFLEX_{name}", raw)
    with pytest.raises(ValueError) as refused:
        knob(name)
    (var, problem, says), = check_knobs()[0]
    assert str(refused.value) == f"{var}={problem}" == message
    assert says.startswith(fix) and says.endswith("or unset it")


def test_every_default_is_a_value_its_knob_accepts():
    from rayflex.constants import _KNOBS

    refused = {name: k.default for name, k in _KNOBS.items()
               if not k.accepts(k.default) or not isinstance(k.default, k.kind)}
    assert not refused, refused
