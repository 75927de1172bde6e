"""The sensitivity engine against the forward/backward-per-batch reference (accounting.md §2)."""

import numpy as np
import pytest
import torch
from torch import nn

from perinstance import sensitivity
from perinstance.sensitivity import (
    EPS_DELTA_KEY,
    RENYI_SET_KEY,
    RENYI_TARGET_KEY,
    Pool,
    Transform,
)

TRAIN_SIZE = 20
RTOL = 1e-5
PSAC = Transform("psac", clip_norm=0.5, scale_r=0.1)
TRANSFORMS = [Transform("flat", 0.5), PSAC, Transform("psasc", 0.5, scale_r=0.1, scale_s=0.9)]


def tiny_convnet():
    """Conv layers on both sides of the ghost/materialise choice of conv2d_norm_sample, and GroupNorm."""
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.Tanh(),           # 16 positions, 9·4 weights: materialised
        nn.Conv2d(4, 8, 4), nn.GroupNorm(2, 8),  # 1 position: ghost form
        nn.Tanh(), nn.Flatten(), nn.Linear(8, 3),
    )
    return model.double()


@pytest.fixture(scope="module")
def data():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(TRAIN_SIZE + 1, 1, 6, 6, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (TRAIN_SIZE + 1,), generator=generator)
    return inputs, labels


class FixedPool(Pool):
    """A pool whose batches are given: row k of `masks` for eps_delta batch k; for Rényi, the
    target t is row t of `targets`, set (t, k) is `sets[t][k]` (α rows)."""

    def __init__(self, masks=None, targets=None, sets=None, universe=TRAIN_SIZE, train_columns=None):
        columns = np.arange(universe) if train_columns is None else train_columns
        super().__init__(seed=0, step=0, universe=universe, sample_rate=0.5, train_columns=columns)
        object.__setattr__(self, "given", (masks, targets, sets))

    def draw(self, count, *key):
        masks, targets, sets = self.given
        if key[0] == EPS_DELTA_KEY:
            return masks[key[1]][None]
        if key[0] == RENYI_TARGET_KEY:
            return targets[key[1]][None]
        assert key[0] == RENYI_SET_KEY
        return sets[key[1]][key[2]]


def members(mask):
    return np.flatnonzero(mask).tolist()


def engine_inputs(data, points, hold=True, universe=TRAIN_SIZE, transform=PSAC):
    """Rows and point gradients; universe TRAIN_SIZE + 1 makes the last example the
    --less-point point (not a training row)."""
    inputs, labels = data
    train_columns = np.arange(min(universe, TRAIN_SIZE))
    point_rows = [point if point < TRAIN_SIZE else -1 for point in points]
    rows, point_gradients = sensitivity.checkpoint_gradients(
        tiny_convnet(), inputs[train_columns], labels[train_columns], inputs[points], labels[points], point_rows,
        transform, hold=hold)
    return rows, point_gradients


def assert_close(engine, reference):
    np.testing.assert_allclose(engine, reference, rtol=RTOL, atol=1e-12)


# --- sum rule ------------------------------------------------------------------------------

@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda transform: transform.clipping)
def test_grad_norm_matches_reference(data, transform):
    inputs, labels = data
    norms, predictions = sensitivity.transformed_norms(tiny_convnet(), inputs, labels, transform)
    singles = sensitivity.reference_batch_means(tiny_convnet(), inputs, labels, transform,
                                                [[index] for index in range(len(labels))])
    assert_close(norms, np.linalg.norm(singles, axis=1))
    logits = tiny_convnet()(inputs)
    assert_close(predictions.losses, nn.functional.cross_entropy(logits, labels, reduction="none").detach().numpy())
    np.testing.assert_array_equal(predictions.correct, (logits.argmax(1) == labels).numpy())


@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda transform: transform.clipping)
def test_grad_norm_never_exceeds_bound(data, transform):
    inputs, labels = data
    model = tiny_convnet()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(30)  # gradients far above the clipping norm
    norms, _ = sensitivity.transformed_norms(model, inputs * 50, labels, transform)
    assert norms.max() > 0.5 * transform.bound
    assert (norms <= transform.bound * (1 + 1e-12)).all()


# --- mean rule, (ε, δ) -----------------------------------------------------------------------

def eps_delta_masks():
    """Batches that are empty, hold only x* (point 0), hold x* and others, and miss x*."""
    masks = np.random.default_rng(3).random((12, TRAIN_SIZE)) < 0.3
    masks[0] = False
    masks[1] = False
    masks[1, 0] = True
    masks[2, :3] = True
    masks[3, 0] = False
    return masks


