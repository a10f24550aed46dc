"""optional_dependency: a module that is not installed becomes an error naming the extra that installs it."""

from __future__ import annotations

import pytest

from edgewire.extras import MissingExtraError, optional_dependency


def test_a_missing_module_names_the_extra_and_the_pip_command() -> None:
    """The error says which module is missing and the pip command of each extra that brings it."""
    with pytest.raises(MissingExtraError) as caught, optional_dependency("agent-local", "gateway"):
        import hk_edge_gateway_no_such_module  # noqa: F401
    error = caught.value
    assert error.name == "hk_edge_gateway_no_such_module"
    assert error.extras == ("agent-local", "gateway")
    assert "No module named 'hk_edge_gateway_no_such_module'" in str(error)
    assert "pip install 'hk-edge-gateway[agent-local]' or 'hk-edge-gateway[gateway]'" in str(error)
    assert isinstance(error.__cause__, ModuleNotFoundError)


def test_the_error_is_an_import_error() -> None:
    """Callers that handle ImportError (the torch backend's start) keep handling it."""
    with pytest.raises(ImportError, match=r"hk-edge-gateway\[torch\]"), optional_dependency("torch"):
        import hk_edge_gateway_no_such_module  # noqa: F401


def test_a_missing_submodule_names_the_top_module_import_stopped_at() -> None:
    """``import a.b`` where ``a`` is missing reports ``a``, the module pip would install."""
    with pytest.raises(MissingExtraError) as caught, optional_dependency("gateway"):
        import hk_edge_gateway_no_such_module.grpc.aio  # noqa: F401
    assert caught.value.name == "hk_edge_gateway_no_such_module"


def test_other_errors_pass_through_unchanged() -> None:
    """Only a missing module is translated; any other failure inside the block is left as it is."""
    with pytest.raises(ZeroDivisionError), optional_dependency("gateway"):
        _ = 1 / 0


def test_an_installed_module_imports_as_usual() -> None:
    """With the dependency present the block is a plain import."""
    with optional_dependency("gateway"):
        import json
    assert json.loads("[1]") == [1]
