"""Wire tensors <-> numpy, the reasons a request is dropped from a batch, and the generic tensor pipeline.

The conversions follow KServe v2: ``raw_data`` holds the elements row-major and little-endian; a BYTES
element is a 4-byte little-endian length followed by the bytes. Every other pipeline builds its wire
outputs with :func:`tensor_from_array`.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from edgewire import pb
from edgewire.codec import _varint
from edgewire.scan import Buffer
from inference.backends.base import ModelSpec, TensorSpec
from inference.pipeline.base import Prepared
from inference.pipeline.tensor_spans import WireTensor, wire_inputs


class InvalidInput(enum.StrEnum):
    """Why a pipeline dropped a request from its batch; a bounded set, used as a metric label."""

    BAD_FEATURES = "bad_features"  # ranking: widths or lengths do not match the model
    EMPTY_TEXT = "empty_text"  # text: nothing to encode
    BAD_IMAGE = "bad_image"  # image: not decodable in its declared format
    SIZE_MISMATCH = "size_mismatch"  # image: decoded size differs from the declared width/height
    TOO_LARGE = "too_large"  # more rows / pixels than the model or the gateway takes
    MISSING_INPUT = "missing_input"  # tensor: a model input is absent
    BAD_TENSOR = "bad_tensor"  # tensor: wrong dtype, shape, or raw_data length
    RAGGED_BATCH = "ragged_batch"  # tensor: variable dims differ from the rest of the batch


class Rejected(Exception):
    """One request a pipeline cannot use: the label it is counted under and a detail for the caller."""

    def __init__(self, label: InvalidInput, detail: str) -> None:
        super().__init__(detail)
        self.label = label

    @property
    def reason(self) -> tuple[str, str]:
        """The ``Prepared.rejected`` value: (label, detail)."""
        return self.label.value, str(self)


class TensorDecodeError(ValueError):
    """A wire tensor whose datatype, shape and raw_data do not agree."""


DTYPE_BY_DATATYPE: Final[Mapping[pb.DataType.ValueType, np.dtype[Any]]] = {
    pb.DATA_TYPE_BOOL: np.dtype(np.bool_),
    pb.DATA_TYPE_UINT8: np.dtype(np.uint8),
    pb.DATA_TYPE_INT8: np.dtype(np.int8),
    pb.DATA_TYPE_INT32: np.dtype("<i4"),
    pb.DATA_TYPE_INT64: np.dtype("<i8"),
    pb.DATA_TYPE_FP16: np.dtype("<f2"),
    pb.DATA_TYPE_FP32: np.dtype("<f4"),
    pb.DATA_TYPE_FP64: np.dtype("<f8"),
    pb.DATA_TYPE_UINT64: np.dtype("<u8"),
    pb.DATA_TYPE_BYTES: np.dtype(object),
}
"""Wire DataType -> numpy dtype (little-endian). BF16 has no numpy dtype and is not decoded."""

DATATYPE_BY_DTYPE: Final[Mapping[str, pb.DataType.ValueType]] = {
    dtype.name: datatype for datatype, dtype in DTYPE_BY_DATATYPE.items()
}
"""Numpy dtype name (as in :class:`~inference.backends.base.TensorSpec`) -> wire DataType."""

MAX_DIMS: Final = 64
"""The most dims a wire tensor may have: numpy's limit (a tensor with more is refused, never reshaped)."""
_LENGTH = np.dtype("<u4")
_UINT64: Final = (1 << 64) - 1  # a negative int64 as protobuf writes it: two's complement, 64 bits
_OUTPUTS_TAG: Final = _varint(4 << 3 | 2)  # InferResponse.outputs: field 4, length-delimited
# By the dtype itself: ``dtype.name`` is computed in Python on every access, a few microseconds per tensor.
_DATATYPE_OF_DTYPE: Final[Mapping[np.dtype, pb.DataType.ValueType]] = {
    dtype: datatype for datatype, dtype in DTYPE_BY_DATATYPE.items()
}
_NAME_OF_DATATYPE: Final[Mapping[pb.DataType.ValueType, str]] = {
    datatype: dtype.name for datatype, dtype in DTYPE_BY_DATATYPE.items()
}
_NATIVE: Final[Mapping[np.dtype, np.dtype]] = {
    dtype: dtype.newbyteorder("=") for dtype in DTYPE_BY_DATATYPE.values()
}


