"""The shipped systemd unit: notify + watchdog, hardened, loopback unless a key is set."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from aerie.config import config_from_args
from aerie.resolve import ConfigError, resolve_config
from tests.aerie.test_config import _model_dir

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _unit() -> dict[str, list[tuple[str, str]]]:
    """Section -> [(key, value)] in file order (systemd allows repeated keys)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in (DEPLOY / "aerie.service").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        else:
            key, _, value = line.partition("=")
            current.append((key, value))
    return sections


def _values(section: list[tuple[str, str]], key: str) -> list[str]:
    return [v for k, v in section if k == key]


def test_the_unit_uses_notify_and_a_watchdog_longer_than_the_launchers():
    service = _unit()["Service"]
    assert _values(service, "Type") == ["notify"]
    watchdog_s = float(_values(service, "WatchdogSec")[0])
    launcher_timeout_s = config_from_args([]).server.watchdog_timeout_s
    # The launcher names the stuck process and exits before systemd would kill it silently.
    assert watchdog_s > launcher_timeout_s
    assert _values(service, "Restart") == ["on-failure"]


def test_the_unit_is_hardened():
    service = dict(_unit()["Service"])
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }.items():
        assert service[key] == value, key
    # The GPU and Triton's generated code need these to stay off.
    assert "PrivateDevices" not in service and "MemoryDenyWriteExecute" not in service
    assert service.get("User") not in (None, "root")


def test_every_cache_a_server_writes_is_in_its_writable_cache_directory():
    """ProtectSystem=strict and ProtectHome=yes leave only CacheDirectory writable: Triton's
    kernel cache (default ~/.triton) and everything under HOME must point there."""
    service = _unit()["Service"]
    writable = "/var/cache/" + _values(service, "CacheDirectory")[0]
    environment = dict(v.split("=", 1) for v in _values(service, "Environment"))
    for name in ("AERIE_CACHE", "HOME", "TRITON_CACHE_DIR"):
        assert environment[name].startswith(writable), name


@pytest.mark.parametrize(
    "env_host, key, refused",
    [
        (None, None, False),
        ("0.0.0.0", "secret", False),
        ("0.0.0.0", None, True),
    ],
)
def test_the_unit_binds_loopback_unless_a_key_is_set(tmp_path, monkeypatch, env_host, key, refused):
    service = _unit()["Service"]
    environment = dict(v.split("=", 1) for v in _values(service, "Environment"))
    assert environment["AERIE_HOST"] == "127.0.0.1"
    keys = [k for k, _ in service]
    assert keys.index("EnvironmentFile") > keys.index("Environment")  # the file overrides
    host = env_host or environment["AERIE_HOST"]
    (exec_start,) = _values(service, "ExecStart")
    argv = shlex.split(exec_start.replace("${AERIE_HOST}", host))
    assert argv[1] == "launch.py" and "--api-key" not in argv  # keys stay off the command line
    monkeypatch.delenv("AERIE_API_KEY", raising=False)
    if key is not None:
        monkeypatch.setenv("AERIE_API_KEY", key)
    config = config_from_args([*argv[2:], "--model-path", _model_dir(tmp_path), "--device", "cpu"])
    if refused:
        with pytest.raises(ConfigError, match="API key"):
            resolve_config(config)
    else:
        resolved = resolve_config(config)
        os.rmdir(resolved.runtime_dir)
        assert resolved.server.host == host


def test_the_environment_example_names_the_key_variable():
    text = (DEPLOY / "aerie.env.example").read_text()
    assert "AERIE_API_KEY=" in text and "AERIE_HOST" in text
