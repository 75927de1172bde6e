"""The Gram route of the mean rule's Monte Carlo (perinstance/measure/gram.py, persample/gram_forms.py) against the
materialised per-sample gradients and the forward/backward-per-batch reference (accounting.md §2)."""

import numpy as np
import pytest
import test_sensitivity
import torch
from reference import reference_batch_means, reference_batch_sensitivities
from test_sensitivity import (
    COUPLING_SIZES,
    PSAC,
    TRAIN_SIZE,
    assert_close,
    assert_renyi_matches_reference,
    coupling_plan,
    drawn_batches,
    engine_inputs,
    tiny_convnet,
)
from torch import nn

from perinstance.measure import coupling, gram, poisson_batches
from perinstance.measure.gram import Workload
from perinstance.measure.poisson_batches import Pool
from perinstance.persample import gram_forms
from perinstance.train.clipping import Transform

# A workload for which every layer costs less in the Gram, and one for which every layer is kept as rows.
ALL_GRAM = Workload(points=10 ** 6, batches=10 ** 6, members=10 ** 9, group=1)
ALL_ROWS = Workload(points=1, batches=1, members=1, group=1)
data = test_sensitivity.data  # the fixture: the 21 examples of test_sensitivity.py


def ghost_convnet():
    """A convolution in the ghost form (materialised for the Gram), one without bias, a Linear layer whose weight
    is frozen (its bias alone trains) and one without bias."""
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.Tanh(),
        nn.Conv2d(16, 40, 3, padding=1, stride=2, bias=False), nn.Tanh(),  # 3×3 outputs: ghost for its norms
        nn.Flatten(), nn.Linear(360, 6), nn.Tanh(), nn.Linear(6, 5, bias=False), nn.Tanh(), nn.Linear(5, 3),
    ).double()
    model[5].weight.requires_grad_(False)
    return model


def layer_norm_net():
    """A LayerNorm, which the engine does not cover: the Gram takes the materialised per-sample gradients."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3)).double()


MODELS = {"tiny convnet": tiny_convnet, "ghost convnet": ghost_convnet, "LayerNorm": layer_norm_net}


def all_rows(model, data, transform=PSAC):
    """h_i of every example, one forward/backward each (float64)."""
    inputs, labels = data
    return reference_batch_means(model, inputs, labels, transform, [[index] for index in range(len(labels))])


def gram_of(data, points, workload, model=tiny_convnet, universe=TRAIN_SIZE, transform=PSAC):
    """The checkpoint's Gram and the points' PointGradients; universe TRAIN_SIZE + 1: the last example is the
    --less-point point."""
    inputs, labels = data
    point_rows = [point if point < TRAIN_SIZE else -1 for point in points]
    return gram.checkpoint_gram(model(), inputs[:TRAIN_SIZE], labels[:TRAIN_SIZE], inputs[points], labels[points],
                                point_rows, transform, workload)


def alternate(monkeypatch):
    """Every other layer in the Gram, the others kept as rows."""
    monkeypatch.setattr(gram, "_in_gram", lambda factor, count, workload: factor.width % 2 == 0)


SPLITS = ["all in the Gram", "all as rows", "mixed"]


def split_workload(split, monkeypatch):
    if split == "mixed":
        alternate(monkeypatch)
    return ALL_ROWS if split == "all as rows" else ALL_GRAM


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("name", MODELS)
def test_gram_is_the_centred_products_of_the_gradients(data, name, split, monkeypatch):
    workload = split_workload(split, monkeypatch)
    checkpoint, points = gram_of(data, [2, TRAIN_SIZE], workload, MODELS[name], universe=TRAIN_SIZE + 1)
    rows = all_rows(MODELS[name](), data)
    mean = rows[:TRAIN_SIZE].mean(axis=0)
    centred = rows - mean
    parts = (checkpoint.panels is not None, checkpoint.rows is not None)
    assert parts == {"all in the Gram": (True, False), "all as rows": (False, True),
                     "mixed": (True, True) if name != "LayerNorm" else parts}[split]
    if split == "all as rows":
        assert checkpoint.row_width == rows.shape[1]  # every trainable parameter, materialised
    np.testing.assert_allclose(checkpoint.products(np.arange(TRAIN_SIZE + 1)).numpy(), centred @ centred.T,
                               rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(checkpoint.centred_square.numpy(), (centred ** 2).sum(axis=1), rtol=1e-10)
    np.testing.assert_allclose(checkpoint.mean_dots.numpy(), rows @ mean, rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(checkpoint.mean_square, mean @ mean, rtol=1e-10)
    np.testing.assert_allclose(checkpoint.point_squares(np.array([2, TRAIN_SIZE])).numpy(),
                               (rows[[2, TRAIN_SIZE]] ** 2).sum(axis=1), rtol=1e-10)
    np.testing.assert_array_equal(checkpoint.rows_of(points), [2, TRAIN_SIZE])
    logits = MODELS[name]()(data[0][[2, TRAIN_SIZE]])
    losses = nn.functional.cross_entropy(logits, data[1][[2, TRAIN_SIZE]], reduction="none").detach().numpy()
    np.testing.assert_allclose(points.predictions.losses, losses, rtol=1e-10)


def smoothed_loss(outputs, targets):
    """A loss of the run's own (--loss): cross-entropy with label smoothing, one value per example."""
    return nn.functional.cross_entropy(outputs, targets, reduction="none", label_smoothing=0.3)