@pytest.mark.parametrize("hold", [True, False], ids=["held", "recomputed"])
def test_batch_sensitivity_matches_reference(data, hold):
    inputs, labels = data
    masks = eps_delta_masks()
    points = [0, 5]
    rows, point_gradients = engine_inputs(data, points, hold=hold)
    engine = sensitivity.batch_sensitivities(rows, point_gradients, points, FixedPool(masks=masks), len(masks))
    for row, point in enumerate(points):
        batches = [[index for index in members(mask) if index != point] for mask in masks]
        reference = sensitivity.reference_batch_sensitivities(tiny_convnet(), inputs, labels, PSAC, point, batches)
        assert_close(engine[row], reference)


def test_batch_sensitivity_of_a_point_outside_the_training_set(data):
    inputs, labels = data
    outside = TRAIN_SIZE
    masks = np.random.default_rng(4).random((10, TRAIN_SIZE + 1)) < 0.3
    masks[0, outside] = True
    pool = FixedPool(masks=masks, universe=TRAIN_SIZE + 1, train_columns=np.arange(TRAIN_SIZE))
    rows, point_gradients = engine_inputs(data, [outside, 2], universe=TRAIN_SIZE + 1)
    engine = sensitivity.batch_sensitivities(rows, point_gradients, [outside, 2], pool, len(masks))
    batches = [[index for index in members(mask) if index != outside] for mask in masks]
    assert_close(engine[0], sensitivity.reference_batch_sensitivities(tiny_convnet(), inputs, labels, PSAC, outside,
                                                                      batches))


def test_batch_sensitivity_never_exceeds_bound(data):
    masks = np.random.default_rng(5).random((30, TRAIN_SIZE)) < 0.2
    rows, point_gradients = engine_inputs(data, list(range(TRAIN_SIZE)))
    values = sensitivity.batch_sensitivities(rows, point_gradients, list(range(TRAIN_SIZE)), FixedPool(masks=masks),
                                             len(masks))
    assert (values <= PSAC.bound * (1 + 1e-12)).all()
    assert values.min() >= 0


# --- mean rule, Rényi ------------------------------------------------------------------------

def renyi_pool(alpha, num_iters, num_batches, universe=TRAIN_SIZE, train_columns=None):
    rng = np.random.default_rng(6)
    targets = rng.random((num_iters, universe)) < 0.25
    sets = rng.random((num_iters, num_batches, alpha, universe)) < 0.25
    targets[0] = False                      # an empty target batch
    sets[0, 0, 0] = False                   # an empty batch in a set
    targets[1, 0] = True                    # point 0 in the target batch
    sets[1, 1, :, 0] = True                 # point 0 in every batch of a set
    sets[1, 1, 0] = False
    sets[1, 1, 0, 0] = True                 # a batch holding only point 0
    return FixedPool(targets=targets, sets=sets, universe=universe, train_columns=train_columns)


def reference_renyi(data, pool, point, alpha, direction):
    """S by the defining formula, batches derived from the pool as accounting.md §2 says."""
    inputs, labels = data
    masks_targets, masks_sets = pool.given[1], pool.given[2]

    def without_point(mask):
        return [index for index in members(mask) if index != point]

    statistics = []
    for target, set_masks in zip(masks_targets, masks_sets):
        target_batch = without_point(target) if direction == "remove" else members(target)
        sets = [[members(mask) if direction == "remove" else without_point(mask) for mask in batches]
                for batches in set_masks]
        statistics.append(sensitivity.reference_renyi_statistics(tiny_convnet(), inputs, labels, PSAC, target_batch,
                                                                 sets))
    return np.asarray(statistics)


@pytest.mark.parametrize("hold", [True, False], ids=["held", "recomputed"])
def test_renyi_statistic_matches_reference(data, hold):
    alpha, num_iters, num_batches = 3, 2, 3
    pool = renyi_pool(alpha, num_iters, num_batches)
    points = [0, 7]
    rows, point_gradients = engine_inputs(data, points, hold=hold)
    engine = sensitivity.renyi_statistics(rows, point_gradients, points, pool, alpha, num_iters, num_batches)
    for direction in sensitivity.DIRECTIONS:
        for row, point in enumerate(points):
            assert_close(engine[direction][row], reference_renyi(data, pool, point, alpha, direction))


def test_renyi_statistic_of_a_point_outside_the_training_set(data):
    alpha, num_iters, num_batches = 2, 2, 2
    outside = TRAIN_SIZE
    pool = renyi_pool(alpha, num_iters, num_batches, universe=TRAIN_SIZE + 1, train_columns=np.arange(TRAIN_SIZE))
    pool.given[1][1, outside] = True
    rows, point_gradients = engine_inputs(data, [outside], universe=TRAIN_SIZE + 1)
    engine = sensitivity.renyi_statistics(rows, point_gradients, [outside], pool, alpha, num_iters, num_batches)
    for direction in sensitivity.DIRECTIONS:
        assert_close(engine[direction][0], reference_renyi(data, pool, outside, alpha, direction))


