"""Synthetic product photos as real JPEG bytes: a product shape on a studio background, with sensor noise.

Every image is distinct (shoppers' uploads and catalog shots are), so a compressor cannot win by matching
one image against another; JPEG is already compressed and the report shows it.
"""

from __future__ import annotations

import io
from typing import Final

import numpy as np
from PIL import Image

# (width, height, weight): thumbnails dominate; visual-search uploads arrive downscaled by the apps.
SIZES: Final = ((224, 224, 0.45), (320, 320, 0.25), (480, 480, 0.15), (640, 480, 0.10), (800, 800, 0.05))


def product_photo(rng: np.random.Generator, width: int, height: int, quality: int = 85) -> bytes:
    """One JPEG of ``width`` x ``height``: light background, shaded ellipse or box, mild noise."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    background = rng.uniform(225, 250)
    img = np.empty((height, width, 3), dtype=np.float32)
    img[:] = (background - 18.0 * (yy / height))[:, :, None]  # studio falloff
    color = rng.uniform(20, 220, size=3).astype(np.float32)
    cx, cy = width * rng.uniform(0.4, 0.6), height * rng.uniform(0.4, 0.6)
    rx, ry = width * rng.uniform(0.18, 0.38), height * rng.uniform(0.18, 0.38)
    if rng.random() < 0.5:
        inside = ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1.0
    else:
        inside = (np.abs(xx - cx) <= rx) & (np.abs(yy - cy) <= ry)
    shade = 0.75 + 0.25 * (1.0 - (yy - cy + ry) / (2 * ry)).clip(0, 1)
    img[inside] = color * shade[inside, None]
    img += rng.normal(0.0, 3.0, size=img.shape).astype(np.float32)
    pixels = img.clip(0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="JPEG", quality=quality)
    return out.getvalue()


def pick_size(rng: np.random.Generator) -> tuple[int, int]:
    weights = np.array([w for _, _, w in SIZES])
    i = int(rng.choice(len(SIZES), p=weights / weights.sum()))
    return SIZES[i][0], SIZES[i][1]
