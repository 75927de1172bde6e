"""Per example, its loss at a checkpoint and whether it is classified correctly: what the measurement
writes beside each point's sensitivities (perinstance/measure/gradient_rows.py computes them with the
per-sample gradients).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Predictions:
    """Per example: the cross-entropy loss at the checkpoint and whether it is classified correctly."""

    losses: np.ndarray
    correct: np.ndarray

    @classmethod
    def concat(cls, parts: Sequence["Predictions"]) -> "Predictions":
        return cls(np.concatenate([part.losses for part in parts]), np.concatenate([part.correct for part in parts]))

    def take(self, indices: np.ndarray) -> "Predictions":
        return Predictions(self.losses[indices], self.correct[indices])



def predictions_of(losses: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> Predictions:
    """Predictions of a chunk from its per-example losses and logits."""
    return Predictions(losses.double().cpu().numpy(), (logits.argmax(dim=1) == labels).cpu().numpy())
