"""Text queries -> WordPiece token ids padded to a length bucket -> L2-normalised embeddings.

Tokenization is Hugging Face ``tokenizers`` (:mod:`inference.pipeline.tokenizer`: the model's ``tokenizer``
parameter, the shipped ``shop-wordpiece`` by default), one ``encode_batch_fast`` call per batch in Rust
for the texts not tokenized lately (:class:`TokenCache`: queries repeat). A
sequence is [CLS] and its word pieces, cut to ``max_tokens``; the batch is padded (id 0) to the smallest
bucket of :data:`LENGTH_BUCKETS` that holds its longest sequence, so the few shapes the model sees stay
warm, and the dispatcher groups requests of one bucket into one batch to keep that padding small. The
cache keeps each text's ids and attention row already as padded int64 bytes, so a batch's two inputs are
one join of those rows each, with no per-request numpy.

A truncated request is still served. A text over :data:`MAX_TEXT_CHARS` is refused before tokenizing
(``too_large``), one with no tokens at all (``empty_text``). ``Prepared.real_elements`` counts the tokens
actually sent and ``Prepared.truncated`` the requests that were cut (``hkgw_input_truncated_total``).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from functools import cache, lru_cache
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
"""Texts whose tokens each tokenizer keeps (least recently used out): shoppers' queries repeat, and a
query tokenized once costs ~20 us in the library while a cached one costs a dictionary lookup."""
CACHED_CHARS: Final = 256
"""Longer texts are tokenized every time: a query is short, a long text rarely repeats."""

_ID_BYTES: Final = np.dtype(np.int64).itemsize
_ONE: Final = np.ones(1, dtype=np.int64).tobytes()


@cache
def _mask_row(length: int) -> bytes:
    """The attention row of a ``length``-token sequence padded to its own bucket, as int64 bytes."""
    return _ONE * length + bytes(_ID_BYTES * (length_bucket(length) - length))


Tokens = tuple[bytes, bytes, int, bool, int]
"""A text's tokens as the batch lays them out: its ids and its attention row (int64 bytes, each padded
with zeros to the text's own length bucket), its token count, whether it was cut, and its bucket."""


def _tokens(ids: list[int], overflowing: bool) -> Tokens:
    length = len(ids)
    bucket = length_bucket(length)
    row = array("q", ids).tobytes() + bytes(_ID_BYTES * (bucket - length))  # "q": int64, PAD_ID is 0
    return row, _mask_row(length), length, overflowing, bucket


class TokenCache:
    """One tokenizer's bounded memory of text -> its tokens. Exact: the tokenizer is a pure function of
    the text. What it keeps is immutable bytes (every batch joins them into its own input)."""

    def __init__(self, entries: int = CACHED_TEXTS) -> None:
        self._entries = entries
        self._known: OrderedDict[str, Tokens] = OrderedDict()
        self._lock = threading.Lock()  # the loop and the CPU stage's local thread may both tokenize
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._known)

    def tokens(self, encoder: Tokenizer, texts: Sequence[str]) -> list[Tokens]:
        """The tokens of ``texts``; the library is asked once, for the texts it has not seen lately."""
        with self._lock:
            known = self._known
            found: list[Tokens | None] = list(map(known.get, texts))
            if None not in found:  # every text known (the usual batch): one pass in C to mark them used
                deque(map(known.move_to_end, texts), 0)
                self.hits += len(texts)
                return cast(list[Tokens], found)
            for text, entry in zip(texts, found, strict=True):
                if entry is not None:
                    known.move_to_end(text)
        missing = [index for index, entry in enumerate(found) if entry is None]
        self.hits += len(texts) - len(missing)
        self.misses += len(missing)
        # encode_batch_fast: the same ids, without the offsets nothing here reads (~12% less)
        encodings = encoder.encode_batch_fast([texts[i] for i in missing])
        fresh: list[tuple[str, Tokens]] = []
        for index, encoding in zip(missing, encodings, strict=True):
            entry = found[index] = _tokens(encoding.ids, bool(encoding.overflowing))
            if len(texts[index]) <= CACHED_CHARS:
                fresh.append((texts[index], entry))
        with self._lock:
            self._known.update(fresh)
            while len(self._known) > self._entries:
                self._known.popitem(last=False)
        return cast(list[Tokens], found)

    def encode(self, encoder: Tokenizer, texts: Sequence[str]) -> tuple[list[np.ndarray], list[bool]]:
        """Token ids (read-only int64 arrays) and whether each was cut, for ``texts``."""
        found = self.tokens(encoder, texts)
        ids = [np.frombuffer(row, dtype=np.int64, count=length) for row, _, length, _, _ in found]
        return ids, [cut for _, _, _, cut, _ in found]


@cache
def token_cache(name: str, max_tokens: int) -> TokenCache:
    """The cache of tokenizer ``name`` at ``max_tokens`` (one per :func:`tokenizer.load` instance)."""
    return TokenCache()


