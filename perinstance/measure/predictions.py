"""Per example, its loss at a checkpoint and whether it is classified correctly: what the measurement
writes beside each point's sensitivities (perinstance/measure/gradient_rows.py computes them with the
per-sample gradients). Correctness is defined where the targets are class labels
(batches.correct_predictions); elsewhere it is NaN.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from perinstance.persample import batches, finite


@dataclass
class Predictions:
    """Per example: the loss at the checkpoint (the run's: cross-entropy unless a --loss of its own) and whether it
    is classified correctly (1.0 or 0.0; NaN where the targets are not class labels)."""

    losses: np.ndarray
    correct: np.ndarray

    @classmethod
    def concat(cls, parts: Sequence["Predictions"]) -> "Predictions":
        return cls(np.concatenate([part.losses for part in parts]), np.concatenate([part.correct for part in parts]))

    def take(self, indices: np.ndarray) -> "Predictions":
        return Predictions(self.losses[indices], self.correct[indices])


def predictions_of(losses: torch.Tensor, outputs: object, targets: torch.Tensor,
                   grad_norms: torch.Tensor | None = None) -> Predictions:
    """Predictions of a chunk from its per-example losses and the model's outputs; finite.NonFiniteValues where an
    output, a loss or a gradient norm ||g_i|| (`grad_norms`) is not finite (the measurement refuses it,
    measurement.py)."""
    finite.check_values(losses, grad_norms, outputs)
    correct = batches.correct_predictions(outputs, targets)
    return Predictions(losses.double().cpu().numpy(), np.full(len(losses), np.nan) if correct is None else
                       correct.double().cpu().numpy())
