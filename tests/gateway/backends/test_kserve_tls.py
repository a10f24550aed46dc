"""TLS options of the KServe gRPC backends (triton, rayserve) without a server: what fails the start.

A file that cannot be used would otherwise only make every handshake fail later, with the backend
NOT_SERVING and nothing said; the handshakes themselves are tested against a real tritonserver that
requires mutual TLS (test_triton_backend.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import gateway.backends.builtin  # noqa: F401  (registers the backend types)
from gateway.backends.kserve.backend import KServeBackend
from gateway.backends.kserve.options import KServeOptions
from inference.backends.base import BackendHealth, create
from tests.gateway.backends.pki import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def backend(**options: object) -> KServeBackend:
    made = create("triton", "triton", {"url": "127.0.0.1:9", "control_timeout_s": 0.2, **options})
    assert isinstance(made, KServeBackend)
    return made


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tls": "yes"}, "'tls' must be true or false"),
        ({"tls_ca_file": "/ca.pem"}, "'tls_ca_file' needs tls = true"),
        ({"tls": True, "tls_cert_file": "/c.pem"}, "go together"),
        ({"tls": True, "tls_server_name": ""}, "tls_server_name"),
    ],
)
def test_bad_tls_options_are_refused_at_load(options: dict[str, object], message: str) -> None:
    """Config mistakes fail when the config is read, naming the option."""
    with pytest.raises(ValueError, match=message):
        KServeOptions.from_mapping("triton", {"url": "127.0.0.1:8001", **options})


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing CA", r"'tls_ca_file': cannot read .*missing\.pem"),
        ("CA is not PEM", r"'tls_ca_file': .*junk\.pem holds no PEM certificates"),
        (
            "key is the unit's placeholder",
            r"'tls_cert_file', 'tls_key_file': .* not a PEM certificate and its key",
        ),
        ("key of another certificate", r"'tls_cert_file', 'tls_key_file'"),
    ],
)
async def test_an_unusable_tls_file_fails_the_start_naming_the_option(
    pki: Pki, tmp_path: Path, case: str, message: str
) -> None:
    """Unreadable, not PEM, the systemd placeholder ("unset") or a key that is not the certificate's: the
    backend's start (and so the gateway's) fails with the option named, before anything connects."""
    placeholder = tmp_path / "unset.key"
    placeholder.write_text("unset")
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    mutual = pki.mutual_tls()
    options = {
        "missing CA": {**mutual, "tls_ca_file": str(tmp_path / "missing.pem")},
        "CA is not PEM": {**mutual, "tls_ca_file": str(junk)},
        "key is the unit's placeholder": {**mutual, "tls_key_file": str(placeholder)},
        "key of another certificate": {**mutual, "tls_key_file": str(pki.server_key)},
    }[case]
    remote = backend(**options)
    with pytest.raises(ValueError, match=message):
        await remote.start()
    await remote.aclose()


@pytest.mark.parametrize("case", ["CA and client pair", "host's CA file"])
async def test_good_files_and_the_hosts_roots_start(pki: Pki, case: str) -> None:
    """The CA and a matching client pair start the backend; so does tls = true alone, which trusts the
    host's CA file. Started, it has checked the server once: NOT_SERVING, that check counted as failed
    (nothing listens on port 9), not the start."""
    options = pki.mutual_tls() if case == "CA and client pair" else {"tls": True}
    remote = backend(**options)
    await remote.start()
    try:
        outcome = (remote.health(), remote.refresh_failures)
    finally:
        await remote.aclose()
    assert outcome == (BackendHealth.NOT_SERVING, 1)
