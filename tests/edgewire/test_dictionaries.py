"""Trained dictionaries: train, save, load, several ids at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.synthetic import SyntheticTraffic
from edgewire import DictionaryError, DictionaryStore, FrameCodec, pb
from edgewire.dictionaries import dict_id_of, train


def samples(seed: int) -> list[bytes]:
    return [
        pb.RequestBatch(requests=[r.request]).SerializeToString()
        for r in SyntheticTraffic(seed, n_items=3000, n_users=300).take(200)
        if r.request.kind != pb.REQUEST_KIND_IMAGE
    ]


def test_save_and_load_keep_the_id(tmp_path: Path, trained_dictionary: bytes) -> None:
    """A saved dictionary loads back under the id zstd wrote into it."""
    store = DictionaryStore.from_raw([trained_dictionary])
    path = store.save(tmp_path, store.preferred)
    assert path.name == f"{dict_id_of(trained_dictionary)}.zdict"
    loaded = DictionaryStore()
    assert loaded.load_dir(tmp_path) == [store.preferred]
    assert loaded.raw(store.preferred) == trained_dictionary


def test_receiver_holds_several_ids(trained_dictionary: bytes) -> None:
    """Agents on the old and the new dictionary are both decoded by one gateway."""
    newer = train(samples(11), 8 * 1024)
    old_agent = FrameCodec(dictionaries=DictionaryStore.from_raw([trained_dictionary]), compress_min_bytes=0)
    new_agent = FrameCodec(dictionaries=DictionaryStore.from_raw([newer]), compress_min_bytes=0)
    gateway = FrameCodec(dictionaries=DictionaryStore.from_raw([trained_dictionary, newer]))
    assert gateway.dictionaries.preferred == dict_id_of(newer)
    batch = pb.RequestBatch(  # enough to shrink by more than the codec's min_saving
        requests=[pb.InferRequest(model_name="text-encoder", tenant="search") for _ in range(20)]
    )
    for agent in (old_agent, new_agent):
        frames = agent.encode(batch)
        assert gateway.decode(frames).payload == batch
    assert len({pb.Envelope.FromString(a.encode(batch)[0]).dict_id for a in (old_agent, new_agent)}) == 2


def test_dictionary_shrinks_single_messages(trained_dictionary: bytes) -> None:
    """On held-out traffic the dictionary makes single messages smaller than plain zstd."""
    plain = FrameCodec(compress_min_bytes=0)
    with_dict = FrameCodec(dictionaries=DictionaryStore.from_raw([trained_dictionary]), compress_min_bytes=0)
    held_out = [pb.RequestBatch.FromString(s) for s in samples(12)]
    assert sum(len(with_dict.encode(b)[1]) for b in held_out) < 0.85 * sum(
        len(plain.encode(b)[1]) for b in held_out
    )


def test_load_dir_refuses_misnamed_file(tmp_path: Path, trained_dictionary: bytes) -> None:
    """A file whose name is not the id inside is an error naming the file."""
    (tmp_path / "123.zdict").write_bytes(trained_dictionary)
    with pytest.raises(DictionaryError, match=r"123\.zdict"):
        DictionaryStore().load_dir(tmp_path)


def test_store_is_bounded(trained_dictionary: bytes) -> None:
    """A store refuses more dictionaries than its bound."""
    store = DictionaryStore(max_dictionaries=1)
    store.add(trained_dictionary)
    with pytest.raises(DictionaryError, match="already holds"):
        store.add(train(samples(13), 8 * 1024))


def test_garbage_is_not_a_dictionary() -> None:
    """Bytes that are not a zstd dictionary are refused with a DictionaryError."""
    with pytest.raises(DictionaryError):
        DictionaryStore().add(b"\x00" * 1000)


def test_training_needs_samples() -> None:
    """Training on too few samples is a clear error."""
    with pytest.raises(DictionaryError, match="at least"):
        train([b"x"] * 3)
