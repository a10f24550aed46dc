"""The three demo models the synthetic traffic asks for, as a Triton model repository of small ONNX graphs.

Each model is built with ``onnx.helper`` from weights drawn with a fixed seed, so the same call writes the
same bytes every run: ``<root>/<model>/config.pbtxt`` (Triton's ModelConfig text format) and
``<root>/<model>/<version>/model.onnx``. The embedded ONNX backend, the null backend's built-in specs and
a real Triton server all read the same files.

* ``rank-mlp`` (pipeline ``ranking``): one row per candidate, ``features`` FP32 [40] = 8 candidate features,
  16 user features (both normalised by the pipeline with the parameters below) and 16 hashed-tag buckets,
  plus ``item_rows`` INT64 [1], the candidate's row in a 4096 x 8 item embedding table; Gather, Concat,
  Gemm-Relu-Gemm -> ``scores`` FP32 [1].
* ``text-encoder`` (pipeline ``text``): ``input_ids``/``attention_mask`` INT64 [-1]; embedding Gather,
  masked mean pool, Gemm -> ``embedding`` FP32 [64] (L2 normalisation is the pipeline's post-processing).
* ``image-classifier`` (pipeline ``image``): ``pixels`` FP32 [3, 64, 64]; two strided Convs, global
  average pool, Gemm -> ``logits`` FP32 [10] over :data:`IMAGE_LABELS`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeAlias

import numpy as np
from google.protobuf import text_format

from edgewire.extras import optional_dependency
from edgewire.pb.triton import model_config_pb2

with optional_dependency("gateway"):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

RANKING_MODEL: Final = "rank-mlp"
TEXT_MODEL: Final = "text-encoder"
IMAGE_MODEL: Final = "image-classifier"
DEMO_MODELS: Final = (RANKING_MODEL, TEXT_MODEL, IMAGE_MODEL)

RANKING_CANDIDATE_WIDTH: Final = 8
RANKING_USER_WIDTH: Final = 16
RANKING_TAG_BUCKETS: Final = 16
RANKING_FEATURES: Final = RANKING_CANDIDATE_WIDTH + RANKING_USER_WIDTH + RANKING_TAG_BUCKETS
RANKING_HIDDEN: Final = 32
RANKING_MAX_ROWS: Final = 8192
RANKING_ITEM_ROWS: Final = 4096
RANKING_ITEM_DIM: Final = 8
# How the synthetic catalog's and shoppers' dense features are normalised (measured on them): price, and a
# shopper's days since the last order and average basket, are log-scaled first.
RANKING_NORMALISATION: Final = {
    "candidate_log1p": "0",
    "candidate_mean": "3.25,0.14,4.39,4.32,0,0.96,5,0.7",
    "candidate_std": "0.85,0.16,0.34,0.85,1,0.19,1.5,0.46",
    "user_log1p": "3,5",
    "user_mean": "3,1,2,3.1,2,4.2,0.3,0.125,0.125,0.125,0.125,0.125,0.125,0.125,0.125,11.5",
    "user_std": "2,0.82,1.41,1,1.41,0.6,0.46,0.2,0.2,0.2,0.2,0.2,0.2,0.2,0.2,6.9",
    "dense_clip": "8",
}

TEXT_VOCAB: Final = 8192
TEXT_DIM: Final = 64
TEXT_MAX_TOKENS: Final = 128
TEXT_MAX_BATCH: Final = 64

IMAGE_SIZE: Final = 64
IMAGE_MAX_BATCH: Final = 32
IMAGE_LABELS: Final = (
    "electronics",
    "fashion",
    "beauty",
    "home",
    "sports",
    "toys",
    "grocery",
    "auto",
    "books",
    "jewelry",
)

OPSET: Final = 17
IR_VERSION: Final = 8  # the IR that opset 17 shipped with; every onnxruntime >= 1.13 loads it
DEFAULT_SEED: Final = 1
MODEL_FILENAME: Final = "model.onnx"
CONFIG_FILENAME: Final = "config.pbtxt"

ModelConfig: TypeAlias = model_config_pb2.ModelConfig  # Triton's schema, vendored (proto/triton)


def write_demo_repository(root: Path) -> list[Path]:
    """Write version 1 of every demo model under ``root``; returns the files written, in a fixed order."""
    written: list[Path] = []
    for model in DEMO_MODELS:
        written.extend(write_model_version(root, model, 1, DEFAULT_SEED))
    return written


def write_model_version(root: Path, model: str, version: int, seed: int) -> list[Path]:
    """Write ``<root>/<model>/<version>/model.onnx`` with weights drawn from ``seed`` (and a missing config).

    A different seed gives different weights, hence different outputs: tests add version 2 this way to show
    a backend picking up a new version at run time. Files appear atomically (written aside, then renamed),
    so a repository scan never reads half a model.
    """
    try:
        build = _BUILDERS[model]
    except KeyError:
        raise ValueError(f"unknown demo model {model!r}; known: {list(DEMO_MODELS)}") from None
    if version < 1:
        raise ValueError(f"model versions start at 1, got {version}")
    model_dir = root / model
    config_path = model_dir / CONFIG_FILENAME
    written: list[Path] = []
    if not config_path.exists():
        _write_atomically(config_path, text_format.MessageToString(demo_config(model)).encode())
        written.append(config_path)
    onnx_path = model_dir / str(version) / MODEL_FILENAME
    _write_atomically(onnx_path, build(np.random.default_rng([seed, DEMO_MODELS.index(model)])))
    written.append(onnx_path)
    return written


def demo_config(model: str) -> ModelConfig:
    """Triton's ModelConfig of a demo model (what ``config.pbtxt`` holds)."""
    mc = model_config_pb2
    config = mc.ModelConfig(name=model, backend="onnxruntime")
    config.version_policy.latest.num_versions = 1
    params: dict[str, str]
    if model == RANKING_MODEL:
        config.max_batch_size = RANKING_MAX_ROWS
        config.input.add(name="features", data_type=mc.TYPE_FP32, dims=[RANKING_FEATURES])
        config.input.add(name="item_rows", data_type=mc.TYPE_INT64, dims=[1])
        config.output.add(name="scores", data_type=mc.TYPE_FP32, dims=[1])
        params = {
            "pipeline": "ranking",
            "candidate_feature_width": str(RANKING_CANDIDATE_WIDTH),
            "user_feature_width": str(RANKING_USER_WIDTH),
            "tag_buckets": str(RANKING_TAG_BUCKETS),
            "item_table_rows": str(RANKING_ITEM_ROWS),
            **RANKING_NORMALISATION,
        }
    elif model == TEXT_MODEL:
        config.max_batch_size = TEXT_MAX_BATCH
        config.input.add(name="input_ids", data_type=mc.TYPE_INT64, dims=[-1])
        config.input.add(name="attention_mask", data_type=mc.TYPE_INT64, dims=[-1])
        config.output.add(name="embedding", data_type=mc.TYPE_FP32, dims=[TEXT_DIM])
        params = {"pipeline": "text", "vocab_size": str(TEXT_VOCAB), "max_tokens": str(TEXT_MAX_TOKENS)}
    elif model == IMAGE_MODEL:
        config.max_batch_size = IMAGE_MAX_BATCH
        config.input.add(name="pixels", data_type=mc.TYPE_FP32, dims=[3, IMAGE_SIZE, IMAGE_SIZE])
        config.output.add(name="logits", data_type=mc.TYPE_FP32, dims=[len(IMAGE_LABELS)])
        params = {"pipeline": "image", "labels": ",".join(IMAGE_LABELS)}
    else:
        raise ValueError(f"unknown demo model {model!r}; known: {list(DEMO_MODELS)}")
    for key, value in params.items():
        config.parameters[key].string_value = value
    return config


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f".{path.name}.tmp")
    aside.write_bytes(data)
    os.replace(aside, path)


