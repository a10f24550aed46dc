"""Imports of optional dependencies: a missing one names the extra of ``hk-edge-gateway`` that installs it.

Each host installs only what it runs (README, Install): ``[agent]`` on an edge agent, ``[agent-local]`` where
the agent also serves the edge-device tier, ``[gateway]`` in Hong Kong, ``[rayserve]`` on Ray nodes,
``[torch]`` for the in-process GPU tier. Code that needs more than the core dependencies imports it inside
:func:`optional_dependency`::

    with optional_dependency("agent-local", "gateway"):
        import onnxruntime as ort

so that a host without it fails with ``pip install 'hk-edge-gateway[agent-local]'`` instead of a bare
``No module named 'onnxruntime'``. The imports stay ordinary import statements (typed, sorted, read by
tests/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

DISTRIBUTION: Final = "hk-edge-gateway"


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra(s) that install it."""

    def __init__(self, module: str, extras: tuple[str, ...]) -> None:
        self.extras = extras
        choices = " or ".join(f"'{DISTRIBUTION}[{extra}]'" for extra in extras)
        super().__init__(
            f"No module named {module!r}: it comes with the {'/'.join(extras)} extra of {DISTRIBUTION}; "
            f"install it with pip install {choices}",
            name=module,
        )


@contextmanager
def optional_dependency(extra: str, *more: str) -> Iterator[None]:
    """Turn a missing module imported in the block into :class:`MissingExtraError` naming ``extra``."""
    try:
        yield
    except ModuleNotFoundError as exc:
        raise MissingExtraError(exc.name or str(exc), (extra, *more)) from exc