@functools.lru_cache(maxsize=1024)
def _model_dtype(name: str) -> tuple[np.dtype[Any], str]:
    """A model input's dtype (as its TensorSpec names it) and that dtype's canonical name."""
    dtype = np.dtype(name)
    return dtype, dtype.name


def tensor_from_array(name: str, array: np.ndarray) -> pb.Tensor:
    """One numpy array as a wire Tensor (an object array holds ``bytes`` / ``str`` elements as BYTES)."""
    datatype, raw = wire_data(name, array)
    return pb.Tensor(name=name, datatype=datatype, shape=array.shape, raw_data=raw)


def wire_data(name: str, array: np.ndarray) -> tuple[pb.DataType.ValueType, bytes]:
    """The wire DataType of ``array`` and its elements as ``raw_data`` (little-endian, C order; BYTES
    elements length-prefixed); a TypeError names the tensor whose dtype has no wire type."""
    datatype = _DATATYPE_OF_DTYPE.get(array.dtype)
    if datatype is None:  # e.g. big-endian: the same wire type, converted below
        try:
            datatype = DATATYPE_BY_DTYPE[array.dtype.name]
        except KeyError:
            raise TypeError(f"tensor {name!r}: dtype {array.dtype} has no wire DataType") from None
        if datatype != pb.DATA_TYPE_BYTES:
            return datatype, np.ascontiguousarray(array, dtype=DTYPE_BY_DATATYPE[datatype]).tobytes()
    if datatype == pb.DATA_TYPE_BYTES:
        return datatype, encode_bytes([e.encode() if isinstance(e, str) else bytes(e) for e in array.ravel()])
    return datatype, array.tobytes()  # already the wire dtype: its elements in C order as they are


def output_bytes(name: str, array: np.ndarray) -> bytes:
    """``array`` as one entry of ``InferResponse.outputs``, serialized: the bytes that
    ``InferResponse(outputs=[tensor_from_array(name, array)])`` serializes to. Entries concatenated are a
    response with those outputs (see :func:`output_prefix`)."""
    datatype, raw = wire_data(name, array)
    return output_prefix(name, datatype, array.shape, len(raw)) + raw


@functools.lru_cache(maxsize=4096)  # bounded: the outputs served, by shape (ranking: one per top-k length)
def output_prefix(name: str, datatype: int, shape: tuple[int, ...], raw_length: int) -> bytes:
    """An ``InferResponse.outputs`` entry up to its raw_data: the field's tag and length, then the Tensor's
    name, datatype, shape and the tag and length of a raw_data of ``raw_length`` bytes, which follow it.

    Byte for byte what protobuf serializes: fields in number order, proto3 defaults (empty name, datatype
    0, no dims, empty raw_data) left out, the shape packed, a negative dim as ten bytes (int64).
    """
    tensor = bytearray()
    if name:
        encoded = name.encode()
        tensor += b"\x0a" + _varint(len(encoded)) + encoded
    if datatype:
        tensor += b"\x10" + _varint(datatype)
    if shape:
        dims = b"".join(_varint(d & _UINT64) for d in shape)
        tensor += b"\x1a" + _varint(len(dims)) + dims
    if raw_length:
        tensor += b"\x22" + _varint(raw_length)
    # the entry's length counts the raw_data the caller appends
    return _OUTPUTS_TAG + _varint(len(tensor) + raw_length) + bytes(tensor)


