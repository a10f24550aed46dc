"""Hard limits a receiver enforces before it allocates anything for a frame."""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True, slots=True)
class CodecLimits:
    """Bounds on one received message; every check happens before the matching allocation."""

    max_header_bytes: int = 1 * KIB
    max_frame_bytes: int = 8 * MIB
    max_decompressed_bytes: int = 32 * MIB
    max_records: int = 1024
    # zstd frames may ask the decoder for a window of up to 2 GiB; level 3 never needs more than 2 MiB.
    max_window_bytes: int = 8 * MIB

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_frame_bytes", "max_decompressed_bytes", "max_records"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_window_bytes < 1 * MIB:
            raise ValueError("max_window_bytes must be at least 1 MiB")
