"""Backends that speak the KServe v2 gRPC protocol (``inference.GRPCInferenceService``) to a remote server.

Triton Inference Server speaks it natively and Ray Serve's gRPC proxy forwards it to a deployment
(:mod:`inference.rayserve_app`), so both are one :class:`~gateway.backends.kserve.backend.KServeBackend` with
a :class:`~gateway.backends.kserve.dialect.Dialect` for what differs. One module per job:

- ``options``: the config section (``KServeOptions``), validated when the config is read;
- ``tls``: the channel credentials (``TlsOptions``), files checked at start;
- ``dialect``: what differs between servers, and the gRPC answers every KServe v2 server shares;
- ``catalog``: what the server serves (repository index, model configs, readiness);
- ``backend``: the connections and the calls (``KServeBackend``).
"""
