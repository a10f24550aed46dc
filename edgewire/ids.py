"""Message and request identifiers: 16-byte UUIDv7, time-ordered, so that ids sort by creation time."""

from __future__ import annotations

import uuid_utils

ID_BYTES = 16


def new_id() -> bytes:
    """A fresh UUIDv7 as 16 raw bytes (monotonic within this process)."""
    return uuid_utils.uuid7().bytes


def id_from_parts(unix_ms: int, random_bits: int) -> bytes:
    """A UUIDv7 built from a given millisecond timestamp and 74 random bits (for deterministic traffic).

    Big-endian: bits 127-80 are ``unix_ms`` modulo 2**48, 79-76 the version 7, 75-64 ``rand_a`` = bits
    73-62 of ``random_bits``, 63-62 the variant ``10``, 61-0 ``rand_b`` = bits 61-0 of ``random_bits``; bits
    of ``random_bits`` above 73 are ignored (docs/PROTOCOL.md section 9).
    """
    ts = unix_ms & ((1 << 48) - 1)
    rand_a = (random_bits >> 62) & 0xFFF
    rand_b = random_bits & ((1 << 62) - 1)
    value = (ts << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
    return value.to_bytes(ID_BYTES, "big")


def id_unix_ms(message_id: bytes) -> int:
    """The millisecond timestamp carried by a UUIDv7."""
    return int.from_bytes(message_id[:6], "big")


def is_valid_id(value: bytes) -> bool:
    """True when value is 16 bytes with the UUIDv7 version and RFC 4122 variant bits."""
    return len(value) == ID_BYTES and value[6] >> 4 == 0x7 and value[8] >> 6 == 0b10


def id_hex(value: bytes) -> str:
    """Canonical text form for logs (never for metric labels)."""
    return value.hex()