def _weight(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float) -> TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def _serialize(graph: onnx.GraphProto) -> bytes:
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="hk-edge-gateway demo",
    )
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _ranking(rng: np.random.Generator) -> bytes:
    f, h, e = RANKING_FEATURES, RANKING_HIDDEN, RANKING_ITEM_DIM
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["item_table", "item_rows"], ["item_3d"], axis=0),
            helper.make_node("Reshape", ["item_3d", "item_shape"], ["item_embedding"]),
            helper.make_node("Concat", ["features", "item_embedding"], ["row"], axis=1),
            helper.make_node("Gemm", ["row", "w1", "b1"], ["hidden"]),
            helper.make_node("Relu", ["hidden"], ["active"]),
            helper.make_node("Gemm", ["active", "w2", "b2"], ["scores"]),
        ],
        RANKING_MODEL,
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["rows", f]),
            helper.make_tensor_value_info("item_rows", TensorProto.INT64, ["rows", 1]),
        ],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["rows", 1])],
        [
            _weight(rng, "w1", (f + e, h), 1.0 / np.sqrt(f + e)),
            _weight(rng, "b1", (h,), 0.1),
            _weight(rng, "w2", (h, 1), 1.0 / np.sqrt(h)),
            _weight(rng, "b2", (1,), 0.1),
            _weight(rng, "item_table", (RANKING_ITEM_ROWS, e), 0.5),
            numpy_helper.from_array(np.array([-1, e], dtype=np.int64), "item_shape"),
        ],
    )
    return _serialize(graph)


