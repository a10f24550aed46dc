"""Imports the backends that ship with the gateway, so that each registers its config ``type``."""

from gateway.backends import null, rayserve, torch, triton
from inference.backends import onnx

__all__ = ["null", "onnx", "rayserve", "torch", "triton"]
