"""Text queries -> WordPiece token ids padded to a length bucket -> L2-normalised embeddings.

Tokenization is Hugging Face ``tokenizers`` (:mod:`inference.pipeline.tokenizer`: the model's ``tokenizer``
parameter, the shipped ``shop-wordpiece`` by default), one ``encode_batch`` call per batch in Rust. A
sequence is [CLS] and its word pieces, cut to ``max_tokens``; the batch is padded (id 0) to the smallest
bucket of :data:`LENGTH_BUCKETS` that holds its longest sequence, so the few shapes the model sees stay
warm, and the dispatcher groups requests of one bucket into one batch to keep that padding small.

A truncated request is still served. A text over :data:`MAX_TEXT_CHARS` is refused before tokenizing
(``too_large``), one with no tokens at all (``empty_text``). ``Prepared.real_elements`` counts the tokens
actually sent and ``Prepared.truncated`` the requests that were cut (``hkgw_input_truncated_total``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import numpy as np

from edgewire import pb
from inference.backends.base import ModelSpec
from inference.pipeline import tokenizer
from inference.pipeline.base import Prepared
from inference.pipeline.tensor import InvalidInput, tensor_from_array
from inference.pipeline.textsize import MAX_TEXT_CHARS

PAD_ID: Final = tokenizer.PAD_ID
CLS_ID: Final = tokenizer.CLS_ID
LENGTH_BUCKETS: Final = (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # queries: mostly 3-8 tokens
EMBEDDING = "embedding"


def tokenize(texts: Sequence[str], spec: ModelSpec) -> tuple[list[np.ndarray], list[bool]]:
    """Token ids (int64, [CLS] first, at most the model's ``max_tokens``) per text, and which were cut."""
    params = spec.parameters
    vocab = int(params.get("vocab_size", "8192"))
    name, max_tokens = (
        params.get("tokenizer", tokenizer.DEFAULT_TOKENIZER),
        int(params.get("max_tokens", "128")),
    )
    encoder = tokenizer.load(name, max_tokens)
    entries = tokenizer.vocabulary_size(name, max_tokens)
    if entries > vocab:
        raise ValueError(f"model {spec.name}: tokenizer has {entries} entries, the model {vocab}")
    encodings = encoder.encode_batch(list(texts))
    return (
        [np.asarray(e.ids, dtype=np.int64) for e in encodings],
        [bool(e.overflowing) for e in encodings],
    )


def length_bucket(length: int) -> int:
    """The padded length of a batch whose longest sequence is ``length``."""
    for bucket in LENGTH_BUCKETS:
        if length <= bucket:
            return bucket
    return length


class TextPipeline:
    """``text.text`` in, one L2-normalised FP32 ``embedding`` per request out."""

    kind = "text"

    def prepare(self, requests: Sequence[pb.InferRequest], spec: ModelSpec) -> Prepared:
        """Tokenize the batch in one call, then lay it out as dense ``input_ids`` / ``attention_mask``."""
        ids_name, mask_name = (t.name for t in spec.inputs)
        rejected: dict[int, tuple[str, str]] = {}
        candidates: list[int] = []
        for index, request in enumerate(requests):
            size = len(request.text.text)
            if size > MAX_TEXT_CHARS:
                rejected[index] = (InvalidInput.TOO_LARGE, f"{size} characters, at most {MAX_TEXT_CHARS}")
            else:
                candidates.append(index)
        encoded, cut = tokenize([requests[i].text.text for i in candidates], spec)
        sequences: list[np.ndarray] = []
        kept: list[int] = []
        truncated_here = 0
        for index, ids, truncated in zip(candidates, encoded, cut, strict=True):
            if len(ids) <= 1:
                rejected[index] = (InvalidInput.EMPTY_TEXT, "no tokens in text")
                continue
            truncated_here += truncated
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
            truncated=truncated_here,
        )

    def finish(self, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[list[pb.Tensor]]:
        """L2-normalise the batch's embeddings in one pass; one [dim] tensor per request."""
        embeddings = np.asarray(outputs[EMBEDDING], dtype=np.float32)
        norms = np.linalg.norm(embeddings, axis=1, keepdims=True)
        normalised = embeddings / np.maximum(norms, np.float32(1e-12))
        return [[tensor_from_array(EMBEDDING, normalised[rows][0])] for rows in prepared.rows]
