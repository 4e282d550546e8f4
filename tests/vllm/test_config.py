"""The connector's settings are checked as it is built: every bad key is a ValueError that
names it, and a token is never taken from the extra config vLLM prints."""

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm.config import ConnectorConfig  # noqa: E402

BASE = {"model_fingerprint": "m@1"}


@pytest.mark.parametrize(("extra", "key"), [
    ({"model_fingerprint": ""}, "model_fingerprint"),
    ({"value_format": "int2"}, "value_format"),
    ({"ack": "never"}, "ack"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": "soon"}, "timeout_s"),
    ({"lookup_timeout_ms": -5}, "lookup_timeout_ms"),
    ({"save_queue_depth": 0}, "save_queue_depth"),
    ({"save_queue_depth": 2.5}, "save_queue_depth"),
    ({"breaker_failures": True}, "breaker_failures"),
    ({"probe_interval_s": "x"}, "probe_interval_s"),
    ({"sever": "a:1"}, "sever"),
])
def test_a_bad_setting_is_a_value_error_naming_its_key(extra, key):
    with pytest.raises(ValueError, match=key):
        ConnectorConfig.from_extra({**BASE, **extra})


def test_a_token_is_refused_for_a_token_file(tmp_path):
    with pytest.raises(ValueError, match="token_file") as refused:
        ConnectorConfig.from_extra({**BASE, "token": "s3cret"})
    assert "s3cret" not in str(refused.value)
    with pytest.raises(ValueError, match="token_file"):
        ConnectorConfig.from_extra({**BASE, "token_file": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="token_file"):
        ConnectorConfig.from_extra({**BASE, "token_file": str(tmp_path / "empty")})
    (tmp_path / "token").write_text("s3cret\n")
    config = ConnectorConfig.from_extra({**BASE, "token_file": str(tmp_path / "token")})
    assert config.token == "s3cret" and "s3cret" not in repr(config)


def test_defaults_and_numbers_from_strings():
    config = ConnectorConfig.from_extra({**BASE, "save_queue_depth": "2",
                                         "lookup_timeout_ms": "15"})
    assert (config.save_queue_depth, config.lookup_timeout_ms) == (2, 15.0)
    default = ConnectorConfig.from_extra(BASE)
    assert default.lookup_timeout_ms < 100 and default.save_queue_depth >= 1
