"""The text pipeline: WordPiece ids equal a reference implementation, bucketed padding, truncation, norms."""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from functools import cache

import numpy as np
import pytest

from edge_agent.synthetic import SyntheticTraffic
from edgewire import pb
from inference.pipeline import tokenizer
from inference.pipeline.tensor import InvalidInput
from inference.pipeline.text import (
    CACHED_CHARS,
    LENGTH_BUCKETS,
    TextPipeline,
    TokenCache,
    length_bucket,
    tokenize,
)
from inference.pipeline.textsize import MAX_TEXT_CHARS, estimated_tokens
from tests.inference.pipeline.specs import demo_spec

SPEC = demo_spec("text-encoder")


@cache
def vocab() -> dict[str, int]:
    path = tokenizer.VOCAB_DIR / f"{tokenizer.DEFAULT_TOKENIZER}.json"
    entries: dict[str, int] = json.loads(path.read_text())["model"]["vocab"]
    return entries


def _is_cjk(char: str) -> bool:
    cp = ord(char)
    return any(
        lo <= cp <= hi
        for lo, hi in (
            (0x4E00, 0x9FFF),
            (0x3400, 0x4DBF),
            (0x20000, 0x2A6DF),
            (0x2A700, 0x2B73F),
            (0x2B740, 0x2B81F),
            (0x2B820, 0x2CEAF),
            (0xF900, 0xFAFF),
            (0x2F800, 0x2FA1F),
        )
    )


def _is_punctuation(char: str) -> bool:
    cp = ord(char)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def reference_words(text: str) -> list[str]:
    """BERT's basic tokenizer, written out: NFKC, drop controls, CJK apart, lower case, split punctuation."""
    text = unicodedata.normalize("NFKC", text)
    chars = []
    for char in text:
        if char in "\t\n\r" or unicodedata.category(char) == "Zs":
            chars.append(" ")
        elif ord(char) == 0 or ord(char) == 0xFFFD or unicodedata.category(char) in ("Cc", "Cf"):
            continue
        elif _is_cjk(char):
            chars.append(f" {char} ")
        else:
            chars.append(char)
    words: list[str] = []
    for chunk in "".join(chars).lower().split():
        current = ""
        for char in chunk:
            if _is_punctuation(char):
                words.extend([current, char] if current else [char])
                current = ""
            else:
                current += char
        if current:
            words.append(current)
    return words


def reference_pieces(word: str) -> list[str]:
    """Greedy longest-match-first WordPiece; a word it cannot cover is one [UNK]."""
    if len(word) > 100:
        return ["[UNK]"]
    pieces: list[str] = []
    start = 0
    while start < len(word):
        for end in range(len(word), start, -1):
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab():
                pieces.append(piece)
                start = end
                break
        else:
            return ["[UNK]"]
    return pieces


def ids(text: str, max_tokens: int = 128) -> list[int]:
    """Reference ids of one text: [CLS], then the pieces of every word, cut to ``max_tokens``."""
    pieces = ["[CLS]", *(p for w in reference_words(text) for p in reference_pieces(w))]
    return [vocab()[p] for p in pieces[:max_tokens]]


def text_request(text: str) -> pb.InferRequest:
    return pb.InferRequest(model_name="text-encoder", kind=pb.REQUEST_KIND_TEXT, text=pb.TextQuery(text=text))


TEXTS = [
    "Wireless Earbuds, Pro-Max!",
    "  USB_C  cable 2m ",
    "蓝牙耳机 降噪",
    "iPhone15ケース",
    "หูฟังไร้สาย กันน้ำ",
    "\uff2e\uff29\uff2b\uff25\u3000Air",  # full-width NIKE, ideographic space
    "무선 이어폰",
    "Genuine xiaomi power bank (waterproof). 30-day returns; customs duties prepaid.",
    "zzqx unknownword ñandú \u200b tab\there",
]


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_match_the_reference_wordpiece(text: str) -> None:
    """Fixed strings give exactly the ids of the reference implementation above."""
    (got,), (truncated,) = tokenize([text], SPEC)
    assert got.dtype == np.int64
    assert got.tolist() == ids(text)
    assert not truncated


def test_shop_words_are_whole_tokens() -> None:
    """The shipped vocabulary covers the synthetic corpus: product words need no [UNK] and no splitting."""
    (got,), _ = tokenize(["xiaomi wireless earbuds 小米"], SPEC)
    assert got.tolist() == [
        tokenizer.CLS_ID,
        *(vocab()[w] for w in ["xiaomi", "wireless", "earbuds", "小", "米"]),
    ]
    assert tokenizer.UNK_ID not in got.tolist()


def test_unknown_tokenizer_and_too_small_model_vocabulary_are_refused() -> None:
    with pytest.raises(ValueError, match="no file"):
        tokenize(["x"], dataclasses.replace(SPEC, parameters={**SPEC.parameters, "tokenizer": "nope"}))
    with pytest.raises(ValueError, match="entries, the model 100"):
        tokenize(["x"], dataclasses.replace(SPEC, parameters={**SPEC.parameters, "vocab_size": "100"}))


def test_long_text_is_truncated_and_served() -> None:
    """A 300-word text is cut to 128 tokens with [CLS], kept in the batch, and counted."""
    pipeline = TextPipeline()
    text = " ".join(f"w{i}" for i in range(300))
    prepared = pipeline.prepare([text_request(text)], SPEC)
    assert prepared.kept == [0]
    assert prepared.inputs["input_ids"].shape == (1, 128)
    assert prepared.inputs["input_ids"][0].tolist() == ids(text)
    assert prepared.truncated == 1  # the gateway counts it: hkgw_input_truncated_total


