"""Text queries -> padded token ids -> L2-normalised embeddings.

The tokenizer is deterministic and self-contained for now (a later change swaps in a trained HF
``tokenizers`` vocabulary behind :func:`tokenize`): NFKC and lower-case; split on whitespace and
punctuation; every CJK ideograph, kana and Thai character is a token of its own; a token's id is
``2 + crc32(token) % (vocab - 2)``, with ``1`` = [CLS] first and ``0`` = padding. Sequences are cut to
``max_tokens`` (including [CLS]) and padded to the batch's longest, rounded up to a bucket, so the few
shapes the model sees stay warm.

A truncated request is still served. ``Prepared.real_elements`` counts the tokens actually sent (after
truncation); :attr:`TextPipeline.truncated` counts the requests that were cut, for a metric.
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from collections.abc import Mapping, Sequence
from typing import Final

import numpy as np

from edgewire import pb
from gateway.backends.base import ModelSpec
from gateway.pipeline.base import Prepared
from gateway.pipeline.tensor import InvalidInput, tensor_from_array

PAD_ID: Final = 0
CLS_ID: Final = 1
LENGTH_BUCKETS: Final = (16, 32, 64, 128)
EMBEDDING = "embedding"

# Scripts written without spaces: CJK ideographs (and extension A, compatibility), hiragana, katakana, Thai.
_SINGLE: Final = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u0e00-\u0e7f"
_TOKEN: Final = re.compile(f"[{_SINGLE}]|[^\\W_{_SINGLE}]+")


def tokenize(text: str, vocab_size: int, max_tokens: int) -> tuple[np.ndarray, bool]:
    """Token ids (int64, [CLS] first, at most ``max_tokens``) of one text, and whether it was truncated."""
    words = _TOKEN.findall(unicodedata.normalize("NFKC", text).lower())
    truncated = len(words) + 1 > max_tokens
    span = vocab_size - 2
    ids = [CLS_ID, *(2 + zlib.crc32(w.encode()) % span for w in words[: max_tokens - 1])]
    return np.asarray(ids, dtype=np.int64), truncated


def length_bucket(length: int) -> int:
    """The padded length of a batch whose longest sequence is ``length``."""
    for bucket in LENGTH_BUCKETS:
        if length <= bucket:
            return bucket
    return length


class TextPipeline:
    """``text.text`` in, one L2-normalised FP32 ``embedding`` per request out."""

    kind = "text"

    def __init__(self) -> None:
        self.truncated = 0
        """Requests cut to the model's ``max_tokens`` since this pipeline was made (a counter)."""

    def prepare(self, requests: Sequence[pb.InferRequest], spec: ModelSpec) -> Prepared:
        """Tokenize each text, then lay the batch out as dense ``input_ids`` / ``attention_mask``."""
        ids_name, mask_name = (t.name for t in spec.inputs)
        vocab = int(spec.parameters.get("vocab_size", "8192"))
        max_tokens = int(spec.parameters.get("max_tokens", "128"))
        sequences: list[np.ndarray] = []
        kept: list[int] = []
        rejected: dict[int, tuple[str, str]] = {}
        for index, request in enumerate(requests):
            ids, truncated = tokenize(request.text.text, vocab, max_tokens)
            if len(ids) == 1:
                rejected[index] = (InvalidInput.EMPTY_TEXT, "no tokens in text")
                continue
            self.truncated += truncated
            sequences.append(ids)
            kept.append(index)
        lengths = np.asarray([len(s) for s in sequences], dtype=np.int64)
        width = length_bucket(int(lengths.max(initial=0)))
        mask = np.arange(width) < lengths[:, np.newaxis]
        input_ids = np.full((len(kept), width), PAD_ID, dtype=np.int64)
        if kept:
            input_ids[mask] = np.concatenate(sequences)
        return Prepared(
            inputs={ids_name: input_ids, mask_name: mask.astype(np.int64)},
            kept=kept,
            rows=[slice(i, i + 1) for i in range(len(kept))],
            rejected=rejected,
            real_elements=int(lengths.sum()),
            padded_elements=int(input_ids.size),
        )

    def finish(
        self, prepared: Prepared, outputs: Mapping[str, np.ndarray], requests: Sequence[pb.InferRequest]
    ) -> list[list[pb.Tensor]]:
        """L2-normalise the batch's embeddings in one pass; one [dim] tensor per request."""
        embeddings = np.asarray(outputs[EMBEDDING], dtype=np.float32)
        norms = np.linalg.norm(embeddings, axis=1, keepdims=True)
        normalised = embeddings / np.maximum(norms, np.float32(1e-12))
        return [[tensor_from_array(EMBEDDING, normalised[rows][0])] for rows in prepared.rows]
