"""Who may use a server: the API key, the loopback rule, allowed Host headers, CURVE keys.

`resolve_access(config)` fills the security section once (the key from $AERIE_API_KEY, when set
and not empty, if no flag gave one; the allowed hosts; the CURVE key file) and refuses a server
that would listen beyond loopback with no key unless --allow-unauthenticated. `check_api_key`
compares in constant time. `load_curve_keypair` reads (or creates, private to the user) the
server's CURVE secret key file. Imports no torch.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

from aerie.config import AerieConfig

API_KEY_ENV = "AERIE_API_KEY"
LOOPBACK_HOST_NAMES = ("localhost", "127.0.0.1", "[::1]", "::1")
CURVE_KEY_FILE_NAME = "zmq_curve_secret.key"


class AccessError(ValueError):
    """The access settings are unsafe or impossible; the message says what to change."""


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


def resolve_access(config: AerieConfig, cache_dir: str) -> dict:
    """The resolved security section (as `AerieConfig.replace` fields)."""
    security, host = config.security, config.server.host
    api_key = security.api_key
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None  # an empty variable is an unset one
    if api_key is not None and not api_key.strip():
        raise AccessError("the API key is blank: give --api-key a secret, or leave it out")
    if not is_loopback(host) and api_key is None and not security.allow_unauthenticated:
        raise AccessError(
            f"--host {host} listens beyond this machine without an API key: set --api-key "
            f"(or ${API_KEY_ENV}) so that clients must authenticate, or pass "
            "--allow-unauthenticated to serve anyone who can connect"
        )
    allowed = security.allowed_hosts
    if allowed is None and is_loopback(host):
        allowed = ",".join(LOOPBACK_HOST_NAMES)
    key_file = security.zmq_curve_key_file
    if security.zmq_curve and key_file is None:
        key_file = os.path.join(cache_dir, CURVE_KEY_FILE_NAME)
    return {
        "api_key": api_key,
        "allowed_hosts": allowed,
        "zmq_curve": security.zmq_curve or key_file is not None,
        "zmq_curve_key_file": None if key_file is None else os.path.abspath(key_file),
    }


def check_api_key(expected: str | None, given: str | None) -> bool:
    """Whether `given` is the key (always true when none is configured); constant time."""
    if expected is None:
        return True
    if given is None:
        return False
    return hmac.compare_digest(expected.encode(), given.encode())


def allowed_host_names(allowed_hosts: str | None) -> frozenset[str] | None:
    """The Host header names (ports stripped, lower case) a server accepts; None: any."""
    if allowed_hosts is None:
        return None
    return frozenset(name.strip().lower() for name in allowed_hosts.split(",") if name.strip())


def host_without_port(host_header: str) -> str:
    """'example.com:8080' -> 'example.com', '[::1]:80' -> '[::1]' (lower case)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def load_curve_keypair(path: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys from the secret key file, creating it (mode 0600) if
    it does not exist."""
    import zmq

    if not zmq.has("curve"):
        raise AccessError("this pyzmq build has no CURVE support; drop --zmq-curve")
    if not os.path.exists(path):
        public, secret = zmq.curve_keypair()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret + b"\n")
    with open(path, "rb") as f:
        secret = f.read().strip()
    if len(secret) != 40:
        raise AccessError(f"{path} does not hold a Z85 CURVE secret key (40 characters)")
    return zmq.curve_public(secret), secret