@pytest.mark.parametrize("name", MODELS)
def test_gram_of_a_loss_of_the_runs_own_is_the_centred_products_of_its_gradients(data, name, monkeypatch):
    """With `loss_fn`, the Gram is built from the gradients of that loss: here against one backward per example
    of the smoothed loss, written out (the mixed split: factors in the Gram and kept as rows)."""
    inputs, labels = data
    model = MODELS[name]()
    rows = []
    for index in range(len(labels)):
        model.zero_grad()
        smoothed_loss(model(inputs[index:index + 1]), labels[index:index + 1]).sum().backward()
        gradient = torch.cat([param.grad.reshape(-1) for param in model.parameters() if param.requires_grad])
        rows.append((PSAC.weights(gradient.norm()[None]) * gradient).detach().numpy())
    rows = np.stack(rows)
    centred = rows - rows[:TRAIN_SIZE].mean(axis=0)
    alternate(monkeypatch)
    point_rows = [2, -1]
    checkpoint, points = gram.checkpoint_gram(MODELS[name](), inputs[:TRAIN_SIZE], labels[:TRAIN_SIZE],
                                              inputs[[2, TRAIN_SIZE]], labels[[2, TRAIN_SIZE]], point_rows, PSAC,
                                              ALL_GRAM, loss_fn=smoothed_loss)
    np.testing.assert_allclose(checkpoint.products(np.arange(TRAIN_SIZE + 1)).numpy(), centred @ centred.T,
                               rtol=1e-10, atol=1e-13)
    losses = smoothed_loss(MODELS[name]()(inputs[[2, TRAIN_SIZE]]), labels[[2, TRAIN_SIZE]]).detach().numpy()
    np.testing.assert_allclose(points.predictions.losses, losses, rtol=1e-10)


def test_the_engine_covers_its_layers_and_not_a_layer_norm():
    assert gram_forms.gram_covers(tiny_convnet()) and gram_forms.gram_covers(ghost_convnet())
    assert not gram_forms.gram_covers(layer_norm_net())


def test_groups_blocks_and_panels_change_nothing(data, monkeypatch):
    """Factors held a few columns at a time (many passes, rows factors split by columns), blocks of 8 rows and
    panels of 6 columns (blocks across panels): the same Gram as one pass."""
    whole, _ = gram_of(data, [0], ALL_GRAM)
    monkeypatch.setattr(gram, "FACTOR_BYTES", {"cpu": 8 * TRAIN_SIZE * 5})
    monkeypatch.setattr(gram, "GRAM_BLOCK", {"cpu": 8})
    monkeypatch.setattr(gram, "MIN_PANEL", 6)
    monkeypatch.setattr(gram, "PANEL_STEP", 6)
    monkeypatch.setattr(gram, "PANEL_BYTES", {"cpu": 1})
    groups = gram._plan(tiny_convnet(), *data, PSAC, ALL_GRAM, "cpu", TRAIN_SIZE)[1]
    assert len(groups) > 4 and any(piece.columns is not None and piece.columns.start > 0
                                   for group in groups for piece in group)
    split, _ = gram_of(data, [0], ALL_GRAM)
    assert split.panels.shape[0] == 4
    np.testing.assert_allclose(split.products(np.arange(TRAIN_SIZE)), whole.products(np.arange(TRAIN_SIZE)),
                               rtol=1e-12, atol=1e-15)


