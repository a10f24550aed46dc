"""The image pipeline: decode, resize, centre-crop and normalise; malformed images dropped with a label."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from edge_agent.synthetic.images import product_photo
from edgewire import pb
from inference.models import IMAGE_LABELS
from inference.pipeline.image import ImagePipeline
from inference.pipeline.tensor import InvalidInput, decode_bytes
from tests.inference.pipeline.specs import demo_spec

SPEC = demo_spec("image-classifier")
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    return product_photo(np.random.default_rng(seed), width, height)


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(jpeg(width, height))).save(out, format="PNG")
    return out.getvalue()


def image_request(
    data: bytes, width: int, height: int, fmt: pb.ImageFormat.ValueType = pb.IMAGE_FORMAT_JPEG
) -> pb.InferRequest:
    return pb.InferRequest(
        model_name="image-classifier",
        kind=pb.REQUEST_KIND_IMAGE,
        image=pb.ImageInput(data=data, format=fmt, width=width, height=height),
    )


def reference_pixels(data: bytes) -> np.ndarray:
    """CHW float32: shorter side to 64 (bilinear), centre 64x64, each channel (x/255 - mean) / std."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = image.size
    size = (64, round(h * 64 / w)) if w <= h else (round(w * 64 / h), 64)
    image = image.resize(size, Image.Resampling.BILINEAR)
    left, top = (image.width - 64) // 2, (image.height - 64) // 2
    pixels = np.asarray(image.crop((left, top, left + 64, top + 64)), dtype=np.float64) / 255.0
    channels = [(pixels[:, :, c] - MEAN[c]) / STD[c] for c in range(3)]
    return np.stack(channels).astype(np.float32)


@pytest.mark.parametrize(("width", "height"), [(224, 224), (640, 480), (300, 500)])
def test_jpeg_pixels_match_reference(width: int, height: int) -> None:
    """A fixed JPEG becomes the tensor the Pillow + numpy reference computes."""
    data = jpeg(width, height)
    prepared = ImagePipeline().prepare([image_request(data, width, height)], SPEC)
    assert prepared.inputs["pixels"].shape == (1, 3, 64, 64)
    assert prepared.inputs["pixels"].dtype == np.float32
    np.testing.assert_allclose(prepared.inputs["pixels"][0], reference_pixels(data), atol=1e-5)


def test_png_is_decoded() -> None:
    """PNG images declared as PNG are served like JPEGs."""
    data = png(320, 320)
    prepared = ImagePipeline().prepare([image_request(data, 320, 320, pb.IMAGE_FORMAT_PNG)], SPEC)
    np.testing.assert_allclose(prepared.inputs["pixels"][0], reference_pixels(data), atol=1e-5)


def test_raw_rgb8_is_accepted() -> None:
    """Raw RGB8 bytes of the declared size are used as the decoded image."""
    pixels = np.asarray(Image.open(io.BytesIO(jpeg(96, 64))).convert("RGB"))
    request = image_request(pixels.tobytes(), 96, 64, pb.IMAGE_FORMAT_RAW_RGB8)
    prepared = ImagePipeline().prepare([request], SPEC)
    assert prepared.kept == [0]
    assert prepared.inputs["pixels"].shape == (1, 3, 64, 64)


@pytest.mark.parametrize(
    ("request_", "label"),
    [
        (image_request(b"\xff\xd8\xff\xe0 not really a jpeg", 224, 224), InvalidInput.BAD_IMAGE),
        (image_request(jpeg(224, 224)[:300], 224, 224), InvalidInput.BAD_IMAGE),
        (image_request(jpeg(224, 224), 224, 224, pb.IMAGE_FORMAT_PNG), InvalidInput.BAD_IMAGE),
        (image_request(jpeg(320, 240), 240, 320), InvalidInput.SIZE_MISMATCH),
        (image_request(b"\x00" * 10, 2, 2, pb.IMAGE_FORMAT_RAW_RGB8), InvalidInput.SIZE_MISMATCH),
        (image_request(jpeg(64, 64), 10_000, 10_000), InvalidInput.TOO_LARGE),
    ],
    ids=["garbage", "truncated", "wrong_format", "size_mismatch", "raw_size", "too_large"],
)
def test_malformed_image_is_rejected_and_the_rest_served(
    request_: pb.InferRequest, label: InvalidInput
) -> None:
    """A malformed image is dropped with its label; the good images around it are served."""
    good = jpeg(224, 224, seed=1)
    requests = [image_request(good, 224, 224), request_, image_request(good, 224, 224)]
    prepared = ImagePipeline().prepare(requests, SPEC)
    assert prepared.kept == [0, 2]
    assert prepared.rejected[1][0] == label
    assert prepared.inputs["pixels"].shape == (2, 3, 64, 64)
    np.testing.assert_allclose(prepared.inputs["pixels"][1], reference_pixels(good), atol=1e-5)


@pytest.mark.parametrize(
    "request_",
    [
        image_request(b"\xff\xd8\xff\xe0 not really a jpeg", 224, 224),
        image_request(b"GIF89a not a format the gateway takes", 224, 224),
        image_request(jpeg(224, 224), 224, 224, pb.IMAGE_FORMAT_PNG),
    ],
    ids=["garbage", "gif", "wrong_format"],
)
def test_an_undecodable_image_is_refused_in_plain_words(request_: pb.InferRequest) -> None:
    """The detail an agent's operator reads names the formats tried, never a Python object's repr."""
    prepared = ImagePipeline().prepare([request_], SPEC)
    label, detail = prepared.rejected[0]
    assert label == InvalidInput.BAD_IMAGE
    assert "0x" not in detail and "object" not in detail and "BytesIO" not in detail, detail


def test_probabilities_and_label_of_the_argmax() -> None:
    """finish gives softmax probabilities and the name of the most likely class as KServe BYTES."""
    requests = [image_request(jpeg(224, 224), 224, 224), image_request(jpeg(224, 224, seed=2), 224, 224)]
    pipeline = ImagePipeline()
    prepared = pipeline.prepare(requests, SPEC)
    logits = np.array([np.arange(10.0), np.arange(10.0)[::-1]], dtype=np.float32)
    results = pipeline.finish(prepared, {"logits": logits})
    for row, (probs, label) in zip(logits, results, strict=True):
        want = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        np.testing.assert_allclose(np.frombuffer(probs.raw_data, dtype="<f4"), want, rtol=1e-5)
        assert (label.datatype, list(label.shape)) == (pb.DATA_TYPE_BYTES, [1])
        assert decode_bytes(label.raw_data, 1) == [IMAGE_LABELS[int(row.argmax())].encode()]
