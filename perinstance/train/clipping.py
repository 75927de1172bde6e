"""Per-sample transforms h(g) and their hard bounds Γ (accounting.md §1).

Each transform is a scalar weight w(||g||) with h(g) = w·g, so only per-sample gradient
norms are needed to apply it or to measure ||h(g)|| = w·||g||.
"""

from dataclasses import dataclass

import torch

from perinstance.train.runs import RunConfig

CLIPPING_CHOICES = ("flat", "psac", "psasc")


def clip_bound(clipping: str, clip_norm: float, scale_s: float = 1.0) -> float:
    """Γ: the bound on ||h(g)|| for every g (accounting.md §1 table)."""
    if clipping == "psasc":
        return clip_norm / scale_s
    return clip_norm


def scale_weights(grad_norm: torch.Tensor, clipping: str, clip_norm: float, scale_r: float = None,
                  scale_s: float = None) -> torch.Tensor:
    """w(||g||) such that h(g) = w·g, for a tensor of per-sample gradient norms."""
    if clipping == "flat":
        # C / max(||g||, C) is min(1, C/||g||) without dividing by a zero norm.
        return clip_norm / torch.clamp(grad_norm, min=clip_norm)
    stabiliser = scale_r / (grad_norm + scale_r)
    if clipping == "psac":
        return clip_norm / (grad_norm + stabiliser)
    if clipping == "psasc":
        return clip_norm / (scale_s * grad_norm + stabiliser)
    raise ValueError(f"unknown clipping {clipping!r}")


def point_weights(grad_norm: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """w(||g||) of flat clipping at each example's own bound (accounting.md §12.4): min(1, C_i/||g_i||), 0 where
    C_i = 0. At C_i = C these are scale_weights' flat weights, bit for bit."""
    return torch.where(bound > 0, bound / torch.maximum(grad_norm, bound), torch.zeros_like(bound))


def transformed_norm(grad_norm: torch.Tensor, clipping: str, clip_norm: float, scale_r: float = None,
                     scale_s: float = None) -> torch.Tensor:
    """||h(g)|| from ||g||: the sum-rule sensitivity Δ* of accounting.md §2.

    w·||g|| can round one ulp above Γ for large norms; the mathematical value never
    exceeds Γ, so the measured sensitivity is capped there.
    """
    norm = scale_weights(grad_norm, clipping, clip_norm, scale_r, scale_s) * grad_norm
    return torch.clamp(norm, max=clip_bound(clipping, clip_norm, scale_s))


@dataclass(frozen=True)
class Transform:
    """The per-sample transform h(g) = w(||g||)·g of a run (accounting.md §1)."""

    clipping: str
    clip_norm: float
    scale_r: float | None = None
    scale_s: float | None = None

    @classmethod
    def of_run(cls, run: RunConfig) -> "Transform":
        """The transform of a runs.RunConfig."""
        return cls(run.clipping, run.clip_norm, run.scale_r, run.scale_s)

    @property
    def bound(self) -> float:
        """Γ, the hard bound on ||h(g)||."""
        return clip_bound(self.clipping, self.clip_norm, self.scale_s)

    def weights(self, grad_norms: torch.Tensor) -> torch.Tensor:
        return scale_weights(grad_norms, self.clipping, self.clip_norm, self.scale_r, self.scale_s)

    def norms(self, grad_norms: torch.Tensor) -> torch.Tensor:
        """Δ* = ||h(g)||, capped at Γ against one-ulp rounding (transformed_norm)."""
        return transformed_norm(grad_norms, self.clipping, self.clip_norm, self.scale_r, self.scale_s)