def array_from_tensor(tensor: pb.Tensor, raw_data: memoryview | None = None) -> np.ndarray:
    """A wire Tensor as a numpy array in native byte order; raises :class:`TensorDecodeError`.

    ``raw_data``: the tensor's raw_data as a view of the bytes it arrived in (tensor_spans.py), used in its
    place: a numeric array is then a view of that memory (read-only, no copy) where the byte order is the
    host's.
    """
    dtype = DTYPE_BY_DATATYPE.get(tensor.datatype)
    if dtype is None:
        raise TensorDecodeError(f"tensor {tensor.name!r}: datatype {tensor.datatype} is not supported")
    shape = tuple(tensor.shape)
    if len(shape) > MAX_DIMS:
        raise TensorDecodeError(f"tensor {tensor.name!r}: {len(shape)} dims, at most {MAX_DIMS}")
    if any(d < 0 for d in shape):
        raise TensorDecodeError(f"tensor {tensor.name!r}: negative dim in shape {list(shape)}")
    count = math.prod(shape)  # Python ints: a huge shape must not wrap around to a small count
    if dtype.kind == "O":
        data = tensor.raw_data if raw_data is None else bytes(raw_data)
        return np.array(decode_bytes(data, count), dtype=object).reshape(shape)
    buffer: bytes | memoryview = tensor.raw_data if raw_data is None else raw_data
    if len(buffer) != count * dtype.itemsize:
        raise TensorDecodeError(
            f"tensor {tensor.name!r}: raw_data is {len(buffer)} bytes, shape {list(shape)} of "
            f"{dtype.name} needs {count * dtype.itemsize}"
        )
    return np.frombuffer(buffer, dtype=dtype).astype(_NATIVE[dtype], copy=False).reshape(shape)


def encode_bytes(items: Sequence[bytes]) -> bytes:
    """KServe v2 BYTES encoding: each element as a 4-byte little-endian length, then its bytes."""
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


def decode_bytes(raw: bytes, count: int) -> list[bytes]:
    """Exactly ``count`` KServe v2 BYTES elements from ``raw``; raises :class:`TensorDecodeError`."""
    items: list[bytes] = []
    offset = 0
    for _ in range(count):
        if offset + 4 > len(raw):
            raise TensorDecodeError(f"BYTES data ends after {len(items)} of {count} elements")
        length = int(np.frombuffer(raw, dtype=_LENGTH, count=1, offset=offset)[0])
        offset += 4
        if offset + length > len(raw):
            raise TensorDecodeError(f"BYTES element {len(items)} runs past the end of the data")
        items.append(raw[offset : offset + length])
        offset += length
    if offset != len(raw):
        raise TensorDecodeError(f"{len(raw) - offset} bytes left after {count} BYTES elements")
    return items


def batch_slices(counts: Sequence[int]) -> list[slice]:
    """Consecutive row slices of the given sizes: [0:c0], [c0:c0+c1], ..."""
    ends = itertools.accumulate(counts)  # Python ints: np.cumsum costs ~10 us for a handful of counts
    return [slice(end - count, end) for end, count in zip(ends, counts, strict=True)]


