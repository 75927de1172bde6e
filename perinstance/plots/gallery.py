"""A gallery of training images, each over a caption of a few short lines (the point, its label and prediction, its
final loss and ε), for the per-point report (perinstance/experiments/run_report.py). Pure drawing: the caller picks
the points, undoes the data's normalisation (train/data.py display_images) and writes the captions.
"""

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from perinstance.plots.plots import _save

# Inches per tile: the image (a little narrower than its tile, for the gaps), then its caption's lines. At the report's
# 120 dpi a 32-pixel image is drawn about 5× enlarged and the caption at 10 points, readable at 100% zoom in the
# report's page width.
TILE_WIDTH = 1.45
IMAGE_SHARE = 0.95
CAPTION_LINE = 0.2
CAPTION_FONT = 10
FLAG_COLOR = "tab:red"


def plot_gallery(images: np.ndarray, captions: Sequence[str], flagged: Sequence[bool], title: str, path: str,
                 columns: int = 8) -> None:
    """Draw `images` (n×H×W×C floats in [0, 1]; C = 1 grayscale, C = 3 colour) in rows of `columns`, each over its
    caption (lines separated by newlines), a red frame around the `flagged` ones (the legend under the title says
    what a frame means), and write the figure atomically to `path` (PNG)."""
    images = np.asarray(images, dtype=float)
    if images.ndim != 4 or images.shape[3] not in (1, 3):
        raise ValueError(f"images must be n×H×W×C with C = 1 or 3, got shape {images.shape}")
    if not len(images) == len(captions) == len(flagged):
        raise ValueError(f"{len(images)} images, {len(captions)} captions and {len(flagged)} flags")
    if not len(images):
        raise ValueError("a gallery needs at least one image")
    columns = min(columns, len(images))
    rows = math.ceil(len(images) / columns)
    lines = max(caption.count("\n") + 1 for caption in captions)
    tile_height = IMAGE_SHARE * TILE_WIDTH + CAPTION_LINE * lines + 0.1
    fig, axes = plt.subplots(rows, columns, figsize=(TILE_WIDTH * columns, tile_height * rows + 0.5),
                             squeeze=False, layout="constrained")
    for index, ax in enumerate(axes.ravel()):
        if index >= len(images):
            ax.axis("off")
            continue
        image = images[index]
        ax.imshow(image[:, :, 0] if image.shape[2] == 1 else image, cmap="gray" if image.shape[2] == 1 else None,
                  vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel(captions[index], fontsize=CAPTION_FONT, linespacing=1.2)
        for spine in ax.spines.values():
            spine.set_color(FLAG_COLOR if flagged[index] else "#bbbbbb")
            spine.set_linewidth(3 if flagged[index] else 1)
    fig.suptitle(title, fontsize=12)
    _save(fig, path)
