"""Which zstd dictionary the uplink compresses with: only one the gateway advertised, fetched if needed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import structlog

from edgewire import DictionaryError, DictionaryStore, pb

log = structlog.get_logger("edge_agent.uplink")

ASK_AGAIN_S: Final = 5.0
"""A DictionaryRequest without an answer is asked again after this (the request or answer was lost)."""
MAX_TRACKED: Final = 16


class DictionaryNegotiation:
    """``dict_id`` is the dictionary new frames use (0 = plain zstd): the gateway's preferred one once held.

    Each Pong may make it fetch the preferred dictionary (``ask`` sends the request on that Pong's
    carrier); a dictionary the gateway no longer lists, or a frame refused for an unknown dictionary,
    switches back to 0.
    """

    def __init__(self, store: DictionaryStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        self.dict_id = 0
        self._asked: dict[int, float] = {}  # dictionary id -> when it may be asked for again

    def on_pong(self, pong: pb.Pong, ask: Callable[[pb.DictionaryRequest], bool]) -> None:
        preferred = pong.preferred_dict_id
        if preferred and preferred in self._store:
            self.dict_id = preferred
        elif (
            preferred
            and self._clock() >= self._asked.get(preferred, 0.0)
            and ask(pb.DictionaryRequest(dict_id=preferred))
        ):
            self._asked[preferred] = self._clock() + ASK_AGAIN_S
            while len(self._asked) > MAX_TRACKED:
                del self._asked[next(iter(self._asked))]
        if self.dict_id and self.dict_id not in pong.dict_ids:
            self.dict_id = 0  # the gateway no longer decodes it

    def refused(self) -> None:
        """The gateway refused a frame for its dictionary: plain zstd until a Pong says otherwise."""
        self.dict_id = 0

    def on_dictionary(self, response: pb.DictionaryResponse) -> None:
        if not response.dictionary:
            return
        try:
            held = self._store.add(response.dictionary, prefer=False)
        except DictionaryError as exc:
            log.warning("dictionary from the gateway refused", error=str(exc))
            return
        if held != response.dict_id:
            log.warning("dictionary id mismatch", announced=response.dict_id, inside=held)
            return
        log.info("dictionary fetched from the gateway", dict_id=held)