class TensorPipeline:
    """KServe-style requests: ``InferRequest.inputs`` decoded, checked against the spec and stacked.

    Each request's tensors carry their own batch dim (shape ``[rows, *dims]``, at most ``max_batch_size``
    rows; a batch may hold more rows than that, the dispatcher cuts its backend calls); a model with
    ``max_batch_size`` 0 takes its dims as the full shape and serves one request per batch. Variable dims
    (-1) must agree across a batch, since a generic tensor cannot be padded without knowing the model: a
    request that disagrees with the first kept one is dropped as ``ragged_batch`` (the batcher should group
    such requests by shape).
    """

    kind = "tensor"

    def prepare(self, requests: Sequence[pb.InferRequest], spec: ModelSpec) -> Prepared:
        """Decode, check and stack each request's inputs."""
        return self._prepare(requests, spec, None)

    def prepare_views(
        self, requests: Sequence[pb.InferRequest], payloads: Sequence[Buffer], spec: ModelSpec
    ) -> Prepared:
        """:meth:`prepare`, reading each input's raw_data in ``payloads[i]``, the bytes ``requests[i]``
        arrived in (views of the frame), instead of copying it out of the parsed request.

        A batch then costs one copy (each request's rows into the batch array), and a batch of one request
        none: its inputs are read-only views of its payload, which they keep alive. A payload that does not
        encode its request (tensor_spans.py) is read from the parsed request, as :meth:`prepare` does; the
        checks, and the reasons a request is dropped for, are the same.
        """
        if len(payloads) != len(requests):
            raise ValueError(f"{len(payloads)} payloads for {len(requests)} requests")
        return self._prepare(requests, spec, payloads)

    def _prepare(
        self, requests: Sequence[pb.InferRequest], spec: ModelSpec, payloads: Sequence[Buffer] | None
    ) -> Prepared:
        batched = spec.max_batch_size > 0
        columns: dict[str, list[np.ndarray]] = {t.name: [] for t in spec.inputs}
        kept: list[int] = []
        counts: list[int] = []
        rejected: dict[int, tuple[str, str]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        viewed = 0  # kept requests whose arrays are views of their payload
        for index, request in enumerate(requests):
            if kept and not batched:
                rejected[index] = (InvalidInput.RAGGED_BATCH, f"model {spec.name} does not batch")
                continue
            wires = None if payloads is None else wire_inputs(request, payloads[index])
            decoded = None if wires is None else _decode_wire(wires, spec.inputs, batched)
            if decoded is None:  # no payload, or not a plain valid request: the checks that say why
                views = None if wires is None else [wire.raw_data for wire in wires]
                try:
                    decoded = _decode_inputs(request, spec, batched, views)
                except Rejected as exc:
                    rejected[index] = exc.reason
                    continue
            arrays, rows = decoded
            if shapes and any(a.shape[1:] != shapes[n] for n, a in arrays.items()):
                rejected[index] = (InvalidInput.RAGGED_BATCH, "input dims differ from the batch's")
                continue
            if batched and rows > spec.max_batch_size:
                # Only a request too large on its own: a batch of more rows than the model takes is the
                # batcher's doing, and the dispatcher sends it in several calls.
                rejected[index] = (
                    InvalidInput.TOO_LARGE,
                    f"{rows} rows, the model takes at most {spec.max_batch_size}",
                )
                continue
            shapes = {n: a.shape[1:] for n, a in arrays.items()}
            for name, array in arrays.items():
                columns[name].append(array)
            kept.append(index)
            counts.append(rows)
            viewed += wires is not None
        # One request read in place: its views are the batch (an array copied out of a parsed request is
        # copied once more, as always, so that the batch owns its memory).
        borrowed = viewed == 1 and len(kept) == 1
        inputs = {t.name: _stack(t, columns[t.name], batched, borrowed) for t in spec.inputs}
        elements = sum(int(a.size) for a in inputs.values())
        return Prepared(
            inputs=inputs,
            kept=kept,
            rows=batch_slices(counts) if batched else [slice(None)] * len(kept),
            rejected=rejected,
            real_elements=elements,
            padded_elements=elements,
        )

    def finish(self, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[list[pb.Tensor]]:
        """Each kept request's rows of every output, as wire tensors."""
        return [
            [tensor_from_array(name, array[rows]) for name, array in outputs.items()]
            for rows in prepared.rows
        ]

    def finish_bytes(self, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[bytes]:
        """:meth:`finish`, each request's tensors serialized as its ``InferResponse``."""
        return [
            b"".join([output_bytes(name, array[rows]) for name, array in outputs.items()])
            for rows in prepared.rows
        ]


@dataclass(frozen=True, slots=True)
class _InputPlan:
    """What the fast path checks a wire tensor against, for one model input (built once per input)."""

    name: str
    key: bytes  # the name as encoded
    rank: int
    dims: tuple[int, ...]  # the model's dims, -1 = any
    dtypes: Mapping[int, np.dtype[Any]]  # wire datatypes the input takes -> their dtype


@functools.lru_cache(maxsize=1024)  # bounded: the inputs of the models served, across reloads
def _input_plan(want: TensorSpec, batched: bool) -> _InputPlan:
    model_dtype, model_name = _model_dtype(want.dtype)
    dtypes = {
        int(datatype): dtype
        for datatype, dtype in DTYPE_BY_DATATYPE.items()
        # numeric, the model's dtype, and already in the host's byte order (no conversion to make)
        if dtype.kind != "O" and dtype.name == model_name and dtype == model_dtype and dtype == _NATIVE[dtype]
    }
    return _InputPlan(want.name, want.name.encode(), len(want.dims) + batched, want.dims, dtypes)


def _decode_wire(
    wires: Sequence[WireTensor], wanted: Sequence[TensorSpec], batched: bool
) -> tuple[dict[str, np.ndarray], int] | None:
    """The fast path of :func:`_decode_inputs` for tensors read off the wire: the arrays (views of the
    raw_data) when every check passes, None when any fails (that decoding says why, word for word)."""
    by_name = {wire.name: wire for wire in wires}  # the last of a name counts, as in _decode_inputs
    arrays: dict[str, np.ndarray] = {}
    rows = -1
    for want in wanted:
        plan = _input_plan(want, batched)
        wire = by_name.get(plan.key)
        if wire is None or len(wire.shape) != plan.rank or plan.rank > MAX_DIMS:
            return None
        dtype = plan.dtypes.get(wire.datatype)
        shape = wire.shape
        if dtype is None or any(d < 0 for d in shape):
            return None
        if len(wire.raw_data) != math.prod(shape) * dtype.itemsize:
            return None
        dims = shape[1:] if batched else shape
        if any(w != d and w != -1 for w, d in zip(plan.dims, dims, strict=True)):  # noqa: PLR1714
            return None
        count = shape[0] if batched else 1
        if count < 1 or rows not in (-1, count):
            return None
        rows = count
        array = np.frombuffer(wire.raw_data, dtype=dtype).reshape(shape)
        arrays[plan.name] = array if batched else array[np.newaxis]
    return (arrays, rows) if rows != -1 else None


def _decode_inputs(
    request: pb.InferRequest, spec: ModelSpec, batched: bool, views: Sequence[memoryview] | None
) -> tuple[dict[str, np.ndarray], int]:
    """The request's arrays by input name and its rows; ``views[i]``: raw_data of ``request.inputs[i]``."""
    inputs = request.inputs
    by_name = {t.name: (t, None if views is None else views[i]) for i, t in enumerate(inputs)}
    arrays: dict[str, np.ndarray] = {}
    rows: set[int] = set()
    for want in spec.inputs:
        found = by_name.get(want.name)
        if found is None:
            raise Rejected(InvalidInput.MISSING_INPUT, f"input {want.name!r} missing")
        tensor, raw_data = found
        rank = len(want.dims) + batched
        if len(tensor.shape) != rank:  # before decoding: numpy refuses some shapes (over 64 dims) outright
            raise Rejected(
                InvalidInput.BAD_TENSOR,
                f"input {want.name!r}: shape of {len(tensor.shape)} dims, the model takes {rank} "
                f"({'batch dim, then ' if batched else ''}dims {list(want.dims)})",
            )
        wire = _NAME_OF_DATATYPE.get(tensor.datatype)
        if wire is not None and wire != _model_dtype(want.dtype)[1]:  # refused before a byte is decoded
            raise Rejected(
                InvalidInput.BAD_TENSOR,
                f"input {want.name!r}: dtype {wire} where the model takes {want.dtype}",
            )
        try:
            array = array_from_tensor(tensor, raw_data)
        except TensorDecodeError as exc:
            raise Rejected(InvalidInput.BAD_TENSOR, str(exc)) from None
        problem = _shape_problem(array, want, batched)
        if problem:
            raise Rejected(InvalidInput.BAD_TENSOR, f"input {want.name!r}: {problem}")
        arrays[want.name] = array if batched else array[np.newaxis]
        rows.add(array.shape[0] if batched else 1)
    if len(rows) != 1:
        raise Rejected(InvalidInput.BAD_TENSOR, f"inputs disagree on the batch dim: {sorted(rows)}")
    return arrays, rows.pop()


def _shape_problem(array: np.ndarray, want: TensorSpec, batched: bool) -> str:
    if array.dtype != _model_dtype(want.dtype)[0]:
        return f"dtype {array.dtype} where the model takes {want.dtype}"
    dims = array.shape[1:] if batched else array.shape
    if batched and (array.ndim == 0 or array.shape[0] < 1):
        return "needs a batch dim of at least 1"
    if len(dims) != len(want.dims) or any(w not in (-1, d) for w, d in zip(want.dims, dims, strict=True)):
        return f"shape {list(array.shape)} does not fit dims {list(want.dims)}"
    return ""


def _stack(spec: TensorSpec, arrays: list[np.ndarray], batched: bool, borrowed: bool) -> np.ndarray:
    """The batch's array of one input; ``borrowed``: the one request's array itself, not a copy."""
    if not arrays:
        return np.zeros((0, *(max(d, 0) for d in spec.dims)), dtype=spec.dtype)
    stacked = arrays[0] if borrowed else np.concatenate(arrays, axis=0)
    return stacked if batched else stacked[0]
