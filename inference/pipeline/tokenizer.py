"""The text models' tokenizer: a WordPiece vocabulary in Hugging Face ``tokenizers`` format.

The gateway ships one, ``shop-wordpiece`` (``inference/pipeline/vocab/shop-wordpiece.json``), trained on the
synthetic shop corpus (product words of every market) by ``scripts/train_tokenizer.py``; nothing is
downloaded. A model names its tokenizer in its ``tokenizer`` parameter: a shipped name, or the path of any
``tokenizer.json`` with the same special tokens (a BERT vocabulary works, e.g. for BERT-base).

Normalisation is BERT's (NFKC first, control characters removed, every CJK ideograph its own word, lower
case, accents kept), words split on whitespace and punctuation, then greedy longest-match WordPiece with
``##`` continuations and ``[UNK]`` for a word it cannot cover. A sequence is ``[CLS]`` and the word pieces,
cut to the model's ``max_tokens``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Final

from edgewire.extras import optional_dependency

# One batch's texts are tokenized on the thread that asks: every process that tokenizes (the gateway's loop
# for small batches, each of its CPU workers, the agent) is already one per core, and the library's own
# thread pool spins after each call. Two short texts: 160 us of process CPU with it, 65 us without (the
# caller's own thread spent 21 us and waited); 32 texts: 1.5 ms with it, 1.26 ms without. Read by the
# library at its first parallel call; an operator's own setting wins.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

with optional_dependency("agent-local", "gateway"):
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from tokenizers.trainers import WordPieceTrainer

VOCAB_DIR: Final = Path(__file__).with_name("vocab")
DEFAULT_TOKENIZER: Final = "shop-wordpiece"
SPECIAL_TOKENS: Final = ("[PAD]", "[CLS]", "[UNK]", "[SEP]")  # ids 0, 1, 2, 3 in every shipped vocabulary
PAD_ID: Final = 0
CLS_ID: Final = 1
UNK_ID: Final = 2

_lock = threading.Lock()


def build(vocab: dict[str, int] | None = None) -> Tokenizer:
    """An untrained (or ``vocab``-loaded) tokenizer with this module's normalisation and splitting."""
    tokenizer = Tokenizer(
        WordPiece(vocab or {}, unk_token=SPECIAL_TOKENS[UNK_ID], max_input_chars_per_word=100)
    )
    tokenizer.normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.BertNormalizer(
                clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=True
            ),
        ]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def train(corpus: Iterable[str], vocab_size: int) -> Tokenizer:
    """A WordPiece vocabulary of at most ``vocab_size`` entries learned from ``corpus``."""
    tokenizer = build()
    trainer = WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=1)
    tokenizer.train_from_iterator(corpus, trainer)
    _post_process(tokenizer)
    return tokenizer


def _post_process(tokenizer: Tokenizer) -> None:
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A", pair="[CLS] $A [SEP] $B", special_tokens=[("[CLS]", CLS_ID), ("[SEP]", 3)]
    )


@cache
def load(name: str, max_tokens: int) -> Tokenizer:
    """The tokenizer ``name`` (shipped name or file path), truncating to ``max_tokens`` including [CLS].

    One instance per (name, length), so models with different limits never reconfigure each other's.
    Raises ValueError for a missing file or one whose special tokens differ from :data:`SPECIAL_TOKENS`.
    """
    path = VOCAB_DIR / f"{name}.json" if "/" not in name and not name.endswith(".json") else Path(name)
    if not path.is_file():
        shipped = sorted(p.stem for p in VOCAB_DIR.glob("*.json"))
        raise ValueError(f"tokenizer {name!r}: no file {path} (shipped: {shipped})")
    with _lock:
        tokenizer = Tokenizer.from_file(str(path))
    for token_id, token in enumerate(SPECIAL_TOKENS[:3]):
        if tokenizer.token_to_id(token) != token_id:
            raise ValueError(f"tokenizer {name!r}: {token} must have id {token_id}")
    _post_process(tokenizer)
    tokenizer.enable_truncation(max_length=max_tokens)
    tokenizer.no_padding()  # the pipeline pads the whole batch to a length bucket itself
    return tokenizer


@cache
def vocabulary_size(name: str, max_tokens: int) -> int:
    """Entries in tokenizer ``name`` (asking the tokenizer costs ~0.1 ms: once per name)."""
    size: int = load(name, max_tokens).get_vocab_size()
    return size
