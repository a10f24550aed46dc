"""The text pipeline's cached, joined layout and the token estimate's string-method count give, bit for bit,
what the straightforward versions give: the library's ids laid out with a mask over the batch, and one
regex pass."""

from __future__ import annotations

import re

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edgewire import pb
from inference.pipeline import tokenizer
from inference.pipeline.tensor import InvalidInput
from inference.pipeline.text import LENGTH_BUCKETS, TextPipeline, TokenCache, length_bucket
from inference.pipeline.textsize import MAX_TEXT_CHARS, SCAN_CHARS, estimated_tokens
from tests.inference.pipeline.specs import demo_spec

SPEC = demo_spec("text-encoder")
_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_PIECES = re.compile(f"[{_CJK}]|[^\\W_{_CJK}]+|[^\\w\\s]|_")

# ASCII words and punctuation, other spaces, each end of the three ideograph ranges and their neighbours,
# Hangul, kana, accented Latin, a combining mark, a supplementary ideograph, full-width letters
EDGES = list(
    "ab z09 _-.,!?\t\n\x1c\x00é\u00df\u0301\u3000\u33ff\u3400\u4dbf\u4dc0\u4dff\u4e00米\u9fff\ua000"
    "\uac00한\ud7a3\uf8ff\uf900\ufaff\ufb00\uff21カー\U00020000"
)
edge_texts = st.text(alphabet=st.sampled_from(EDGES), max_size=60)


def regex_estimate(text: str) -> int:
    """estimated_tokens as one regex pass."""
    pieces = len(_PIECES.findall(text, 0, SCAN_CHARS))
    if len(text) > SCAN_CHARS:
        pieces = round(pieces * len(text) / SCAN_CHARS)
    return 1 + pieces


@settings(max_examples=600, deadline=None)
@given(text=st.one_of(edge_texts, st.text(max_size=40)))
def test_estimate_counts_as_the_regex(text: str) -> None:
    assert estimated_tokens(text) == regex_estimate(text)


@given(word=st.sampled_from(["bag", "米", "한국", "é"]), count=st.integers(SCAN_CHARS // 4 - 2, SCAN_CHARS))
def test_estimate_of_long_texts_counts_as_the_regex(word: str, count: int) -> None:
    """Around SCAN_CHARS: the scaled count of the first SCAN_CHARS characters, as before."""
    text = " ".join([word] * count)
    assert estimated_tokens(text) == regex_estimate(text)


def reference_prepare(
    texts: list[str], max_tokens: int = 128
) -> tuple[list[int], dict[int, str], dict[str, object]]:
    """The batch laid out from the library's own ids: a mask over the batch, padded to the bucket."""
    encoder = tokenizer.load(tokenizer.DEFAULT_TOKENIZER, max_tokens)
    rejected = {i: InvalidInput.TOO_LARGE for i, t in enumerate(texts) if len(t) > MAX_TEXT_CHARS}
    candidates = [i for i in range(len(texts)) if i not in rejected]
    encodings = encoder.encode_batch([texts[i] for i in candidates]) if candidates else []
    kept, sequences, truncated = [], [], 0
    for index, encoding in zip(candidates, encodings, strict=True):
        if len(encoding.ids) <= 1:
            rejected[index] = InvalidInput.EMPTY_TEXT
            continue
        kept.append(index)
        sequences.append(np.asarray(encoding.ids, dtype=np.int64))
        truncated += bool(encoding.overflowing)
    lengths = np.asarray([len(s) for s in sequences], dtype=np.int64)
    width = length_bucket(int(lengths.max(initial=0)))
    mask = np.arange(width) < lengths[:, np.newaxis]
    input_ids = np.full((len(kept), width), tokenizer.PAD_ID, dtype=np.int64)
    if kept:
        input_ids[mask] = np.concatenate(sequences)
    numbers = {
        "input_ids": input_ids,
        "attention_mask": mask.astype(np.int64),
        "real": int(lengths.sum()),
        "truncated": truncated,
    }
    return kept, rejected, numbers


words = st.sampled_from(
    [
        "",
        " ",
        "bag",
        "Wireless",
        "earbuds,",
        "蓝牙耳机",
        "ケース",
        "무선",
        "ñandú",
        "\u200b",
        "zzqx",
        "USB_C",
        "!!",
    ]
)
batch_texts = st.lists(
    st.one_of(
        st.lists(words, max_size=8).map(" ".join),
        st.integers(20, 140).map(lambda n: " ".join(["shoes"] * n)),  # over 128 tokens, or over CACHED_CHARS
        st.just("a" * (MAX_TEXT_CHARS + 1)),
        edge_texts,
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(texts=batch_texts)
def test_prepare_lays_out_the_librarys_ids_as_a_mask_over_the_batch(texts: list[str]) -> None:
    """A batch prepared cold (texts new to the cache) and again warm equals the reference layout: the
    same ids, mask, dtypes, shapes, kept and refused requests, and counts; the inputs are writeable."""
    kept, rejected, want = reference_prepare(texts)
    requests = [pb.InferRequest(model_name="text-encoder", text=pb.TextQuery(text=t)) for t in texts]
    for _ in range(2):
        got = TextPipeline().prepare(requests, SPEC)
        assert got.kept == kept
        assert got.rows == [slice(i, i + 1) for i in range(len(kept))]
        assert {i: label for i, (label, _) in got.rejected.items()} == rejected
        for name in ("input_ids", "attention_mask"):
            array, expected = got.inputs[name], want[name]
            assert isinstance(expected, np.ndarray)
            assert (array.dtype, array.shape) == (expected.dtype, expected.shape)
            assert array.tobytes() == expected.tobytes()
            assert array.flags.writeable and array.flags.c_contiguous
        assert got.inputs["input_ids"].shape[1] in (*LENGTH_BUCKETS, 4)
        assert (got.real_elements, got.truncated) == (want["real"], want["truncated"])
        assert got.padded_elements == got.inputs["input_ids"].size


@settings(max_examples=100, deadline=None)
@given(
    rounds=st.lists(
        st.lists(st.sampled_from(["bag", "red bag", "小米", "", "a b c d e"] * 2), max_size=6), max_size=8
    )
)
def test_a_small_cache_gives_the_librarys_ids_while_it_evicts(rounds: list[list[str]]) -> None:
    """Batch after batch through a cache of two texts: hits, misses and evictions all give the library's
    ids and cut flags, and it never holds more than two."""
    encoder = tokenizer.load(tokenizer.DEFAULT_TOKENIZER, 4)
    cache = TokenCache(entries=2)
    for texts in rounds:
        got, cut = cache.encode(encoder, texts)
        reference = encoder.encode_batch(texts) if texts else []
        assert [g.tolist() for g in got] == [r.ids for r in reference]
        assert all(g.dtype == np.int64 and not g.flags.writeable for g in got)
        assert cut == [bool(r.overflowing) for r in reference]
        assert len(cache) <= 2
