"""The text pipeline: deterministic token ids, bucketed padding, truncation, normalised embeddings."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from edgewire import pb
from gateway.pipeline.tensor import InvalidInput
from gateway.pipeline.text import TextPipeline, tokenize
from tests.gateway.pipeline.specs import demo_spec

SPEC = demo_spec("text-encoder")


def ids(*tokens: str) -> list[int]:
    """Reference ids: [CLS], then 2 + crc32(token) % 8190 per token."""
    return [1, *(2 + zlib.crc32(t.encode("utf-8")) % 8190 for t in tokens)]


def text_request(text: str) -> pb.InferRequest:
    return pb.InferRequest(model_name="text-encoder", kind=pb.REQUEST_KIND_TEXT, text=pb.TextQuery(text=text))


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("Wireless Earbuds, Pro-Max!", ("wireless", "earbuds", "pro", "max")),
        ("  USB_C  cable 2m ", ("usb", "c", "cable", "2m")),
        ("蓝牙耳机", ("蓝", "牙", "耳", "机")),
        ("iPhone15ケース", ("iphone15", "ケ", "ー", "ス")),
        ("หูฟัง", ("ห", "ู", "ฟ", "ั", "ง")),
        ("\uff2e\uff29\uff2b\uff25\u3000Air", ("nike", "air")),  # full-width NIKE, ideographic space
        ("무선 이어폰", ("무선", "이어폰")),
    ],
)
def test_token_ids_match_reference(text: str, tokens: tuple[str, ...]) -> None:
    """Fixed strings give the reference ids: lower-cased words, one token per CJK / kana / Thai char."""
    got, truncated = tokenize(text, 8192, 128)
    assert got.tolist() == ids(*tokens)
    assert got.dtype == np.int64
    assert not truncated


def test_long_text_is_truncated_and_served() -> None:
    """A 300-word text is cut to 128 tokens with [CLS], kept in the batch, and counted."""
    pipeline = TextPipeline()
    prepared = pipeline.prepare([text_request(" ".join(f"w{i}" for i in range(300)))], SPEC)
    assert prepared.kept == [0]
    assert prepared.inputs["input_ids"].shape == (1, 128)
    assert prepared.inputs["input_ids"][0].tolist() == ids(*(f"w{i}" for i in range(127)))
    assert pipeline.truncated == 1


def test_batch_is_padded_to_a_length_bucket() -> None:
    """The batch is as wide as the bucket above its longest text; the mask marks real tokens."""
    texts = ["red shoes", " ".join(["word"] * 20)]
    prepared = TextPipeline().prepare([text_request(t) for t in texts], SPEC)
    input_ids, mask = prepared.inputs["input_ids"], prepared.inputs["attention_mask"]
    assert input_ids.shape == mask.shape == (2, 32)
    assert mask.sum(axis=1).tolist() == [3, 21]
    assert input_ids[0].tolist() == ids("red", "shoes") + [0] * 29
    assert (prepared.real_elements, prepared.padded_elements) == (24, 64)


def test_empty_text_is_rejected_and_the_rest_served() -> None:
    """Empty and punctuation-only texts are dropped as empty_text; the other requests keep their rows."""
    requests = [text_request("running shoes"), text_request(""), text_request(" ?! "), text_request("bag")]
    prepared = TextPipeline().prepare(requests, SPEC)
    assert prepared.kept == [0, 3]
    assert {i: label for i, (label, _) in prepared.rejected.items()} == {
        1: InvalidInput.EMPTY_TEXT,
        2: InvalidInput.EMPTY_TEXT,
    }
    assert prepared.inputs["input_ids"][:, :3].tolist() == [ids("running", "shoes"), [*ids("bag"), 0]]


def test_embeddings_are_l2_normalised() -> None:
    """Each embedding comes back with unit length and its direction unchanged."""
    requests = [text_request("a"), text_request("b")]
    pipeline = TextPipeline()
    prepared = pipeline.prepare(requests, SPEC)
    raw = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32) * 5
    results = pipeline.finish(prepared, {"embedding": raw}, requests)
    for row, ((tensor,),) in zip(raw, zip(results, strict=True), strict=True):
        got = np.frombuffer(tensor.raw_data, dtype="<f4")
        assert (tensor.name, list(tensor.shape), tensor.datatype) == ("embedding", [64], pb.DATA_TYPE_FP32)
        np.testing.assert_allclose(got, row / np.linalg.norm(row), rtol=1e-5)