def test_renyi_passes_split_and_packed_give_the_same_values(data, monkeypatch):
    alpha, num_iters, num_batches = 2, 3, 4
    pool = Pool(seed=1, step=3, universe=TRAIN_SIZE, sample_rate=0.3, train_columns=np.arange(TRAIN_SIZE))
    rows, point_gradients = engine_inputs(data, [1, 2])
    whole = sensitivity.renyi_statistics(rows, point_gradients, [1, 2], pool, alpha, num_iters, num_batches)
    monkeypatch.setattr(rows, "pass_batches", lambda num_points: 5)  # 2 sets per slice, slices split targets
    split = sensitivity.renyi_statistics(rows, point_gradients, [1, 2], pool, alpha, num_iters, num_batches)
    for direction in sensitivity.DIRECTIONS:
        np.testing.assert_allclose(split[direction], whole[direction], rtol=1e-12)


def test_a_points_values_do_not_depend_on_the_other_points(data):
    pool = Pool(seed=2, step=5, universe=TRAIN_SIZE, sample_rate=0.3, train_columns=np.arange(TRAIN_SIZE))
    alone = sensitivity.renyi_statistics(*engine_inputs(data, [4]), [4], pool, 2, 2, 3)
    together = sensitivity.renyi_statistics(*engine_inputs(data, [1, 4, 9]), [1, 4, 9], pool, 2, 2, 3)
    np.testing.assert_allclose(together["add"][1], alone["add"][0], rtol=1e-12)


def test_renyi_identity_when_all_batch_means_are_equal():
    """accounting.md §6.4: S = −α(α−1)||m' − m_0||² when every m_j = m'."""
    rng = np.random.default_rng(7)
    alpha, dim = 4, 50
    target_sum, shared_sum = rng.standard_normal(dim), rng.standard_normal(dim)
    sums = np.stack([target_sum] + [shared_sum] * alpha)
    sizes = np.array([[5] + [7] * alpha])
    point = rng.standard_normal(dim)
    set_gram = (sums @ sums.T)[None]
    members = np.zeros((1, alpha + 1, 1), dtype=bool)
    statistic = sensitivity.renyi_from_gram(set_gram, (sums @ point)[None, :, None], np.array([point @ point]),
                                            sizes, members, np.array([True]), "remove")
    difference = shared_sum / 7 - target_sum / 5
    np.testing.assert_allclose(statistic[0, 0], -alpha * (alpha - 1) * difference @ difference, rtol=1e-12)


def test_renyi_from_gram_matches_explicit_means():
    """The quadratic form against means built explicitly, with x* in some batches."""
    rng = np.random.default_rng(8)
    alpha, dim = 3, 40
    rows = rng.standard_normal((12, dim))
    point_index = 4
    masks = rng.random((alpha + 1, 12)) < 0.5
    masks[0, point_index], masks[1, point_index], masks[2, point_index] = True, True, False
    sums = masks.astype(float) @ rows
    point = rows[point_index]
    for direction in sensitivity.DIRECTIONS:
        means = []
        for j, mask in enumerate(masks):
            keep = mask.copy()
            keep[point_index] &= (j > 0) == (direction == "remove")
            means.append(rows[keep].mean(axis=0) if keep.any() else np.zeros(dim))
        means = np.asarray(means)
        expected = ((means[1:] ** 2).sum() - (alpha - 1) * means[0] @ means[0]
                    - np.sum((means[1:].sum(axis=0) - (alpha - 1) * means[0]) ** 2))
        statistic = sensitivity.renyi_from_gram((sums @ sums.T)[None], (sums @ point)[None, :, None],
                                                np.array([point @ point]), masks.sum(axis=1)[None],
                                                masks[None, :, point_index, None], np.array([True]), direction)
        np.testing.assert_allclose(statistic[0, 0], expected, rtol=1e-10)


def test_pool_batches_depend_only_on_seed_step_and_key():
    pool = Pool(seed=3, step=10, universe=50, sample_rate=0.2, train_columns=np.arange(50))
    np.testing.assert_array_equal(pool.draw(4, RENYI_SET_KEY, 1, 2), pool.draw(4, RENYI_SET_KEY, 1, 2))
    assert not np.array_equal(pool.draw(4, RENYI_SET_KEY, 1, 2), pool.draw(4, RENYI_SET_KEY, 1, 3))
    later_step = Pool(seed=3, step=11, universe=50, sample_rate=0.2, train_columns=np.arange(50))
    assert not np.array_equal(pool.draw(4, RENYI_SET_KEY, 1, 2), later_step.draw(4, RENYI_SET_KEY, 1, 2))


def test_renyi_slices_cover_every_set_once():
    passes = sensitivity.renyi_slices(num_iters=3, num_batches=5, alpha=2, max_batches=6)
    covered = [(target, key) for slices in passes for target, first, end in slices for key in range(first, end)]
    assert sorted(covered) == [(target, key) for target in range(3) for key in range(5)]
    assert all(sum(1 + (end - first) * 2 for _, first, end in slices) <= 6 for slices in passes)
