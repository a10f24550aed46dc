"""Train the shipped WordPiece vocabulary (inference/pipeline/vocab/shop-wordpiece.json) on synthetic text.

    .venv/bin/python scripts/train_tokenizer.py [--vocab-size 8192] [--out PATH]

The corpus is every product word, brand and modifier of every market in edge_agent.synthetic (what the
synthetic traffic's queries and descriptions are made of), the description templates filled with them, and
the printable ASCII characters and digits, so that any Latin word splits into known pieces instead of
[UNK]. The same corpus gives the same entries, but ``tokenizers`` may number them differently from run to
run: the committed file is the reference, and a retrained one goes together with retrained text models.
The vocabulary must fit the text model's ``vocab_size`` (8192 for the demo's text-encoder).
"""

from __future__ import annotations

import argparse
import itertools
import string
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_agent.synthetic.vocab import DESCRIPTION_TEMPLATES, VOCAB
from inference.pipeline import tokenizer


def corpus() -> Iterator[str]:
    for words in VOCAB.values():
        for group in words.values():
            yield from group
    english = VOCAB["en"]
    for template, brand, noun, mod in itertools.product(
        DESCRIPTION_TEMPLATES, english["brands"], english["nouns"], english["mods"][:4]
    ):
        yield template.format(brand=brand, noun=noun, mod=mod)
    yield " ".join(string.ascii_lowercase + string.digits + string.punctuation)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-size", type=int, default=8192)
    shipped = tokenizer.VOCAB_DIR / f"{tokenizer.DEFAULT_TOKENIZER}.json"
    parser.add_argument("--out", type=Path, default=shipped)
    args = parser.parse_args()
    trained = tokenizer.train(corpus(), args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    trained.save(str(args.out), pretty=True)
    print(f"{args.out}: {trained.get_vocab_size()} entries")


if __name__ == "__main__":
    main()
