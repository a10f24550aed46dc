"""Text queries -> WordPiece token ids padded to a length bucket -> L2-normalised embeddings.

Tokenization is Hugging Face ``tokenizers`` (:mod:`inference.pipeline.tokenizer`: the model's ``tokenizer``
parameter, the shipped ``shop-wordpiece`` by default), one ``encode_batch_fast`` call per batch in Rust
for the texts not tokenized lately (:class:`TokenCache`: queries repeat). A
sequence is [CLS] and its word pieces, cut to ``max_tokens``; the batch is padded (id 0) to the smallest
bucket of :data:`LENGTH_BUCKETS` that holds its longest sequence, so the few shapes the model sees stay
warm, and the dispatcher groups requests of one bucket into one batch to keep that padding small.

A truncated request is still served. A text over :data:`MAX_TEXT_CHARS` is refused before tokenizing
(``too_large``), one with no tokens at all (``empty_text``). ``Prepared.real_elements`` counts the tokens
actually sent and ``Prepared.truncated`` the requests that were cut (``hkgw_input_truncated_total``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Final, cast

import numpy as np

from edgewire import pb
from inference.backends.base import ModelSpec
from inference.pipeline import tokenizer
from inference.pipeline.base import Prepared
from inference.pipeline.tensor import InvalidInput, output_prefix, tensor_from_array, wire_data
from inference.pipeline.textsize import MAX_TEXT_CHARS

if TYPE_CHECKING:
    from tokenizers import Tokenizer

PAD_ID: Final = tokenizer.PAD_ID
CLS_ID: Final = tokenizer.CLS_ID
LENGTH_BUCKETS: Final = (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # queries: mostly 3-8 tokens
EMBEDDING = "embedding"


CACHED_TEXTS: Final = 16_384
"""Texts whose token ids each tokenizer keeps (least recently used out): shoppers' queries repeat, and a
query tokenized once costs ~20 us in the library while a cached one costs a dictionary lookup."""
CACHED_CHARS: Final = 256
"""Longer texts are tokenized every time: a query is short, a long text rarely repeats."""


class TokenCache:
    """One tokenizer's bounded memory of text -> (token ids, cut). Exact: the tokenizer is a pure
    function of the text. The arrays are read-only (every batch copies them into its own input)."""

    def __init__(self, entries: int = CACHED_TEXTS) -> None:
        self._entries = entries
        self._known: OrderedDict[str, tuple[np.ndarray, bool]] = OrderedDict()
        self._lock = threading.Lock()  # the loop and the CPU stage's local thread may both tokenize
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._known)

    def encode(self, encoder: Tokenizer, texts: Sequence[str]) -> tuple[list[np.ndarray], list[bool]]:
        """Token ids and whether each was cut, for ``texts``; the library is asked once, for the texts it
        has not seen lately."""
        ids: list[np.ndarray | None] = [None] * len(texts)
        cut = [False] * len(texts)
        missing: list[int] = []
        with self._lock:
            known = self._known
            for index, text in enumerate(texts):
                entry = known.get(text)
                if entry is None:
                    missing.append(index)
                else:
                    known.move_to_end(text)
                    ids[index], cut[index] = entry
        self.hits += len(texts) - len(missing)
        self.misses += len(missing)
        if missing:
            # encode_batch_fast: the same ids, without the offsets nothing here reads (~12% less)
            encodings = encoder.encode_batch_fast([texts[i] for i in missing])
            fresh: list[tuple[str, np.ndarray, bool]] = []
            for index, encoding in zip(missing, encodings, strict=True):
                array = np.asarray(encoding.ids, dtype=np.int64)
                array.flags.writeable = False
                ids[index], cut[index] = array, bool(encoding.overflowing)
                if len(texts[index]) <= CACHED_CHARS:
                    fresh.append((texts[index], array, cut[index]))
            with self._lock:
                for text, array, truncated in fresh:
                    self._known[text] = (array, truncated)
                while len(self._known) > self._entries:
                    self._known.popitem(last=False)
        return cast(list[np.ndarray], ids), cut


@cache
def token_cache(name: str, max_tokens: int) -> TokenCache:
    """The cache of tokenizer ``name`` at ``max_tokens`` (one per :func:`tokenizer.load` instance)."""
    return TokenCache()


def tokenize(texts: Sequence[str], spec: ModelSpec) -> tuple[list[np.ndarray], list[bool]]:
    """Token ids (int64, [CLS] first, at most the model's ``max_tokens``; read-only) per text, and which
    were cut."""
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
    return token_cache(name, max_tokens).encode(encoder, texts)


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
        if len(sequences) == 1:  # a lone request: two slices instead of a mask over the batch
            (sequence,) = sequences
            real = len(sequence)
            width = length_bucket(real)
            input_ids = np.full((1, width), PAD_ID, dtype=np.int64)
            input_ids[0, :real] = sequence
            attention = np.zeros((1, width), dtype=np.int64)
            attention[0, :real] = 1
        else:
            lengths = np.asarray([len(s) for s in sequences], dtype=np.int64)
            width = length_bucket(int(lengths.max(initial=0)))
            mask = np.arange(width) < lengths[:, np.newaxis]
            input_ids = np.full((len(kept), width), PAD_ID, dtype=np.int64)
            if kept:
                input_ids[mask] = np.concatenate(sequences)
            attention = mask.astype(np.int64)
            real = int(lengths.sum())
        return Prepared(
            inputs={ids_name: input_ids, mask_name: attention},
            kept=kept,
            rows=[slice(i, i + 1) for i in range(len(kept))],
            rejected=rejected,
            real_elements=real,
            padded_elements=int(input_ids.size),
            truncated=truncated_here,
        )

    def finish(self, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[list[pb.Tensor]]:
        """L2-normalise the batch's embeddings in one pass; one [dim] tensor per request."""
        normalised = normalised_embeddings(outputs)
        return [[tensor_from_array(EMBEDDING, normalised[rows][0])] for rows in prepared.rows]

    def finish_bytes(self, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[bytes]:
        """:meth:`finish`, each request's answer serialized: the batch converted once, then per request
        its row's bytes behind the one prefix every row shares."""
        normalised = normalised_embeddings(outputs)
        datatype, raw = wire_data(EMBEDDING, normalised)
        count = len(normalised)
        size = len(raw) // count if count else 0  # bytes per row
        prefix = output_prefix(EMBEDDING, datatype, normalised.shape[1:], size)
        numbers = range(count)  # numbers[rows][0] is the row normalised[rows][0] is, IndexError alike
        answers: list[bytes] = []
        for rows in prepared.rows:
            row = numbers[rows][0]
            answers.append(prefix + raw[row * size : (row + 1) * size])
        return answers


def normalised_embeddings(outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The batch's embeddings (float32) divided by their L2 norms, floored at 1e-12."""
    embeddings = np.asarray(outputs[EMBEDDING], dtype=np.float32)
    # np.linalg.norm(embeddings, axis=1, keepdims=True) computes exactly this, after ~1 us of checks
    norms = np.sqrt(np.add.reduce(embeddings * embeddings, axis=1, keepdims=True))
    return embeddings / np.maximum(norms, np.float32(1e-12))
