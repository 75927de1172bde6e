"""Sums of rows over Poisson batches in one gather-and-add call (the Monte-Carlo passes of the mean
rule, GLA's statistic and the audit all add batch members this way)."""

import numpy as np
import torch
import torch.nn.functional as F


class Bags:
    """The members of each batch, as embedding_bag input: batch sums over any row-indexed matrix
    are then one gather-and-add call, which adds each batch's members one after the other in the
    order given (row order for a mask).

    leading: the matrix starts with one row per batch (the sums so far) and each batch adds its
    members onto its own row, so that sums chained over chunks of rows equal one sum over all."""

    def __init__(self, members: np.ndarray, counts: np.ndarray, device: str | torch.device,
                 leading: bool = False) -> None:
        self.count = len(counts)
        if leading:
            counts = counts + 1
            # The members are listed batch by batch: each batch's run moves up by its own row.
            members = np.insert(members + self.count, np.concatenate([[0], np.cumsum(counts - 1)[:-1]]),
                                np.arange(self.count))
        self.indices = torch.from_numpy(np.asarray(members)).to(device)
        self.offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)).to(device)

    @classmethod
    def of_mask(cls, mask: np.ndarray, device: str | torch.device, leading: bool = False) -> "Bags":
        """The batches of a boolean (batches, rows) mask."""
        # The flat indices' quotient and remainder: np.nonzero's row and column indices, 3× faster.
        batch_of_member, members = np.divmod(np.flatnonzero(mask), mask.shape[1])
        return cls(members, np.bincount(batch_of_member, minlength=mask.shape[0]), device, leading)

    def sums(self, matrix: torch.Tensor) -> torch.Tensor:
        """Σ over each batch's members of `matrix`'s rows: (batches, columns); 0 for an empty batch."""
        if len(self.indices) == 0:
            return matrix.new_zeros((self.count, matrix.shape[1]))
        return F.embedding_bag(self.indices, matrix, self.offsets, mode="sum")