def _text(rng: np.random.Generator) -> bytes:
    d = TEXT_DIM
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "input_ids"], ["embedded"], axis=0),
            helper.make_node("Cast", ["attention_mask"], ["mask"], to=TensorProto.FLOAT),
            helper.make_node("Unsqueeze", ["mask", "last_axis"], ["mask3"]),
            helper.make_node("Mul", ["embedded", "mask3"], ["masked"]),
            helper.make_node("ReduceSum", ["masked", "seq_axis"], ["summed"], keepdims=0),
            helper.make_node("ReduceSum", ["mask", "seq_axis"], ["count"], keepdims=1),
            helper.make_node("Max", ["count", "one"], ["count_safe"]),
            helper.make_node("Div", ["summed", "count_safe"], ["pooled"]),
            helper.make_node("Gemm", ["pooled", "w", "b"], ["embedding"]),
        ],
        TEXT_MODEL,
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", d])],
        [
            _weight(rng, "table", (TEXT_VOCAB, d), 1.0),
            _weight(rng, "w", (d, d), 1.0 / np.sqrt(d)),
            _weight(rng, "b", (d,), 0.05),
            numpy_helper.from_array(np.array([2], dtype=np.int64), "last_axis"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "seq_axis"),
            numpy_helper.from_array(np.array([1.0], dtype=np.float32), "one"),
        ],
    )
    return _serialize(graph)


def _image(rng: np.random.Generator) -> bytes:
    s, n = IMAGE_SIZE, len(IMAGE_LABELS)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["pixels", "c1w", "c1b"], ["c1"], kernel_shape=[3, 3], strides=[2, 2]),
            helper.make_node("Relu", ["c1"], ["r1"]),
            helper.make_node("Conv", ["r1", "c2w", "c2b"], ["c2"], kernel_shape=[3, 3], strides=[2, 2]),
            helper.make_node("Relu", ["c2"], ["r2"]),
            helper.make_node("GlobalAveragePool", ["r2"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
            helper.make_node("Gemm", ["flat", "fcw", "fcb"], ["logits"]),
        ],
        IMAGE_MODEL,
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 3, s, s])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", n])],
        [
            _weight(rng, "c1w", (8, 3, 3, 3), 1.0 / np.sqrt(27)),
            _weight(rng, "c1b", (8,), 0.1),
            _weight(rng, "c2w", (16, 8, 3, 3), 1.0 / np.sqrt(72)),
            _weight(rng, "c2b", (16,), 0.1),
            _weight(rng, "fcw", (16, n), 1.0),
            _weight(rng, "fcb", (n,), 0.1),
        ],
    )
    return _serialize(graph)


_BUILDERS: Final[dict[str, Callable[[np.random.Generator], bytes]]] = {
    RANKING_MODEL: _ranking,
    TEXT_MODEL: _text,
    IMAGE_MODEL: _image,
}