@cache
def _tokenizer(name: str, max_tokens: str, vocab_size: str, model: str) -> tuple[Tokenizer, TokenCache]:
    """The tokenizer and cache of a model's parameters, checked once (a refusal is not kept: it raises
    again on the next call)."""
    vocab = int(vocab_size)
    length = int(max_tokens)
    encoder = tokenizer.load(name, length)
    entries = tokenizer.vocabulary_size(name, length)
    if entries > vocab:
        raise ValueError(f"model {model}: tokenizer has {entries} entries, the model {vocab}")
    return encoder, token_cache(name, length)


def _tokens_of(texts: Sequence[str], spec: ModelSpec) -> list[Tokens]:
    params = spec.parameters
    encoder, known = _tokenizer(
        params.get("tokenizer", tokenizer.DEFAULT_TOKENIZER),
        params.get("max_tokens", "128"),
        params.get("vocab_size", "8192"),
        spec.name,
    )
    return known.tokens(encoder, texts)


def tokenize(texts: Sequence[str], spec: ModelSpec) -> tuple[list[np.ndarray], list[bool]]:
    """Token ids (int64, [CLS] first, at most the model's ``max_tokens``; read-only) per text, and which
    were cut."""
    found = _tokens_of(texts, spec)
    ids = [np.frombuffer(row, dtype=np.int64, count=length) for row, _, length, _, _ in found]
    return ids, [cut for _, _, _, cut, _ in found]


def length_bucket(length: int) -> int:
    """The padded length of a batch whose longest sequence is ``length``."""
    for bucket in LENGTH_BUCKETS:
        if length <= bucket:
            return bucket
    return length


@lru_cache(maxsize=256)
def _row_slices(count: int) -> tuple[slice, ...]:
    return tuple(slice(i, i + 1) for i in range(count))


def _columns(
    found: Sequence[Tokens],
) -> tuple[Sequence[bytes], Sequence[bytes], Sequence[int], Sequence[bool], Sequence[int]]:
    """The texts' tokens field by field (one transposition in C)."""
    if not found:
        return (), (), (), (), ()
    rows, masks, lengths, cuts, buckets = zip(*found, strict=True)
    return rows, masks, lengths, cuts, buckets


def _matrix(rows: Sequence[bytes], width: int, same: bool) -> np.ndarray:
    """The rows (int64 bytes, each padded to its own bucket) as one [len(rows), width] int64 array, padded
    with zeros; ``same``: every row is ``width`` long already."""
    if not same:
        size = width * _ID_BYTES
        rows = [row.ljust(size, b"\0") for row in rows]
    return np.frombuffer(bytearray().join(rows), dtype=np.int64).reshape(len(rows), width)  # writeable


class TextPipeline:
    """``text.text`` in, one L2-normalised FP32 ``embedding`` per request out."""

    kind = "text"

    def prepare(self, requests: Sequence[pb.InferRequest], spec: ModelSpec) -> Prepared:
        """Tokenize the batch in one call (the token cache's padded rows for the texts it knows), then lay
        it out as dense ``input_ids`` / ``attention_mask``: one join of those rows each."""
        ids_input, mask_input = spec.inputs
        ids_name, mask_name = ids_input.name, mask_input.name
        texts = [request.text.text for request in requests]
        rejected: dict[int, tuple[str, str]] = {}
        candidates: list[int] | None = None  # None: every request
        if texts and max(map(len, texts)) > MAX_TEXT_CHARS:
            candidates = []
            for index, text in enumerate(texts):
                size = len(text)
                if size > MAX_TEXT_CHARS:
                    rejected[index] = (InvalidInput.TOO_LARGE, f"{size} characters, at most {MAX_TEXT_CHARS}")
                else:
                    candidates.append(index)
            texts = [texts[i] for i in candidates]
        found = _tokens_of(texts, spec)
        rows, masks, lengths, cuts, buckets = _columns(found)
        if lengths and min(lengths) > 1:
            kept = list(range(len(found))) if candidates is None else candidates
        else:  # some texts without tokens: refused, the rest served
            order = range(len(found)) if candidates is None else candidates
            kept = []
            entries: list[Tokens] = []
            for index, entry in zip(order, found, strict=True):
                if entry[2] <= 1:
                    rejected[index] = (InvalidInput.EMPTY_TEXT, "no tokens in text")
                else:
                    kept.append(index)
                    entries.append(entry)
            if not entries:
                width = length_bucket(0)
                empty = np.full((0, width), PAD_ID, dtype=np.int64)
                return Prepared(
                    inputs={ids_name: empty, mask_name: empty.copy()}, kept=[], rows=[], rejected=rejected
                )
            rows, masks, lengths, cuts, buckets = _columns(entries)
        width = max(buckets)  # the bucket of the longest sequence
        same = min(buckets) == width
        input_ids = _matrix(rows, width, same)
        return Prepared(
            inputs={ids_name: input_ids, mask_name: _matrix(masks, width, same)},
            kept=kept,
            rows=list(_row_slices(len(kept))),
            rejected=rejected,
            real_elements=sum(lengths),
            padded_elements=input_ids.size,
            truncated=sum(cuts),
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