def test_huge_text_is_refused_before_tokenizing() -> None:
    """Over MAX_TEXT_CHARS: too_large with the size in the reason; the other requests are served."""
    requests = [text_request("a" * (MAX_TEXT_CHARS + 1)), text_request("bag")]
    prepared = TextPipeline().prepare(requests, SPEC)
    assert prepared.kept == [1]
    label, reason = prepared.rejected[0]
    assert label == InvalidInput.TOO_LARGE and str(MAX_TEXT_CHARS + 1) in reason


def test_batch_is_padded_to_a_length_bucket() -> None:
    """The batch is as wide as the bucket above its longest text; the mask marks real tokens."""
    texts = ["running shoes", " ".join(["earbuds"] * 20)]
    prepared = TextPipeline().prepare([text_request(t) for t in texts], SPEC)
    input_ids, mask = prepared.inputs["input_ids"], prepared.inputs["attention_mask"]
    assert input_ids.shape == mask.shape == (2, 24)  # 21 tokens -> the 24 bucket
    assert mask.sum(axis=1).tolist() == [3, 21]
    assert input_ids[0].tolist() == ids("running shoes") + [0] * 21
    assert (prepared.real_elements, prepared.padded_elements) == (24, 48)


def test_length_estimate_mostly_lands_in_the_real_bucket() -> None:
    """On the synthetic text mix the dispatcher's cheap estimate picks the tokenizer's length bucket for
    at least 85% of texts (measured: 94% over 2,048), and is never off by more than one bucket for 97%."""
    texts = [s.request.text.text for s in SyntheticTraffic(5).take(3000) if s.request.HasField("text")]
    assert len(texts) > 300
    real = [len(ids(text)) for text in texts]
    steps = [
        abs(LENGTH_BUCKETS.index(length_bucket(estimated_tokens(t))) - LENGTH_BUCKETS.index(length_bucket(n)))
        for t, n in zip(texts, real, strict=True)
    ]
    assert steps.count(0) >= 0.85 * len(texts), steps.count(0) / len(texts)
    assert sum(s <= 1 for s in steps) >= 0.97 * len(texts)


def test_empty_text_is_rejected_and_the_rest_served() -> None:
    """Empty and blank texts are dropped as empty_text; the other requests keep their rows."""
    requests = [
        text_request("running shoes"),
        text_request(""),
        text_request(" \t\u200b "),
        text_request("shoes"),
    ]
    prepared = TextPipeline().prepare(requests, SPEC)
    assert prepared.kept == [0, 3]
    assert {i: label for i, (label, _) in prepared.rejected.items()} == {
        1: InvalidInput.EMPTY_TEXT,
        2: InvalidInput.EMPTY_TEXT,
    }
    assert prepared.inputs["input_ids"][:, :3].tolist() == [ids("running shoes"), [*ids("shoes"), 0]]


def test_embeddings_are_l2_normalised() -> None:
    """Each embedding comes back with unit length and its direction unchanged."""
    requests = [text_request("a"), text_request("b")]
    pipeline = TextPipeline()
    prepared = pipeline.prepare(requests, SPEC)
    raw = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32) * 5
    results = pipeline.finish(prepared, {"embedding": raw})
    for row, ((tensor,),) in zip(raw, zip(results, strict=True), strict=True):
        got = np.frombuffer(tensor.raw_data, dtype="<f4")
        assert (tensor.name, list(tensor.shape), tensor.datatype) == ("embedding", [64], pb.DATA_TYPE_FP32)
        np.testing.assert_allclose(got, row / np.linalg.norm(row), rtol=1e-5)


def test_token_cache_gives_the_tokenizers_own_ids_and_stays_bounded() -> None:
    """Repeated, new, truncated and long texts in one batch: the cache's answer is the library's for every
    one, asked again hits, long texts are not kept, and the least recently used text goes first."""
    encoder = tokenizer.load(tokenizer.DEFAULT_TOKENIZER, 16)
    cache = TokenCache(entries=3)
    long_text = "wireless earbuds " * 40  # over CACHED_CHARS, and cut to 16 tokens
    texts = ["rice cooker", "sony keyboard", "rice cooker", long_text, "小米 earbuds"]
    reference = encoder.encode_batch(texts)
    got, cut = cache.encode(encoder, texts)
    assert [g.tolist() for g in got] == [r.ids for r in reference]
    assert cut == [bool(r.overflowing) for r in reference] == [False, False, False, True, False]
    assert len(long_text) > CACHED_CHARS
    assert (cache.hits, cache.misses, len(cache)) == (0, 5, 3)  # the long one is not kept
    again, cut_again = cache.encode(encoder, ["sony keyboard", "rice cooker", "小米 earbuds", long_text])
    assert [a.tolist() for a in again] == [reference[i].ids for i in (1, 0, 4, 3)]
    assert cut_again == [False, False, False, True]
    assert (cache.hits, cache.misses) == (3, 6)
    assert not again[0].flags.writeable  # shared between batches: nobody may write into it
    cache.encode(encoder, ["phone charger"])  # "sony keyboard" is the least recently used now
    cache.encode(encoder, ["sony keyboard"])
    assert cache.misses == 8
    assert len(cache) == 3
