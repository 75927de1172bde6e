import numpy as np
import pytest
import torch

from perinstance.train import clipping

NORMS = torch.logspace(-8, 8, 161, dtype=torch.float64)


@pytest.mark.parametrize("transform,scale_r,scale_s", [("flat", None, None), ("psac", 0.1, None),
                                                       ("psac", 2.0, None), ("psasc", 0.1, 0.9),
                                                       ("psasc", 0.5, 0.3)])
def test_transformed_norm_never_exceeds_the_bound(transform, scale_r, scale_s):
    clip_norm = 1.5
    bound = clipping.clip_bound(transform, clip_norm, scale_s)
    assert bound == pytest.approx(clip_norm / scale_s if transform == "psasc" else clip_norm)
    norms = clipping.transformed_norm(NORMS, transform, clip_norm, scale_r, scale_s)
    assert torch.all(norms <= bound)
    weighted = clipping.scale_weights(NORMS, transform, clip_norm, scale_r, scale_s) * NORMS
    assert torch.all(weighted <= bound * (1 + 1e-15))  # the applied weights, up to rounding
    if transform != "flat":
        # Mathematically strict; float64 can resolve the gap up to norms of about 1e6.
        assert torch.all(norms[NORMS <= 1e6] < bound)
    # ||h(g)|| grows with ||g|| for every transform (up to rounding at the top).
    assert torch.all(torch.diff(norms) >= -1e-12 * bound)


def test_flat_clipping_is_min_one_c_over_norm():
    weights = clipping.scale_weights(torch.tensor([0.0, 0.5, 1.0, 4.0]), "flat", 1.0)
    assert weights.tolist() == [1.0, 1.0, 1.0, 0.25]


def test_psasc_weight_is_non_monotonous_and_favours_small_gradients():
    clip_norm, scale_r, scale_s = 1.0, 0.1, 0.5
    psasc = clipping.scale_weights(NORMS, "psasc", clip_norm, scale_r, scale_s).numpy()
    psac = clipping.scale_weights(NORMS, "psac", clip_norm, scale_r).numpy()
    assert np.all(psasc >= psac) and np.all(psasc[NORMS.numpy() > 1e-3] > psac[NORMS.numpy() > 1e-3])
    # The weight C/(s·x + r/(x+r)) peaks where s = r/(x+r)², i.e. at x = sqrt(r/s) − r.
    peak = np.sqrt(scale_r / scale_s) - scale_r
    fine = torch.linspace(1e-4, 2.0, 20001, dtype=torch.float64)
    fine_weights = clipping.scale_weights(fine, "psasc", clip_norm, scale_r, scale_s).numpy()
    assert abs(fine[fine_weights.argmax()].item() - peak) < 1e-3
    assert fine_weights[0] < fine_weights.max() and fine_weights[-1] < fine_weights.max()


def test_zero_gradient_has_zero_transformed_norm():
    for transform, scale_r, scale_s in [("flat", None, None), ("psac", 0.1, None), ("psasc", 0.1, 0.9)]:
        zero = clipping.transformed_norm(torch.zeros(1), transform, 1.0, scale_r, scale_s)
        assert zero.item() == 0.0