def test_rows_that_do_not_fit_go_to_the_gram(data, monkeypatch):
    monkeypatch.setattr(gram, "FACTOR_BYTES", {"cpu": 8 * TRAIN_SIZE * 40})
    held, groups = gram._plan(tiny_convnet(), *data, PSAC, ALL_ROWS, "cpu", TRAIN_SIZE)
    assert held and groups  # GroupNorm's 16 values per example fit, the others' do not


# --- the Monte Carlo through the Gram --------------------------------------------------------------------

@pytest.mark.parametrize("split", SPLITS)
def test_renyi_statistic_by_the_gram_matches_the_reference(data, split, monkeypatch):
    workload = split_workload(split, monkeypatch)
    assert_renyi_matches_reference(data, lambda points, universe: gram_of(data, points, workload, universe=universe))


def test_renyi_statistic_by_the_gram_equals_the_rows_route(data):
    pool = Pool(seed=1, step=3, universe=TRAIN_SIZE, sample_rate=0.3, train_columns=np.arange(TRAIN_SIZE))
    points = [1, 2, 11]
    by_rows = poisson_batches.renyi_statistics(*engine_inputs(data, points), points, pool, 2, 3, 4)
    by_gram = poisson_batches.renyi_statistics(*gram_of(data, points, ALL_GRAM), points, pool, 2, 3, 4)
    for direction in poisson_batches.DIRECTIONS:
        np.testing.assert_allclose(by_gram[direction], by_rows[direction], rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("split", SPLITS)
def test_coupling_by_the_gram_matches_the_reference_and_rejects_batches_holding_the_point(data, split,
                                                                                          monkeypatch):
    workload = split_workload(split, monkeypatch)
    inputs, labels = data
    plan = coupling_plan()
    points = [0, 6, 13]
    statistics, samples = coupling.measure_coupling(*gram_of(data, points, workload), plan)
    batches = drawn_batches(plan)
    for row, point in enumerate(points):
        holds_point = np.array([point in batch for batch in batches])
        np.testing.assert_array_equal(np.isnan(samples.values[row]), holds_point)
        kept = [batch for batch in batches if point not in batch]
        reference = reference_batch_sensitivities(tiny_convnet(), inputs, labels, PSAC, point, kept)
        assert_close(samples.values[row][~holds_point], reference)
    by_rows, _ = coupling.measure_coupling(*engine_inputs(data, points), plan)
    for name in ("center_distance", "spread", "max_deviation"):
        np.testing.assert_allclose(getattr(statistics, name), getattr(by_rows, name), rtol=1e-10)


def test_coupling_by_the_gram_of_a_point_outside_the_training_set(data):
    inputs, labels = data
    outside = TRAIN_SIZE
    plan = coupling_plan(sizes=np.array([0, 1, 4, TRAIN_SIZE]))
    checkpoint, point_gradients = gram_of(data, [outside, 3], ALL_GRAM, universe=TRAIN_SIZE + 1)
    statistics, samples = coupling.measure_coupling(checkpoint, point_gradients, plan)
    assert not np.isnan(samples.values[0]).any() and np.isnan(samples.values[1]).any()
    assert_close(samples.values[0], reference_batch_sensitivities(tiny_convnet(), inputs, labels, PSAC, outside,
                                                                  drawn_batches(plan)))
    rows = all_rows(tiny_convnet(), data)
    mean = rows[:TRAIN_SIZE].mean(axis=0)
    assert_close(statistics.center_distance[0], np.linalg.norm(rows[outside] - mean))
    assert_close(statistics.spread[0], np.mean(np.sum((rows[:TRAIN_SIZE] - mean) ** 2, axis=1)))


def test_coupling_by_the_gram_does_not_depend_on_passes_blocks_or_other_points(data, monkeypatch):
    plan = coupling_plan()
    together = coupling.measure_coupling(*gram_of(data, [1, 4], ALL_GRAM), plan)[1].values
    alone = coupling.measure_coupling(*gram_of(data, [4], ALL_GRAM), plan)[1].values
    np.testing.assert_allclose(alone[0], together[1], rtol=1e-12)
    one_block = coupling.measure_coupling(*gram_of(data, [4], ALL_GRAM), plan, blocks=[1])[1].values
    per_block = plan.permutations * len(plan.sizes)
    assert np.isnan(one_block[:, :per_block]).all()
    np.testing.assert_allclose(one_block[:, per_block:], alone[:, per_block:], rtol=1e-12)
    monkeypatch.setattr(coupling, "pass_batches", lambda *arguments: len(plan.sizes))  # one permutation a pass
    split = coupling.measure_coupling(*gram_of(data, [4], ALL_GRAM), plan)[1].values
    np.testing.assert_allclose(split, alone, rtol=1e-12)


# --- float accuracy where Δ_B is tiny ---------------------------------------------------------------------

def near_copies(spread, count=64, dtype=torch.float32):
    """`count` inputs that are one input plus noise of relative size `spread`, all of one label, and a float32
    linear model: per-sample gradients that differ by about `spread` of their size."""
    generator = torch.Generator().manual_seed(4)
    base = torch.randn(1, 1, 6, 6, generator=generator, dtype=torch.float64)
    inputs = base + spread * torch.randn(count, 1, 6, 6, generator=generator, dtype=torch.float64)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    return model, inputs.to(dtype), torch.zeros(count, dtype=torch.long)


def factor_rows(model, inputs, labels, transform):
    """h_i exactly as the Gram receives them: the engine's float32 factors b_i, a_i of each layer, their products
    b_i a_iᵀ taken in float64 (exact for float32 operands)."""
    factors = gram_forms.gram_factors(model, inputs, labels, transform.weights).factors
    return torch.cat([(factor.outputs.double()[:, :, None] * factor.inputs.double()[:, None, :]).flatten(1)
                      for factor in factors], dim=1)


@pytest.mark.parametrize("spread, split, rtol", [(1e-3, "all in the Gram", 1e-5), (1e-5, "all in the Gram", 1e-4),
                                                 (1e-3, "all as rows", 1e-3)])
def test_tiny_batch_sensitivities_stay_accurate_in_float32(spread, split, rtol):
    """Gradients equal to a part in 10³ or 10⁵: Δ_B is that small against ||h||, which a Gram of uncentred
    float32 products would lose (float32 keeps 7 digits of ||h||²). The outer factors' products are float64 and
    the Gram is centred, so Δ_B keeps its relative accuracy against float64 values from the same float32
    factors. Layers kept as materialised float32 rows round each h_i to 6·10⁻⁸ of its size, as the rows
    route does: there the relative error grows as 1/spread. Never negative, never NaN but where rejected."""
    model, inputs, labels = near_copies(spread)
    transform = Transform("flat", 10.0)
    count = len(labels)
    workload = ALL_ROWS if split == "all as rows" else ALL_GRAM
    checkpoint, points = gram.checkpoint_gram(model, inputs, labels, inputs[:4], labels[:4], np.arange(4), transform,
                                              workload)
    assert (checkpoint.rows is None) == (split == "all in the Gram")
    plan = coupling.CouplingPlan(seed=1, step=0, sizes=np.array([0, 1, 5, 20, count - 1]), blocks=2, permutations=4)
    statistics, samples = coupling.measure_coupling(checkpoint, points, plan)
    rows = factor_rows(model, inputs, labels, transform)
    values = samples.values
    assert np.all(np.isnan(values) | (values >= 0))
    draws = [(block, index, size) for block in range(plan.blocks) for index in range(plan.permutations)
             for size in plan.sizes]
    for position in range(4):
        for column, (block, index, size) in enumerate(draws):
            batch = plan.permutation(block, index, count)[:size]
            if position in batch:
                assert np.isnan(values[position, column])
                continue
            mean = rows[batch].sum(dim=0) / max(size, 1)
            expected = float(torch.linalg.norm(rows[position] - mean)) / (size + 1)
            np.testing.assert_allclose(values[position, column], expected, rtol=rtol)
    centred = rows - rows.mean(dim=0)
    np.testing.assert_allclose(statistics.center_distance[0],
                               float(torch.linalg.norm(rows[0] - rows[1:].mean(dim=0))), rtol=rtol)
    assert 0 < float((centred ** 2).sum(dim=1).mean()) < (10 * spread * float(torch.linalg.norm(rows[0]))) ** 2


def test_identical_gradients_give_zero_batch_sensitivity():
    """Every h_i equal (§6.8 in spirit): Δ_B = 0 for k ≥ 1 up to float64 rounding of ||h||², ||h*|| for k = 0."""
    model, inputs, labels = near_copies(0.0, count=16)
    checkpoint, points = gram.checkpoint_gram(model, inputs, labels, inputs[:2], labels[:2], np.arange(2),
                                              Transform("flat", 10.0), ALL_GRAM)
    plan = coupling.CouplingPlan(seed=0, step=0, sizes=np.array([0, 1, 3, 15]), blocks=1, permutations=3)
    statistics, samples = coupling.measure_coupling(checkpoint, points, plan)
    values = samples.values.reshape(2, -1, 4)
    norm = float(checkpoint.point_squares(np.array([0])).sqrt())
    np.testing.assert_allclose(values[:, :, 0], norm, rtol=1e-6)
    assert np.nanmax(values[:, :, 1:]) <= 1e-7 * norm
    assert np.all(statistics.spread <= 1e-12 * norm ** 2)
    assert np.all(statistics.center_distance <= 1e-7 * norm) and np.all(statistics.max_deviation <= 1e-7 * norm)


# --- the route ---------------------------------------------------------------------------------------------

def test_the_gram_route_needs_the_gram_to_fit_and_rows_shorter_than_a_gradient(monkeypatch):
    model = tiny_convnet()  # 603 parameters, float64
    assert gram.gram_route(model, 602, "cpu") and not gram.gram_route(model, 603, "cpu")
    monkeypatch.setattr(gram, "GRAM_BYTES", {"cpu": 8 * 100 ** 2 - 1})
    assert not gram.gram_route(model, 100, "cpu") and gram.gram_route(model, 99, "cpu")


def test_workloads_count_the_draws():
    plan = coupling.CouplingPlan(seed=0, step=0, sizes=COUPLING_SIZES, blocks=2, permutations=3)
    assert coupling.coupling_workload(5, [plan, plan]) == Workload(points=5, batches=2 * plan.draws,
                                                                   members=2 * 2 * 3 * COUPLING_SIZES[-1],
                                                                   group=len(COUPLING_SIZES))
    pool = Pool(seed=0, step=0, universe=1000, sample_rate=0.1, train_columns=np.arange(1000))
    assert poisson_batches.renyi_workload(3, pool, 4, 2, 5) == Workload(points=3, batches=42, members=4200, group=5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("split", SPLITS)
def test_the_gram_route_on_cuda_equals_the_cpu(data, split, monkeypatch):
    """Every part of the Gram route on a GPU (its block and panel sizes are the GPU's): the coupling's values and
    GLA's statistic equal the CPU's to float64 rounding."""
    workload = split_workload(split, monkeypatch)
    inputs, labels = data
    points = [0, 5, TRAIN_SIZE]
    point_rows = [0, 5, -1]
    plan = coupling_plan()
    pool = Pool(seed=1, step=3, universe=TRAIN_SIZE, sample_rate=0.3, train_columns=np.arange(TRAIN_SIZE))
    results = []
    for device in ("cpu", "cuda"):
        checkpoint, point_gradients = gram.checkpoint_gram(tiny_convnet().to(device), inputs[:TRAIN_SIZE],
                                                           labels[:TRAIN_SIZE], inputs[points], labels[points],
                                                           point_rows, PSAC, workload, device)
        statistics, samples = coupling.measure_coupling(checkpoint, point_gradients, plan)
        renyi = poisson_batches.renyi_statistics(checkpoint, point_gradients, [0, 5, 19], pool, 2, 2, 3)
        results.append((samples.values, statistics.spread, renyi["remove"], renyi["add"]))
    for on_cpu, on_cuda in zip(*results):
        np.testing.assert_allclose(on_cuda, on_cpu, rtol=1e-9, atol=1e-14)
