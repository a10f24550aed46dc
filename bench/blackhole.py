"""Black-holes for chaos runs and tests: nftables rules that drop a TCP port's packets on loopback silently.

A dropped packet gets no RST or ICMP: the TCP connection stays established on both sides while nothing
passes, as when a carrier's link fails somewhere in the middle. Use it only inside a network namespace of
its own (``unshare --net``, as the test command runs): the rules apply to the whole namespace.

    with BlackHole(5556):          # both directions
        ...
    with BlackHole(5556, "from"):  # only what the port sends (answers to the agent) is dropped
        ...
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from typing import Literal

Direction = Literal["both", "to", "from"]
"""``to``: packets to the port are dropped; ``from``: packets from it; ``both``: either."""

_tables = itertools.count()


def unavailable() -> str | None:
    """Why black-holes cannot be made here (not root, no nft, nft refused), or None when they can."""
    if os.geteuid() != 0:
        return "black-holes need root (nftables), e.g. inside 'unshare --net --map-root-user'"
    if shutil.which("nft") is None:
        return "nft (nftables) is not installed"
    probe = f"hkeg_probe_{os.getpid()}"
    made = subprocess.run(["nft", "add", "table", "inet", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"nft cannot add a table here: {made.stderr.strip()[:200]}"
    subprocess.run(["nft", "delete", "table", "inet", probe], capture_output=True, check=False)
    return None


class BlackHole:
    """Drops TCP packets to and/or from ``port`` (loopback included) while entered; a table of its own, so
    several can be held at once and leaving one removes only its rules."""

    def __init__(self, port: int, direction: Direction = "both") -> None:
        self.port = port
        self.direction = direction
        self.table = f"hkeg_blackhole_{os.getpid()}_{next(_tables)}"
        self.active = False

    def __enter__(self) -> BlackHole:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Install the rules; raises ``subprocess.CalledProcessError`` (with nft's message) when refused."""
        matches = {"to": ["dport"], "from": ["sport"], "both": ["dport", "sport"]}[self.direction]
        rules = "".join(f"add rule inet {self.table} input tcp {m} {self.port} drop\n" for m in matches)
        script = (
            f"add table inet {self.table}\n"
            f"add chain inet {self.table} input {{ type filter hook input priority -10 ; }}\n{rules}"
        )
        # One nft transaction: the table appears with all its rules, or not at all.
        subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, text=True, check=True)
        self.active = True

    def stop(self) -> None:
        """Remove the rules (safe twice, and when ``start`` failed)."""
        if self.active:
            subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True, check=False)
            self.active = False

    @property
    def dropped(self) -> bool:
        """True while the rules are installed (read back from nft, not from this object's memory)."""
        listed = subprocess.run(
            ["nft", "list", "table", "inet", self.table], capture_output=True, text=True, check=False
        )
        return listed.returncode == 0 and "drop" in listed.stdout
