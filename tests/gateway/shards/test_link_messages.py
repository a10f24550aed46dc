"""What the front does with a shard's status and metrics messages on the link, one bad message included.

A malformed message (a shard's bug: not JSON, a count that is no integer, text that is no UTF-8) is logged
and dropped; raising would leave the rest of the link's queue unread until the next edge of its FD, or cut
short the read of the shards' last messages at drain. The next good message is taken as always.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import zmq
from structlog.testing import capture_logs

from gateway.shards.front import Front, _Shard
from gateway.shards.link import METRICS, STATUS

SHARD_ID = b"\x00shard-0"


def _front() -> tuple[Front, _Shard]:
    """A Front with only what _from_shard reads: one known shard, alive and reported, no scrape waiting."""
    shard = _Shard(process=SimpleNamespace(index=0, alive=True), routing_id=SHARD_ID)  # type: ignore[arg-type]
    front = Front.__new__(Front)
    fields: dict[str, Any] = {"_by_routing_id": {SHARD_ID: shard}, "_shards": [shard], "_scraped": None}
    vars(front).update(fields, _scrape_id=0)
    return front, shard


def _message(*parts: bytes) -> list[zmq.Frame]:
    return [zmq.Frame(SHARD_ID), *(zmq.Frame(p) for p in parts)]


def test_a_malformed_status_is_logged_and_the_next_one_taken() -> None:
    front, shard = _front()
    with capture_logs() as logs:
        front._from_shard(_message(STATUS, b"{not json"))
        front._from_shard(_message(STATUS, b"[1, 2]"))  # JSON, but no object
    assert [e["event"] for e in logs] == ["malformed message on the link"] * 2
    assert shard.status == {} and not shard.reported
    front._from_shard(_message(STATUS, b'{"ready": true}'))
    assert shard.status == {"ready": True} and shard.reported


def test_malformed_metrics_are_logged_and_the_next_answer_completes_the_scrape() -> None:
    front, shard = _front()
    shard.reported = True
    scraped = asyncio.Event()
    vars(front).update(_scraped=scraped, _scrape_id=3)
    with capture_logs() as logs:
        front._from_shard(_message(METRICS, b"three", b"hkgw_x 1\n"))
        front._from_shard(_message(METRICS, b"3", b"\xff\xfe"))
    assert [e["event"] for e in logs] == ["malformed message on the link"] * 2
    assert shard.answered == 0 and shard.metrics_text == "" and not scraped.is_set()
    front._from_shard(_message(METRICS, b"3", b"hkgw_x 1\n"))
    assert shard.answered == 3 and shard.metrics_text == "hkgw_x 1\n" and scraped.is_set()
