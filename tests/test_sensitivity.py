"""The sensitivity engine against the forward/backward-per-batch reference (accounting.md §2)."""

import numpy as np
import pytest
import torch
from reference import reference_batch_means, reference_batch_sensitivities, reference_renyi_statistics
from torch import nn

from perinstance.accounting import batch_sizes
from perinstance.measure import coupling, gradient_rows, poisson_batches
from perinstance.measure.poisson_batches import Pool
from perinstance.train.clipping import Transform
from perinstance.train.sampling import RENYI_SET_KEY, RENYI_TARGET_KEY

TRAIN_SIZE = 20
RTOL = 1e-5
PSAC = Transform("psac", clip_norm=0.5, scale_r=0.1)
TRANSFORMS = [Transform("flat", 0.5), PSAC, Transform("psasc", 0.5, scale_r=0.1, scale_s=0.9)]


def tiny_convnet():
    """Conv layers on both sides of the ghost/materialise choice of layer_forms.conv2d_squared_norms, and GroupNorm."""
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
    """A pool whose batches are given: the target t is row t of `targets`, set (t, k) is
    `sets[t][k]` (α rows)."""

    def __init__(self, targets=None, sets=None, universe=TRAIN_SIZE, train_columns=None):
        columns = np.arange(universe) if train_columns is None else train_columns
        super().__init__(seed=0, step=0, universe=universe, sample_rate=0.5, train_columns=columns)
        object.__setattr__(self, "given", (targets, sets))

    def draw(self, count, *key):
        targets, sets = self.given
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
    rows, point_gradients = gradient_rows.checkpoint_gradients(
        tiny_convnet(), inputs[train_columns], labels[train_columns], inputs[points], labels[points], point_rows,
        transform, hold=hold)
    return rows, point_gradients


def assert_close(engine, reference):
    np.testing.assert_allclose(engine, reference, rtol=RTOL, atol=1e-12)


# --- sum rule ------------------------------------------------------------------------------

