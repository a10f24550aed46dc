"""Triton python-backend model that runs a demo model's ``model.onnx`` with ONNX Runtime.

For Triton builds without the onnxruntime backend (the one in the ``nvidia-pytriton`` wheel that the tests
run): ``hk-gateway models init --triton --runtime python`` puts this file beside each ``model.onnx``. It
runs in Triton's python-backend stub, in the Python environment first on Triton's PATH, which must hold
onnxruntime and a numpy the stub was built for (numpy < 2 for Triton 2.51).

Config parameter ``test_execute_delay_s`` makes each execution take that much longer: tests use it to stand
in for a slow GPU so that Triton's queue fills; never set it in production.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """One model instance: an ONNX Runtime session on the instance's device."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        path = Path(args["model_repository"]) / args["model_version"] / "model.onnx"
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        gpu = args.get("model_instance_kind") == "GPU"
        providers: list[Any] = ["CPUExecutionProvider"]
        if gpu and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(
                0, ("CUDAExecutionProvider", {"device_id": int(args["model_instance_device_id"])})
            )
        self.session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
        parameters = config.get("parameters", {})
        self.delay_s = float(parameters.get("test_execute_delay_s", {}).get("string_value", "0") or 0)
        self.inputs = [tensor["name"] for tensor in config["input"]]
        self.outputs = [tensor["name"] for tensor in config["output"]]

    def execute(self, requests: list[Any]) -> list[Any]:
        """Run Triton's dynamic batch as one session call when the requests' shapes allow, else one by one."""
        if self.delay_s:
            time.sleep(self.delay_s)
        feeds = [
            {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in self.inputs}
            for request in requests
        ]
        same_shape = all(
            feed[name].shape[1:] == feeds[0][name].shape[1:] for feed in feeds for name in self.inputs
        )
        if len(feeds) > 1 and same_shape:
            sizes = [feeds[i][self.inputs[0]].shape[0] for i in range(len(feeds))]
            joined = {name: np.concatenate([feed[name] for feed in feeds]) for name in self.inputs}
            try:
                results = self.session.run(self.outputs, joined)
            except Exception as exc:  # noqa: BLE001  (any model failure answers the batch's requests)
                return [pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))) for _ in requests]
            bounds = np.cumsum(sizes)[:-1]
            parts = [np.split(result, bounds) for result in results]
            return [self._response([part[i] for part in parts]) for i in range(len(requests))]
        responses = []
        for feed in feeds:
            try:
                responses.append(self._response(self.session.run(self.outputs, feed)))
            except Exception as exc:  # noqa: BLE001  (a bad request fails alone, not its batch)
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses

    def _response(self, results: list[Any]) -> Any:
        tensors = [
            pb_utils.Tensor(name, np.ascontiguousarray(value))
            for name, value in zip(self.outputs, results, strict=True)
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)
