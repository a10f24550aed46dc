"""Fixtures for tests that drive a real gateway on loopback: models_dir comes from tests/conftest.py."""