@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda transform: transform.clipping)
def test_grad_norm_matches_reference(data, transform):
    inputs, labels = data
    norms, predictions = gradient_rows.transformed_norms(tiny_convnet(), inputs, labels, transform)
    singles = reference_batch_means(tiny_convnet(), inputs, labels, transform,
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
    norms, _ = gradient_rows.transformed_norms(model, inputs * 50, labels, transform)
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
    engine = poisson_batches.batch_sensitivities(rows, point_gradients, masks)
    for row, point in enumerate(points):
        batches = [[index for index in members(mask) if index != point] for mask in masks]
        reference = reference_batch_sensitivities(tiny_convnet(), inputs, labels, PSAC, point, batches)
        assert_close(engine[row], reference)


def test_batch_sensitivity_of_a_point_outside_the_training_set(data):
    inputs, labels = data
    outside = TRAIN_SIZE
    masks = np.random.default_rng(4).random((10, TRAIN_SIZE + 1)) < 0.3
    masks[0, outside] = True
    rows, point_gradients = engine_inputs(data, [outside, 2], universe=TRAIN_SIZE + 1)
    engine = poisson_batches.batch_sensitivities(rows, point_gradients, masks[:, :TRAIN_SIZE])
    batches = [[index for index in members(mask) if index != outside] for mask in masks]
    assert_close(engine[0], reference_batch_sensitivities(tiny_convnet(), inputs, labels, PSAC, outside,
                                                                      batches))


def test_batch_sensitivity_never_exceeds_bound(data):
    masks = np.random.default_rng(5).random((30, TRAIN_SIZE)) < 0.2
    rows, point_gradients = engine_inputs(data, list(range(TRAIN_SIZE)))
    values = poisson_batches.batch_sensitivities(rows, point_gradients, masks)
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
    masks_targets, masks_sets = pool.given

    def without_point(mask):
        return [index for index in members(mask) if index != point]

    statistics = []
    for target, set_masks in zip(masks_targets, masks_sets):
        target_batch = without_point(target) if direction == "remove" else members(target)
        sets = [[members(mask) if direction == "remove" else without_point(mask) for mask in batches]
                for batches in set_masks]
        statistics.append(reference_renyi_statistics(tiny_convnet(), inputs, labels, PSAC, target_batch,
                                                                 sets))
    return np.asarray(statistics)


def assert_renyi_matches_reference(data, inputs_of):
    """renyi_statistics from `inputs_of(points, universe)` (the rows or the Gram, and the points) against the
    reference, both directions: two training points, then the --less-point point in a pool over N + 1 indices."""
    alpha, num_iters, num_batches = 3, 2, 3
    pool = renyi_pool(alpha, num_iters, num_batches)
    points = [0, 7]
    engine = poisson_batches.renyi_statistics(*inputs_of(points, TRAIN_SIZE), points, pool, alpha, num_iters,
                                              num_batches)
    for direction in poisson_batches.DIRECTIONS:
        for row, point in enumerate(points):
            assert_close(engine[direction][row], reference_renyi(data, pool, point, alpha, direction))
    alpha, num_iters, num_batches = 2, 2, 2
    outside = TRAIN_SIZE
    pool = renyi_pool(alpha, num_iters, num_batches, universe=TRAIN_SIZE + 1, train_columns=np.arange(TRAIN_SIZE))
    pool.given[0][1, outside] = True
    engine = poisson_batches.renyi_statistics(*inputs_of([outside], TRAIN_SIZE + 1), [outside], pool, alpha,
                                              num_iters, num_batches)
    for direction in poisson_batches.DIRECTIONS:
        assert_close(engine[direction][0], reference_renyi(data, pool, outside, alpha, direction))


@pytest.mark.parametrize("hold", [True, False], ids=["held", "recomputed"])
def test_renyi_statistic_matches_reference(data, hold):
    assert_renyi_matches_reference(data, lambda points, universe: engine_inputs(data, points, hold, universe))


def test_renyi_passes_split_and_packed_give_the_same_values(data, monkeypatch):
    alpha, num_iters, num_batches = 2, 3, 4
    pool = Pool(seed=1, step=3, universe=TRAIN_SIZE, sample_rate=0.3, train_columns=np.arange(TRAIN_SIZE))
    rows, point_gradients = engine_inputs(data, [1, 2])
    whole = poisson_batches.renyi_statistics(rows, point_gradients, [1, 2], pool, alpha, num_iters, num_batches)
    monkeypatch.setattr(rows, "pass_batches", lambda num_points: 5)  # 2 sets per slice, slices split targets
    split = poisson_batches.renyi_statistics(rows, point_gradients, [1, 2], pool, alpha, num_iters, num_batches)
    for direction in poisson_batches.DIRECTIONS:
        np.testing.assert_allclose(split[direction], whole[direction], rtol=1e-12)


def test_a_points_values_do_not_depend_on_the_other_points(data):
    pool = Pool(seed=2, step=5, universe=TRAIN_SIZE, sample_rate=0.3, train_columns=np.arange(TRAIN_SIZE))
    alone = poisson_batches.renyi_statistics(*engine_inputs(data, [4]), [4], pool, 2, 2, 3)
    together = poisson_batches.renyi_statistics(*engine_inputs(data, [1, 4, 9]), [1, 4, 9], pool, 2, 2, 3)
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
    statistic = poisson_batches.renyi_from_gram(set_gram, (sums @ point)[None, :, None], np.array([point @ point]),
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
    for direction in poisson_batches.DIRECTIONS:
        means = []
        for j, mask in enumerate(masks):
            keep = mask.copy()
            keep[point_index] &= (j > 0) == (direction == "remove")
            means.append(rows[keep].mean(axis=0) if keep.any() else np.zeros(dim))
        means = np.asarray(means)
        expected = ((means[1:] ** 2).sum() - (alpha - 1) * means[0] @ means[0]
                    - np.sum((means[1:].sum(axis=0) - (alpha - 1) * means[0]) ** 2))
        statistic = poisson_batches.renyi_from_gram((sums @ sums.T)[None], (sums @ point)[None, :, None],
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
    passes = poisson_batches.renyi_slices(num_iters=3, num_batches=5, alpha=2, max_batches=6)
    covered = [(target, key) for slices in passes for target, first, end in slices for key in range(first, end)]
    assert sorted(covered) == [(target, key) for target in range(3) for key in range(5)]
    assert all(sum(1 + (end - first) * 2 for _, first, end in slices) <= 6 for slices in passes)


# --- mean rule, coupling (accounting.md §2, §3.2, §3.4) ---------------------------------------

# Sizes 0 and 1 (m(∅) = 0, a batch of one), a gap, and N − 1 (every other row).
COUPLING_SIZES = np.array([0, 1, 2, 5, 9, TRAIN_SIZE - 1])


def coupling_plan(seed=3, step=7, sizes=COUPLING_SIZES, blocks=2, permutations=3):
    return coupling.CouplingPlan(seed, step, sizes, blocks, permutations)


def drawn_batches(plan, num_rows=TRAIN_SIZE):
    """Every draw's batch as an explicit index list (the prefix of its permutation), in the order drawn."""
    return [plan.permutation(block, index, num_rows)[:size].tolist()
            for block in range(plan.blocks) for index in range(plan.permutations) for size in plan.sizes]


def all_rows(data, count):
    """h_i of the first `count` examples, one forward/backward each (float64)."""
    inputs, labels = data
    return reference_batch_means(tiny_convnet(), inputs, labels, PSAC, [[index] for index in range(count)])


@pytest.mark.parametrize("hold", [True, False], ids=["held", "recomputed"])
def test_coupling_sensitivity_matches_reference_and_rejects_batches_holding_the_point(data, hold):
    inputs, labels = data
    plan = coupling_plan()
    points = [0, 6, 13]
    rows, point_gradients = engine_inputs(data, points, hold=hold)
    _, samples = coupling.measure_coupling(rows, point_gradients, plan)
    batches = drawn_batches(plan)
    for row, point in enumerate(points):
        holds_point = np.array([point in batch for batch in batches])
        assert holds_point.any() and not holds_point.all()
        np.testing.assert_array_equal(np.isnan(samples.values[row]), holds_point)
        kept = [batch for batch in batches if point not in batch]
        reference = reference_batch_sensitivities(tiny_convnet(), inputs, labels, PSAC, point, kept)
        assert_close(samples.values[row][~holds_point], reference)


def test_coupling_rows_are_kept_batches_with_their_true_size(data):
    plan = coupling_plan()
    points = [2, 11]
    _, samples = coupling.measure_coupling(*engine_inputs(data, points), plan)
    batches = drawn_batches(plan)
    position, block, sample, size, value = samples.accepted()
    draw = np.concatenate([np.flatnonzero(~np.isnan(samples.values[row])) for row in range(len(points))])
    per_block = plan.permutations * len(plan.sizes)
    for row, point in enumerate(points):
        mine = position == row
        batches_kept = [batches[index] for index in draw[mine]]
        assert all(point not in batch for batch in batches_kept)
        # k = |B ∩ X|: the batch has k rows, none of them x*.
        np.testing.assert_array_equal(size[mine], [len(set(batch) - {point}) for batch in batches_kept])
        np.testing.assert_array_equal(block[mine], draw[mine] // per_block)
        for number in range(plan.blocks):
            in_block = mine & (block == number)
            np.testing.assert_array_equal(sample[in_block], np.arange(in_block.sum()))
    np.testing.assert_array_equal(value, samples.values[position, draw])


def test_coupling_of_a_point_outside_the_training_set_is_never_rejected(data):
    inputs, labels = data
    outside = TRAIN_SIZE
    plan = coupling_plan(sizes=np.array([0, 1, 4, TRAIN_SIZE]))
    rows, point_gradients = engine_inputs(data, [outside, 3], universe=TRAIN_SIZE + 1)
    statistics, samples = coupling.measure_coupling(rows, point_gradients, plan)
    assert not np.isnan(samples.values[0]).any() and np.isnan(samples.values[1]).any()
    reference = reference_batch_sensitivities(tiny_convnet(), inputs, labels, PSAC, outside,
                                                          drawn_batches(plan))
    assert_close(samples.values[0], reference)
    # X is the whole training set: every statistic is exact.
    h = all_rows(data, TRAIN_SIZE + 1)
    training, point = h[:TRAIN_SIZE], h[outside]
    mean = training.mean(axis=0)
    assert_close(statistics.center_distance[0], np.linalg.norm(point - mean))
    assert_close(statistics.spread[0], np.mean(np.sum((training - mean) ** 2, axis=1)))
    assert_close(statistics.max_deviation[0], np.max(np.linalg.norm(training - mean, axis=1)))


@pytest.mark.parametrize("hold", [True, False], ids=["held", "recomputed"])
def test_dataset_statistics_match_a_direct_computation(data, hold):
    points = [0, 9, TRAIN_SIZE - 1]
    statistics, _ = coupling.measure_coupling(*engine_inputs(data, points, hold=hold), coupling_plan())
    h = all_rows(data, TRAIN_SIZE)
    for row, point in enumerate(points):
        others = np.delete(h, point, axis=0)
        mean_x = others.mean(axis=0)
        assert_close(statistics.center_distance[row], np.linalg.norm(h[point] - mean_x))
        assert_close(statistics.spread[row], np.mean(np.sum((others - mean_x) ** 2, axis=1)))
        exact = np.max(np.linalg.norm(others - mean_x, axis=1))
        bound = np.max(np.linalg.norm(h - h.mean(axis=0), axis=1)) + np.linalg.norm(h.mean(axis=0) - mean_x)
        assert_close(statistics.max_deviation[row], bound)
        assert exact <= statistics.max_deviation[row] * (1 + 1e-12)


def test_coupling_is_deterministic_and_seeded(data, monkeypatch):
    plan = coupling_plan()
    first = coupling.measure_coupling(*engine_inputs(data, [1, 4]), plan)[1].values
    again = coupling.measure_coupling(*engine_inputs(data, [1, 4]), plan)[1].values
    assert first.tobytes() == again.tobytes()
    rows, point_gradients = engine_inputs(data, [4])
    alone = coupling.measure_coupling(rows, point_gradients, plan)[1].values
    np.testing.assert_allclose(alone[0], first[1], rtol=1e-12)  # independent of the other points
    monkeypatch.setattr(rows, "pass_batches", lambda num_points, output_bytes: 2 * len(plan.sizes) + 1)  # 2 per pass
    split = coupling.measure_coupling(rows, point_gradients, plan)[1].values
    np.testing.assert_allclose(split, alone, rtol=1e-12)
    other_seed = coupling.measure_coupling(rows, point_gradients, coupling_plan(seed=4))[1].values
    assert not np.allclose(np.nan_to_num(other_seed), np.nan_to_num(alone))
    other_step = coupling_plan(step=8)
    assert not np.array_equal(other_step.permutation(0, 0, TRAIN_SIZE), plan.permutation(0, 0, TRAIN_SIZE))


@pytest.mark.parametrize("hold", [True, False], ids=["held", "recomputed"])
def test_coupling_over_many_column_panels_and_products(data, monkeypatch, hold):
    """Column panels of 50 (13 of them) and products over groups of 4 panels: the same values as one
    panel, and the same statistics."""
    plan = coupling_plan()
    whole = coupling.measure_coupling(*engine_inputs(data, [0, 8], hold=hold), plan)
    monkeypatch.setattr(gradient_rows, "COLUMN_PANEL", 50)
    rows, point_gradients = engine_inputs(data, [0, 8], hold=hold)
    assert rows.dim > coupling.PRODUCT_PANELS * 50 * 2
    split = coupling.measure_coupling(rows, point_gradients, plan)
    np.testing.assert_allclose(split[1].values, whole[1].values, rtol=1e-12)
    for name in ("center_distance", "spread", "max_deviation"):
        np.testing.assert_allclose(getattr(split[0], name), getattr(whole[0], name), rtol=1e-12)


def test_coupling_of_a_point_at_the_mean_is_small():
    """A null population (every h_i equal): every batch mean is h*, so Δ_B = 0 for k ≥ 1 (§6.8)."""
    rows = gradient_rows.HeldRows([torch.ones((8, 3), dtype=torch.float64)], None)
    points = gradient_rows.PointGradients(torch.ones((2, 3), dtype=torch.float64), np.array([0, 5]), None)
    statistics, samples = coupling.measure_coupling(rows, points, coupling_plan(sizes=np.array([0, 1, 3, 7])))
    values = samples.values.reshape(2, -1, 4)
    np.testing.assert_allclose(values[:, :, 0], np.sqrt(3))  # k = 0: ||h*||
    assert np.nanmax(values[:, :, 1:]) < 1e-12
    assert np.all(statistics.center_distance < 1e-12) and np.all(statistics.spread < 1e-12)


def test_coupling_plan_draws_at_least_num_batches_per_point():
    plan = coupling.coupling_plan(seed=0, step=5, n=999, sample_rate=0.05, size_delta=1e-6, num_batches=1000,
                                     blocks=4, max_sizes=32)
    assert plan.k_min == batch_sizes.size_threshold(999, 0.05, 1e-6) == plan.sizes[0] > 0
    assert len(plan.sizes) <= 33 and np.all(np.diff(plan.sizes) > 0)
    assert plan.draws >= 1000 > plan.draws - plan.blocks * len(plan.sizes)
    assert plan.permutations == -(-1000 // (4 * len(plan.sizes)))


# --- held or recomputed rows: the same bits whatever the memory budget ------------------------------

def rows_holding(data, held, points):
    """The engine's rows holding the first `held` training rows (None: all), and the points' gradients."""
    inputs, labels = data
    model = tiny_convnet()
    if held is None:
        return engine_inputs(data, points)
    # Held 8: the points beyond the held rows are kept from the first pass; held 0: recomputed for take.
    rows = gradient_rows.RecomputedRows(model, inputs[:TRAIN_SIZE], labels[:TRAIN_SIZE], PSAC, held=held,
                                      keep=points if held else ())
    return rows, gradient_rows.PointGradients(rows.take(points), np.asarray(points), rows.predictions.take(points))


def test_rows_give_the_same_bits_whichever_are_held(data, monkeypatch):
    """Chunks of 4 rows and column panels of 50: all held, the first 8 held, none held. Every
    quantity of the engine is equal bit for bit (the budget only trades memory for time)."""
    monkeypatch.setattr(gradient_rows, "ROW_CHUNK", 4)
    monkeypatch.setattr(gradient_rows, "COLUMN_PANEL", 50)
    points = [0, 6, 13, 17]
    mask = np.random.default_rng(5).random((7, TRAIN_SIZE)) < 0.4
    plan = coupling_plan()
    pool = Pool(seed=2, step=5, universe=TRAIN_SIZE, sample_rate=0.3, train_columns=np.arange(TRAIN_SIZE))
    results = []
    for held in (None, 8, 0):
        rows, point_gradients = rows_holding(data, held, points)
        assert rows.dim > 2 * 50
        mean, centred = rows.moments()
        statistics, samples = coupling.measure_coupling(rows, point_gradients, plan)
        renyi = poisson_batches.renyi_statistics(rows, point_gradients, points, pool, 2, 2, 3)
        results.append([mean, centred, rows.products(point_gradients.rows), torch.cat(list(rows.sum_panels(mask)), dim=1),
                        rows.take([19, 2, 9]), rows.predictions.losses, point_gradients.rows, samples.values,
                        statistics.spread, statistics.max_deviation, renyi["add"], renyi["remove"],
                        rows.products(point_gradients.rows, rows.dtype), rows.square_norms(),
                        rows.transposed_product(torch.ones((TRAIN_SIZE, 2), dtype=rows.dtype))])
    for recomputed in results[1:]:
        for held_value, value in zip(results[0], recomputed):
            held_value, value = np.asarray(held_value), np.asarray(value)
            assert held_value.tobytes() == value.tobytes()
    # and they are the right values: rows and batch sums against one forward/backward per example
    singles = reference_batch_means(tiny_convnet(), *data, PSAC, [[index] for index in range(TRAIN_SIZE)])
    assert_close(results[2][4], singles[[19, 2, 9]])
    assert_close(results[2][3], mask.astype(float) @ singles)


def test_the_budget_decides_which_rows_are_held(data, monkeypatch):
    inputs, labels = data
    model = tiny_convnet()
    row_bytes = gradient_rows.parameter_count(model) * 8
    monkeypatch.setattr(gradient_rows, "ROW_CHUNK", 4)
    monkeypatch.setattr(gradient_rows, "memory_budget", lambda device: 10**12)
    assert gradient_rows.held_rows(model, TRAIN_SIZE, "cpu") == TRAIN_SIZE
    monkeypatch.setattr(gradient_rows, "HELD_BYTES_CPU", 9 * row_bytes)  # 9 rows fit: 2 whole chunks
    assert gradient_rows.held_rows(model, TRAIN_SIZE, "cpu") == 8
    rows, points = gradient_rows.checkpoint_gradients(model, inputs[:TRAIN_SIZE], labels[:TRAIN_SIZE], inputs[[3, 20]],
                                                    labels[[3, 20]], [3, -1], PSAC, point_rows=False)
    assert isinstance(rows, gradient_rows.RecomputedRows) and rows.held == 8
    assert points.rows is None and points.outside_rows.shape == (1, rows.dim)
    reference = reference_batch_means(tiny_convnet(), inputs, labels, PSAC, [[20]])
    assert_close(points.outside_rows.numpy(), reference)
    monkeypatch.setattr(gradient_rows, "memory_budget", lambda device: 2 * 3 * row_bytes)  # 3 rows: no whole chunk
    assert gradient_rows.held_rows(model, TRAIN_SIZE, "cpu") == 0


def test_a_blocks_draws_do_not_depend_on_the_blocks_measured_with_it(data):
    """torchrun gives each rank some Monte-Carlo blocks: block 1 alone has the same bits as within
    all blocks, and the other blocks' draws are left out (NaN, as rejected draws)."""
    plan = coupling_plan(blocks=3)
    rows, point_gradients = engine_inputs(data, [2, 11])
    _, whole = coupling.measure_coupling(rows, point_gradients, plan)
    _, alone = coupling.measure_coupling(rows, point_gradients, plan, blocks=[1])
    of_block = plan.draw_blocks == 1
    assert whole.values[:, of_block].tobytes() == alone.values[:, of_block].tobytes()
    assert np.isnan(alone.values[:, ~of_block]).all() and not np.isnan(alone.values[:, of_block]).all()
    position, block, sample, _, _ = alone.accepted()
    assert set(block) == {1} and sample.min() == 0


@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda transform: transform.clipping)
def test_statistics_without_rows_equal_the_materialised_ones(data, transform):
    """The rowless statistics (norms, clipped sum, one Jacobian-vector product along μ) against those from the
    materialised per-sample gradients, for training points and the --less-point point."""
    inputs, labels = data
    points = [0, 9, TRAIN_SIZE - 1, TRAIN_SIZE]
    point_rows = [point if point < TRAIN_SIZE else -1 for point in points]
    rows, point_gradients = engine_inputs(data, points, universe=TRAIN_SIZE + 1, transform=transform)
    materialised, _, _ = coupling.measure_statistics(rows, point_gradients)
    rowless, predictions = coupling.checkpoint_statistics(
        tiny_convnet(), inputs[:TRAIN_SIZE], labels[:TRAIN_SIZE], inputs[points], labels[points], point_rows, transform)
    for name in ("center_distance", "spread", "max_deviation"):
        assert_close(getattr(rowless, name), getattr(materialised, name))
    np.testing.assert_array_equal(predictions.correct, point_gradients.predictions.correct)
    assert_close(predictions.losses, point_gradients.predictions.losses)
