"""Screenshots the UI tests take: where they go, and the check that one is not blank.

They are test artifacts (never committed): $FASTSERVE_ARTIFACTS, else build/test-artifacts/ in the repository.
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def artifact_dir() -> Path:
    d = Path(os.environ.get("FASTSERVE_ARTIFACTS") or REPO_ROOT / "build" / "test-artifacts")
    d.mkdir(parents=True, exist_ok=True)
    return d


def image_spread(path) -> tuple[float, int]:
    """(standard deviation of the grey levels, number of distinct colours) of an image file: a blank or
    single-colour screenshot has (0, 1); a window with text and widgets has tens and hundreds."""
    import numpy as np
    from PIL import Image
    with Image.open(path) as im:
        rgb = np.asarray(im.convert("RGB")).astype(np.uint32)
    grey = rgb.mean(axis=2)
    colours = len(np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2]))
    return float(grey.std()), colours
