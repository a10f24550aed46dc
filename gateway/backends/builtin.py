"""Imports the backends that ship with the gateway, so that each registers its config ``type``."""

from gateway.backends import null, onnx, rayserve, torch, triton

__all__ = ["null", "onnx", "rayserve", "torch", "triton"]
