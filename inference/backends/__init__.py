"""Backends both programs load in-process: the Protocol every backend implements and the embedded ONNX one."""
