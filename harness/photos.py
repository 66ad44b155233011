"""Photo-like JPEGs for the zoo tests: what people's folders hold, made here."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image


def photo_jpeg(width: int, height: int, seed: int) -> bytes:
    """A photo-like JPEG (smooth gradients plus noise), quality 90."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack(
        [
            128 + 100 * np.sin(xx / (17 + seed)) * np.cos(yy / 23),
            255 * xx / width,
            255 * (1 - yy / height) * (0.5 + 0.5 * np.sin((xx + yy) / 41)),
        ],
        axis=-1,
    )
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="JPEG", quality=90)
    return out.getvalue()


JPEGS = {(500, 375): photo_jpeg(500, 375, 1), (333, 500): photo_jpeg(333, 500, 2)}


def photo_folder(root: Path, classes: int, per_class: int) -> Path:
    """A folder of JPEGs in ``classes`` class subfolders, of two sizes (landscape and
    portrait), as a folder of photos holds them."""
    sizes = list(JPEGS)
    for label in range(classes):
        folder = root / f"class_{label}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            (folder / f"{i}.jpg").write_bytes(JPEGS[sizes[(label + i) % len(sizes)]])
    return root
