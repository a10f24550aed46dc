"""TLS to a KServe v2 server: the gRPC channel credentials, built from files checked when they are read."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from edgewire.extras import optional_dependency

with optional_dependency("gateway", "triton"):
    import grpc


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """TLS to the inference server: its CA (None = the system's CA file, OpenSSL's default), a client
    certificate and key for mutual TLS (both or neither), and the name to check in the server's certificate
    when ``url`` is an address (``tls_server_name``)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials. A file that cannot be read or is not what it should be (PEM
        certificates; a certificate and its own key) is a ValueError naming its option: gRPC would only
        fail every handshake later, with nothing said."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ca_file = self.ca_file
        if ca_file is None:  # grpcio would use its own bundled roots, not the host's
            system = ssl.get_default_verify_paths().cafile
            ca_file = system if system and Path(system).is_file() else None
        ca = _read("tls_ca_file", ca_file) if ca_file else None
        if ca is not None:
            try:
                context.load_verify_locations(cadata=ca.decode("latin-1"))
            except (ssl.SSLError, ValueError) as exc:
                raise ValueError(
                    f"option 'tls_ca_file': {ca_file} holds no PEM certificates ({exc})"
                ) from None
        cert = key = None
        if self.cert_file is not None and self.key_file is not None:
            cert, key = _read("tls_cert_file", self.cert_file), _read("tls_key_file", self.key_file)
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except ssl.SSLError as exc:
                raise ValueError(
                    f"options 'tls_cert_file', 'tls_key_file': {self.cert_file} and {self.key_file} are not"
                    f" a PEM certificate and its key ({exc})"
                ) from None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _read(option: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"option {option!r}: cannot read {path}: {exc.strerror or exc}") from None
