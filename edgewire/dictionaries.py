"""Trained zstd dictionaries, identified by the id zstd writes into them.

A dictionary is a file ``<dir>/<dict_id>.zdict`` holding the raw dictionary bytes. The gateway holds several
ids at once (old agents keep using the previous one while new ones move to the newest); agents learn the
gateway's preference from Pong and may fetch a missing one with DictionaryRequest.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import zstandard as zstd

SUFFIX = ".zdict"
DEFAULT_DICT_BYTES = 256 * 1024
MAX_DICT_BYTES = 1024 * 1024


class DictionaryError(ValueError):
    """A dictionary that cannot be trained, loaded or held."""


def train(samples: Sequence[bytes], dict_size: int = DEFAULT_DICT_BYTES, level: int = 3) -> bytes:
    """Train a zstd dictionary on serialized messages; returns the raw dictionary (its id is inside)."""
    if len(samples) < 8:
        raise DictionaryError("need at least 8 samples to train a dictionary")
    if not 256 <= dict_size <= MAX_DICT_BYTES:
        raise DictionaryError(f"dict_size must be in [256, {MAX_DICT_BYTES}]")
    try:
        trained = zstd.train_dictionary(dict_size, list(samples), level=level)
    except zstd.ZstdError as exc:
        raise DictionaryError(f"training failed: {exc}") from exc
    return bytes(trained.as_bytes())


def dict_id_of(raw: bytes) -> int:
    """The id a raw zstd dictionary declares (0 for raw-content dictionaries, which are refused)."""
    return int(zstd.ZstdCompressionDict(raw, dict_type=zstd.DICT_TYPE_FULLDICT).dict_id())


class DictionaryStore:
    """A bounded set of zstd dictionaries keyed by id, with the preferred one for new traffic."""

    def __init__(self, max_dictionaries: int = 8) -> None:
        self._max = max_dictionaries
        self._raw: dict[int, bytes] = {}
        self._compression: dict[int, zstd.ZstdCompressionDict] = {}
        self.preferred: int = 0

    def add(self, raw: bytes, *, prefer: bool = True) -> int:
        """Hold a raw dictionary; returns its id. The newest added becomes preferred unless prefer=False."""
        if len(raw) > MAX_DICT_BYTES:
            raise DictionaryError(f"dictionary of {len(raw)} bytes is over {MAX_DICT_BYTES}")
        try:
            compiled = zstd.ZstdCompressionDict(raw, dict_type=zstd.DICT_TYPE_FULLDICT)
            dict_id = int(compiled.dict_id())
        except zstd.ZstdError as exc:
            raise DictionaryError(f"not a zstd dictionary: {exc}") from exc
        if dict_id == 0:
            raise DictionaryError("dictionary has id 0, which the wire reserves for 'no dictionary'")
        if dict_id not in self._raw and len(self._raw) >= self._max:
            raise DictionaryError(f"store already holds {self._max} dictionaries")
        self._raw[dict_id] = bytes(raw)
        self._compression[dict_id] = compiled
        if prefer or not self.preferred:
            self.preferred = dict_id
        return dict_id

    def get(self, dict_id: int) -> zstd.ZstdCompressionDict | None:
        return self._compression.get(dict_id)

    def raw(self, dict_id: int) -> bytes | None:
        return self._raw.get(dict_id)

    def ids(self) -> list[int]:
        return sorted(self._raw)

    def __contains__(self, dict_id: object) -> bool:
        return dict_id in self._raw

    def __len__(self) -> int:
        return len(self._raw)

    def save(self, directory: Path, dict_id: int) -> Path:
        """Write one held dictionary to ``directory/<id>.zdict`` (atomically) and return the path."""
        raw = self._raw[dict_id]
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{dict_id}{SUFFIX}"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(raw)
        tmp.replace(path)
        return path

    def load_dir(self, directory: Path) -> list[int]:
        """Load every ``*.zdict`` in a directory; the file name must match the id inside."""
        loaded = []
        for path in sorted(directory.glob(f"*{SUFFIX}")):
            raw = path.read_bytes()
            try:
                declared = int(path.stem)
            except ValueError as exc:
                raise DictionaryError(f"{path}: file name must be the dictionary id") from exc
            if dict_id_of(raw) != declared:
                raise DictionaryError(f"{path}: holds dictionary {dict_id_of(raw)}, not {declared}")
            loaded.append(self.add(raw, prefer=False))
        if loaded:
            self.preferred = max(loaded, key=lambda i: (directory / f"{i}{SUFFIX}").stat().st_mtime_ns)
        return loaded

    @classmethod
    def from_raw(cls, raws: Iterable[bytes]) -> DictionaryStore:
        store = cls()
        for raw in raws:
            store.add(raw)
        return store
