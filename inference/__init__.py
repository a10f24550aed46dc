"""Inference code both programs use: the backend Protocol and the embedded ONNX Runtime backend, the CPU
pipelines (wire requests -> tensors -> wire outputs), the routing profile of a request and the demo models.

Imports edgewire and routing only; never gateway or edge_agent."""
