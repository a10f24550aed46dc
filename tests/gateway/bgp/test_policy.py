"""The BGP announcer's pure policy: readings, rise/fall hysteresis, ExaBGP commands; and its loop."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator

import pytest

from gateway.bgp.announcer import ExaBgpPipe, health_url, run
from gateway.bgp.policy import Hysteresis, Reading, Route, classify, commands
from gateway.config import CarrierBgpConfig, ConfigError, load_config

BGP = CarrierBgpConfig(
    neighbor="198.18.0.1",
    local_as=64496,
    prefixes=("203.0.113.0/24", "2001:db8:10::/48"),
    communities=("64497:100",),
    degraded_prepend=2,
    degraded_communities=("64497:80",),
    rise=3,
    fall=2,
)
U, G, R, D = Reading.UP, Reading.DEGRADED, Reading.DRAINING, Reading.DOWN


@pytest.mark.parametrize(
    ("status", "body", "reading"),
    [
        (200, "STATUS:UP all tiers\n", U),
        (200, "STATUS:DEGRADED cloud tier down\n", G),
        (503, "STATUS:DRAINING admin\n", R),
        (503, "STATUS:DOWN stalled\n", D),
        (None, "", D),  # no answer
        (404, "STATUS:UNKNOWN no carrier x\n", D),
        (200, "<html>captive portal</html>", D),  # a 200 that is not our health page
        (503, "STATUS:UP", D),
        (500, "", D),
        (200, "", D),
    ],
)
def test_classify(status: int | None, body: str, reading: Reading) -> None:
    assert classify(status, body) is reading


def states(hysteresis: Hysteresis, readings: list[Reading]) -> list[str]:
    out = []
    for reading in readings:
        hysteresis.observe(reading)
        out.append(hysteresis.state.name[0])  # A(nnounced), D(egraded), W(ithdrawn)
    return out


@pytest.mark.parametrize(
    ("readings", "expected"),
    [
        ([U, U, U, U], "WWAA"),  # announced after rise=3 healthy readings
        ([U, U, U, D, U, D, U], "WWAAAAA"),  # single DOWN blips never withdraw (fall=2)
        ([U, U, U, D, D, U, U, U], "WWAAWWWA"),  # two DOWNs withdraw; three UPs bring it back
        ([U, U, U, R, U, U, U], "WWAWWWA"),  # DRAINING withdraws at once
        ([U, U, U, G, G, U, U, U], "WWAADDDA"),  # DEGRADED after fall, back to plain after rise
        ([G, G, G], "WWD"),  # a degraded carrier is still announced, de-preferred
        ([U, U, U, G, D], "WWAAW"),  # worse and worse: two non-UP readings in a row, the last wins
    ],
)
def test_hysteresis(readings: list[Reading], expected: str) -> None:
    assert "".join(states(Hysteresis(rise=3, fall=2), readings)) == expected


def test_commands_per_state() -> None:
    assert commands(BGP, Route.ANNOUNCED) == [
        "neighbor 198.18.0.1 announce route 203.0.113.0/24 next-hop self community [ 64497:100 ]",
        "neighbor 198.18.0.1 announce route 2001:db8:10::/48 next-hop self community [ 64497:100 ]",
    ]
    assert commands(BGP, Route.DEGRADED)[0] == (
        "neighbor 198.18.0.1 announce route 203.0.113.0/24 next-hop self"
        " as-path [ 64496 64496 64496 ] community [ 64497:100 64497:80 ]"
    )
    assert commands(BGP, Route.WITHDRAWN) == [
        "neighbor 198.18.0.1 withdraw route 203.0.113.0/24 next-hop self",
        "neighbor 198.18.0.1 withdraw route 2001:db8:10::/48 next-hop self",
    ]
    plain = BGP.model_copy(update={"communities": (), "degraded_prepend": 0, "degraded_communities": ()})
    assert (
        commands(plain, Route.DEGRADED)[0]
        == "neighbor 198.18.0.1 announce route 203.0.113.0/24 next-hop self"
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("neighbor", "carrier-router"),
        ("prefixes", ["203.0.113.7/24"]),  # host bits set
        ("prefixes", []),
        ("communities", ["64497"]),
        ("communities", ["70000:1"]),
        ("degraded_prepend", 40),
        ("next_hop", "me"),
    ],
)
def test_bad_bgp_config_is_refused(field: str, value: object) -> None:
    carrier = {"name": "hgc", "bind": "tcp://127.0.0.1:*", "bgp": {**BGP.model_dump(), field: value}}
    with pytest.raises(ConfigError) as caught:
        load_config(environ={}, overrides={"carriers": [carrier], "security": {"mode": "plaintext"}})
    assert any(key.startswith("carriers[0].bgp") for key, _ in caught.value.problems), caught.value.problems


@pytest.fixture
def acks() -> Iterator[tuple[int, int]]:
    """A real pipe standing in for ExaBGP's side of the announcer's stdin."""
    read_fd, write_fd = os.pipe()
    yield read_fd, write_fd
    for fd in (read_fd, write_fd):
        with contextlib.suppress(OSError):
            os.close(fd)


def test_loop_announces_acks_withdraws_and_stops_when_exabgp_goes(acks: tuple[int, int]) -> None:
    """Readings UP x3, DOWN x2: one announcement per prefix, then withdrawals, each acknowledged; an
    ExaBGP 'error' is recorded; the end of its input stops the loop."""
    read_fd, write_fd = acks
    config = load_config(
        environ={},
        overrides={
            "carriers": [
                {"name": "hgc", "bind": "tcp://127.0.0.1:*", "bgp": {**BGP.model_dump(), "interval_s": 0.01}}
            ],
            "security": {"mode": "plaintext"},
            "http": {"host": "0.0.0.0", "port": 9102},
        },
    )
    assert health_url(config, "hgc") == "http://127.0.0.1:9102/health/carriers/hgc"
    # ExaBGP's answers to the commands each reading will cause: two announcements, then two withdrawals.
    script = iter([(U, b""), (U, b""), (U, b"done\ndone\n"), (D, b""), (D, b"done\nerror\n")])
    seen: list[str] = []

    def reader(url: str, timeout_s: float) -> tuple[Reading, str]:
        step = next(script, None)
        if step is None:
            os.close(write_fd)  # ExaBGP exits
            return D, "after the script"
        seen.append(url)
        os.write(write_fd, step[1])
        return step[0], step[0].value

    out = io.StringIO()
    pipe = ExaBgpPipe(out, read_fd, ack=True)
    assert run(config, "hgc", pipe, reader=reader, max_readings=20) == 0
    sent = out.getvalue().splitlines()
    assert [line.split()[2] for line in sent] == ["announce", "announce", "withdraw", "withdraw"]
    assert pipe.errors == [sent[3]]
    assert pipe.closed and len(seen) == 5


def test_unknown_carrier_is_a_config_error() -> None:
    config = load_config(environ={}, overrides={"security": {"mode": "plaintext"}})
    assert run(config, "hgc", ExaBgpPipe(io.StringIO(), 0, ack=False), max_readings=1) == 2
