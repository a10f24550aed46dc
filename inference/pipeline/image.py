"""Encoded images -> normalised NCHW pixels -> class probabilities and the top label.

Each image is decoded with Pillow in its declared format only (JPEG, PNG, WebP, or raw RGB8), checked
against its declared width and height, resized so its shorter side fits the model, and centre-cropped.
Normalisation (ImageNet mean and std) and the NHWC -> NCHW transpose run once over the whole batch.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Final

import numpy as np

from edgewire import pb
from edgewire.extras import optional_dependency
from inference.backends.base import ModelSpec
from inference.pipeline.base import Prepared
from inference.pipeline.tensor import (
    InvalidInput,
    Rejected,
    encode_bytes,
    output_prefix,
    tensor_from_array,
    wire_data,
)

with optional_dependency("agent-local", "gateway"):
    from PIL import Image, UnidentifiedImageError

MAX_PIXELS: Final = 40_000_000
"""Largest image decoded, checked from the header before decoding (a decompression bomb is refused)."""
MEAN: Final = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD: Final = np.array([0.229, 0.224, 0.225], dtype=np.float32)
PROBS = "probs"
LABEL = "label"
_FORMATS: Final[Mapping[int, tuple[str, ...]]] = {
    pb.IMAGE_FORMAT_JPEG: ("JPEG",),
    pb.IMAGE_FORMAT_PNG: ("PNG",),
    pb.IMAGE_FORMAT_WEBP: ("WEBP",),
    pb.IMAGE_FORMAT_UNSPECIFIED: ("JPEG", "PNG", "WEBP"),
}
_DECODE_ERRORS: Final = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


def decode_image(image: pb.ImageInput, size: int) -> np.ndarray:
    """One image as uint8 HWC RGB ``size`` x ``size``: shorter side resized to ``size``, centre-cropped.

    Raises :class:`Rejected` (``bad_image``, ``size_mismatch`` or ``too_large``).
    """
    width, height = image.width, image.height
    if width * height > MAX_PIXELS:
        raise Rejected(InvalidInput.TOO_LARGE, f"{width}x{height} is over {MAX_PIXELS} pixels")
    if image.format == pb.IMAGE_FORMAT_RAW_RGB8:
        if len(image.data) != width * height * 3 or width * height == 0:
            raise Rejected(
                InvalidInput.SIZE_MISMATCH, f"{len(image.data)} bytes of RGB8 for a {width}x{height} image"
            )
        pixels = np.frombuffer(image.data, dtype=np.uint8).reshape(height, width, 3)
        return _fit(Image.fromarray(pixels, "RGB"), size)
    formats = _FORMATS.get(image.format)
    if formats is None:
        raise Rejected(InvalidInput.BAD_IMAGE, f"image format {image.format} is not supported")
    try:
        with Image.open(io.BytesIO(image.data), formats=formats) as opened:
            if opened.size != (width, height):
                raise Rejected(
                    InvalidInput.SIZE_MISMATCH,
                    f"decoded {opened.size[0]}x{opened.size[1]}, declared {width}x{height}",
                )
            return _fit(opened.convert("RGB"), size)
    except (
        UnidentifiedImageError
    ):  # its message is "cannot identify image file <_io.BytesIO object at 0x...>"
        raise Rejected(InvalidInput.BAD_IMAGE, f"not a decodable {' or '.join(formats)} image") from None
    except _DECODE_ERRORS as exc:
        raise Rejected(InvalidInput.BAD_IMAGE, f"cannot decode: {exc}") from None


def normalise(images: np.ndarray) -> np.ndarray:
    """A uint8 NHWC batch as float32 NCHW with ImageNet mean and std."""
    scaled = (images.astype(np.float32) * np.float32(1 / 255) - MEAN) / STD
    return np.ascontiguousarray(scaled.transpose(0, 3, 1, 2))


def _fit(image: Image.Image, size: int) -> np.ndarray:
    width, height = image.size
    scale = size / min(width, height)
    resized = image.resize(
        (max(size, round(width * scale)), max(size, round(height * scale))), Image.Resampling.BILINEAR
    )
    left = (resized.width - size) // 2
    top = (resized.height - size) // 2
    return np.asarray(resized.crop((left, top, left + size, top + size)), dtype=np.uint8)


class ImagePipeline:
    """Encoded images in, ``probs`` (FP32 [classes]) and ``label`` (BYTES [1]) out per request.

    Class names come from the model's ``labels`` parameter (comma-separated); without one, ``class_<i>``.
    """

    kind = "image"

    def prepare(self, requests: Sequence[pb.InferRequest], spec: ModelSpec) -> Prepared:
        """Decode each image, then normalise the batch in one pass."""
        (pixels,) = spec.inputs
        channels, height, width = pixels.dims
        if channels != 3 or height != width:
            raise ValueError(
                f"model {spec.name}: input {pixels.name} must be [3, S, S], got {list(pixels.dims)}"
            )
        decoded: list[np.ndarray] = []
        kept: list[int] = []
        rejected: dict[int, tuple[str, str]] = {}
        for index, request in enumerate(requests):
            try:
                decoded.append(decode_image(request.image, height))
            except Rejected as exc:
                rejected[index] = exc.reason
                continue
            kept.append(index)
        batch = np.stack(decoded) if decoded else np.zeros((0, height, width, 3), dtype=np.uint8)
        tensor = normalise(batch)
        return Prepared(
            inputs={pixels.name: tensor},
            kept=kept,
            rows=[slice(i, i + 1) for i in range(len(kept))],
            rejected=rejected,
            real_elements=int(tensor.size),
            padded_elements=int(tensor.size),
            spec=spec,  # finish names the classes from the spec's labels
        )

    def finish(self, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[list[pb.Tensor]]:
        """Softmax over the batch in one pass; per request its probabilities and the argmax's label."""
        probs, top, names = classified(prepared, outputs)
        results: list[list[pb.Tensor]] = []
        for rows in prepared.rows:
            row = rows.start
            label = names[int(top[row])].encode()
            results.append(
                [
                    tensor_from_array(PROBS, probs[row]),
                    pb.Tensor(
                        name=LABEL, datatype=pb.DATA_TYPE_BYTES, shape=[1], raw_data=encode_bytes([label])
                    ),
                ]
            )
        return results

    def finish_bytes(self, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[bytes]:
        """:meth:`finish`, each request's answer serialized: the probabilities converted once, each
        label's tensor once per batch."""
        probs, top, names = classified(prepared, outputs)
        datatype, raw = wire_data(PROBS, probs)
        count = len(probs)
        size = len(raw) // count if count else 0  # bytes per row
        prefix = output_prefix(PROBS, datatype, probs.shape[1:], size)
        labels: dict[int, bytes] = {}
        answers: list[bytes] = []
        for rows in prepared.rows:
            best = int(top[rows.start])  # an IndexError for a row the batch lacks, as probs[row] raises
            row = rows.start % count
            label = labels.get(best)
            if label is None:
                label = labels[best] = _label_output(names[best])
            answers.append(b"".join((prefix, raw[row * size : (row + 1) * size], label)))
        return answers


def classified(
    prepared: Prepared, outputs: Mapping[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """The batch's softmax (float32), each row's argmax and the class names."""
    (logits,) = outputs.values()
    logits = np.asarray(logits, dtype=np.float32)
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = shifted / shifted.sum(axis=1, keepdims=True)
    top = probs.argmax(axis=1)
    names = label_names(prepared.spec) if prepared.spec is not None else ()
    if len(names) != logits.shape[1]:
        names = tuple(f"class_{i}" for i in range(logits.shape[1]))
    return probs, top, names


def _label_output(name: str) -> bytes:
    """The ``label`` tensor of a class, as an ``InferResponse.outputs`` entry."""
    raw = encode_bytes([name.encode()])
    return output_prefix(LABEL, pb.DATA_TYPE_BYTES, (1,), len(raw)) + raw


def label_names(spec: ModelSpec) -> tuple[str, ...]:
    """Class names from the model's ``labels`` parameter (comma-separated), else ``class_<i>``."""
    classes = spec.outputs[0].dims[-1]
    names = tuple(n.strip() for n in spec.parameters.get("labels", "").split(",") if n.strip())
    return names if len(names) == classes else tuple(f"class_{i}" for i in range(classes))
