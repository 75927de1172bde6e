"""IndividualFilter (docs/api.md; docs/accounting.md §12) on Opacus loops with BatchMemoryManager: the identities of
§12.5 from the recorded Δ*/Γ and batches, recomputed with Opacus's compute_rdp and get_privacy_spent; the draws of
everyone else against the same run without a filter; Opacus's ε untouched; planted faults that the recomputation
catches; the arguments refused."""

import math
import os
import warnings
from collections import defaultdict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, assert_usage_error, run_in_process
from opacus import PrivacyEngine
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from perinstance import IndividualFilter, sensitivities
from perinstance.accounting import individual_filter
from perinstance.api import RATIO_TOLERANCE

EXAMPLE = os.path.join("examples", "opacus_filter.py")
POINTS, BATCH, PHYSICAL, NOISE, DELTA = 48, 12, 5, 1.0, 1e-5
SAMPLE_RATE = BATCH / POINTS
# Three kinds of points: two budgets that run out within the run, one that does not.
TARGETS = np.array([5.0, 8.0, 40.0] * (POINTS // 3))

warnings.filterwarnings("ignore", message="Secure RNG turned off")


def private_loop(clip=1.0, seed=1, workers=0, poisson=True, dropout=0.0):
    """A model, DPOptimizer and Poisson DataLoader from make_private, seeded (the batches by a generator of
    `seed`, None: the global one), with the training inputs (distinct rows, so that a batch names its points)."""
    torch.manual_seed(0)
    inputs = torch.randn(POINTS, 5)
    labels = (inputs.sum(dim=1) > 0).long()
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine(accountant="rdp")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, noise_multiplier=NOISE, max_grad_norm=clip, poisson_sampling=poisson,
        data_loader=DataLoader(TensorDataset(inputs, labels), batch_size=BATCH, generator=generator,
                               num_workers=workers),
        noise_generator=torch.Generator().manual_seed(0))
    return engine, model, optimizer, loader, inputs


def opacus_steps(engine):
    return sum(entry[2] for entry in engine.accountant.history)


def train(engine, model, optimizer, loader, inputs, epochs=5):
    """Epochs in physical batches of at most PHYSICAL (BatchMemoryManager); returns the points of each real step's
    Poisson batch, {step: set of indices}, found from the inputs' rows."""
    index = {tuple(row.tolist()): point for point, row in enumerate(inputs)}
    batches = defaultdict(set)
    for _ in range(epochs):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=PHYSICAL, optimizer=optimizer) as physical:
            for batch_inputs, labels in physical:
                batches[opacus_steps(engine) + 1] |= {index[tuple(row.tolist())] for row in batch_inputs}
                optimizer.zero_grad()
                F.cross_entropy(model(batch_inputs), labels).backward()
                optimizer.step()
    return batches


def filtered_run(filter_class=IndividualFilter, clip=1.0, targets=TARGETS, seed=1, epochs=5):
    engine, model, optimizer, loader, inputs = private_loop(clip, seed)
    individual = filter_class(POINTS, targets, DELTA)
    filtered = individual.attach(optimizer, model, loader)
    batches = train(engine, model, optimizer, filtered, inputs, epochs)
    return individual, engine, batches


def in_training(individual, step):
    """The points in the training set at `step` (1-based): active then."""
    return (individual.left_at == 0) | (step < individual.left_at)


def recorded_steps(individual):
    """(step, σ, q, Δ*/Γ of every point) of each step, from the filter's record."""
    step = 0
    for noise_multiplier, sample_rate, num_steps, ratios in individual.accountant.history:
        for _ in range(num_steps):
            step += 1
            yield step, noise_multiplier, sample_rate, ratios


def recomputed_charges(individual):
    """§12.5 identity 1: each point's charges at every step it was in the training set, drawn or not, recomputed
    from the recorded Δ*/Γ with Opacus's compute_rdp at λ_f, summed."""
    total = np.zeros(individual.num_points)
    for step, noise_multiplier, sample_rate, ratios in recorded_steps(individual):
        for ratio in np.unique(ratios[in_training(individual, step) & (ratios > 0)]):
            charge = compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier / ratio, steps=1,
                                 orders=[individual.order])[0]
            total[in_training(individual, step) & (ratios == ratio)] += charge
    return total


def within_budgets(individual):
    return bool(np.all(recomputed_charges(individual) <= individual.budget * (1 + 1e-9)))


@pytest.fixture(scope="module")
def filter_run():
    """One filtered run of 20 steps, shared by the tests that only read it."""
    return filtered_run()


def test_charges_recomputed_by_opacus_stay_within_every_budget(filter_run):
    individual, _, _ = filter_run
    charges = recomputed_charges(individual)
    assert within_budgets(individual)
    np.testing.assert_allclose(charges, individual.spent, rtol=1e-9)
    # Budgets ran out and others did not: the run tests the rule, not an idle filter. Points charged below Γ
    # train past uniform DP-SGD's steps within their budget (they leave later, or not at all within 20 steps).
    left = individual.left_at > 0
    assert left[TARGETS == 5.0].all() and left[TARGETS == 8.0].any() and not left[TARGETS == 40.0].any()
    for target in (5.0, 8.0):
        uniform = individual_filter.uniform_steps(SAMPLE_RATE, NOISE, individual.budget[TARGETS == target][0],
                                                  individual.order)
        assert uniform < individual.num_steps
        assert np.any((individual.left_at[TARGETS == target] == 0)
                      | (individual.left_at[TARGETS == target] > uniform + 1)), target


def test_the_points_that_left_are_never_drawn_and_the_others_draw_as_without_a_filter(filter_run):
    """§12.5 identity 2 from the recorded batches, and the rest of Opacus's draws unchanged: each step's batch is
    the batch of the same run without the filter, less the points no longer in training."""
    individual, engine, batches = filter_run
    engine_plain, model, optimizer, loader, inputs = private_loop()
    plain = train(engine_plain, model, optimizer, loader, inputs)
    steps = opacus_steps(engine)
    assert steps == individual.num_steps == opacus_steps(engine_plain) == 20
    for step in range(1, steps + 1):
        allowed = set(np.flatnonzero(in_training(individual, step)).tolist())
        assert batches.get(step, set()) == plain.get(step, set()) & allowed, step
        assert not batches.get(step, set()) & set(np.flatnonzero(~in_training(individual, step)).tolist())
    assert sum(len(plain[step] - batches.get(step, set())) for step in plain) > 0  # some draws were dropped


def test_draws_from_the_global_generator_are_unchanged():
    """A loader without a generator draws from torch's global one: measuring Δ* between the draws takes nothing
    from it, so the points still training are drawn as without the filter."""
    individual, engine, batches = filtered_run(seed=None, epochs=3)
    engine_plain, model, optimizer, loader, inputs = private_loop(seed=None)
    plain = train(engine_plain, model, optimizer, loader, inputs, epochs=3)
    for step in range(1, individual.num_steps + 1):
        allowed = set(np.flatnonzero(in_training(individual, step)).tolist())
        assert batches.get(step, set()) == plain.get(step, set()) & allowed, step


def test_opacus_epsilon_is_unchanged_by_attaching(filter_run):
    individual, engine, _ = filter_run
    engine_plain, model, optimizer, loader, inputs = private_loop()
    train(engine_plain, model, optimizer, loader, inputs)
    assert engine.get_epsilon(DELTA) == pytest.approx(engine_plain.get_epsilon(DELTA), rel=1e-12, abs=0)
    assert engine.accountant.history == engine_plain.accountant.history


def test_the_guarantee_is_the_target_and_bounds_the_composition_along_the_run(filter_run):
    """§12.3: get_epsilon is each point's target at target_delta, and at another δ the budget converted at λ_f
    (Opacus's get_privacy_spent at that one order); §4's composition along the run is never above it."""
    individual, _, _ = filter_run
    assert individual.kind == "guarantee" and individual.composed_kind == "certified"
    np.testing.assert_allclose(individual.get_epsilon(), TARGETS, rtol=1e-12)
    for delta in (DELTA, 1e-3, 1e-8):
        guarantee = individual.get_epsilon(delta)
        for point in (0, 1, 2):
            expected, _ = get_privacy_spent(orders=[individual.order], rdp=[individual.budget[point]], delta=delta)
            assert guarantee[point] == pytest.approx(expected, rel=1e-12)
        composed = individual.composed_epsilon(delta)
        assert np.all(composed <= guarantee * (1 + 1e-9)), delta
    composed = individual.composed_epsilon()
    # The unspent budget shows: the points that never ran out are well below their guarantee.
    assert np.all(composed[TARGETS == 40.0] < 0.5 * 40.0)
    # Along the run it is the IndividualAccountant's composition of the same Δ*, or less (λ_f's exact charges).
    assert np.all(composed <= individual.accountant.get_epsilon(DELTA) * (1 + 1e-12))


def test_every_point_at_the_clip_bound_leaves_after_the_uniform_runs_steps():
    """§12.5 identity 3 on Opacus: with a tiny max_grad_norm every Δ* is Γ, every point is charged the uniform
    run's step and leaves after exactly individual_filter.uniform_steps steps, drawn by none after."""
    individual, engine, batches = filtered_run(clip=1e-6, targets=8.0, epochs=4)
    steps = individual_filter.uniform_steps(SAMPLE_RATE, NOISE, individual.budget[0], individual.order)
    assert 0 < steps < individual.num_steps - 1
    assert np.all(individual.left_at == steps + 1)
    assert all(np.all(ratios == 1.0) for step, _, _, ratios in recorded_steps(individual) if step <= steps)
    assert not any(batches.get(step) for step in range(steps + 1, individual.num_steps + 1))
    assert opacus_steps(engine) == individual.num_steps == 16  # training went on, with empty batches


class HalfCharge(IndividualFilter):
    """A planted fault: half of each charge."""

    def _charges(self, sample_rate, noise_multiplier, sensitivity_ratio, order):
        return super()._charges(sample_rate, noise_multiplier, sensitivity_ratio, order) / 2


class DrawnOnly(IndividualFilter):
    """A planted fault: only the points the step will draw are charged (their draws read ahead from a copy of the
    loader's generator, so that the run's own draws are untouched)."""

    generator = None

    def _charges(self, sample_rate, noise_multiplier, sensitivity_ratio, order):
        ahead = torch.Generator().set_state(self.generator.get_state())
        drawn = (torch.rand(self.num_points, generator=ahead) < sample_rate).numpy()
        return np.where(drawn, super()._charges(sample_rate, noise_multiplier, sensitivity_ratio, order), 0.0)


@pytest.mark.parametrize("fault", [HalfCharge, DrawnOnly])
def test_a_planted_fault_is_caught_by_the_recomputed_charges(fault):
    """§12.5 identity 6: a filter that charges half, or only the drawn points, keeps points past their budgets,
    which the recomputation from the recorded Δ*/Γ shows."""
    engine, model, optimizer, loader, inputs = private_loop()
    faulty = fault(POINTS, TARGETS, DELTA)
    faulty.generator = loader.generator
    filtered = faulty.attach(optimizer, model, loader)
    train(engine, model, optimizer, filtered, inputs)
    assert not within_budgets(faulty)


def test_the_charges_use_the_parameters_each_step_starts_from():
    """The recorded Δ*/Γ of step t are those of a hand measurement just before optimizer.step() (θ_{t−1}); after
    it (θ_t) they differ, so the test can tell."""
    engine, model, optimizer, loader, inputs = private_loop()
    individual = IndividualFilter(POINTS, TARGETS, DELTA)
    filtered = individual.attach(optimizer, model, loader)
    before = []
    for _ in range(2):
        for batch_inputs, labels in filtered:
            optimizer.zero_grad()
            F.cross_entropy(model(batch_inputs), labels).backward()
            before.append(sensitivities(model, loader, 1.0).numpy())
            optimizer.step()
    after = sensitivities(model, loader, 1.0).numpy()
    for (step, _, _, ratios), measured in zip(recorded_steps(individual), before, strict=True):
        active = ratios > 0
        expected = np.where(measured >= 1 - RATIO_TOLERANCE, 1.0, measured)  # float32 clipped norms count as Γ
        np.testing.assert_allclose(ratios[active], expected[active], rtol=1e-12, atol=0)
        assert not np.any(ratios[~in_training(individual, step)])
    assert not np.allclose(before[-1], after, rtol=1e-3)


def test_state_dict_round_trip_resumes_exactly(tmp_path, filter_run):
    individual, _, _ = filter_run
    torch.save(individual.state_dict(), tmp_path / "filter.pt")
    restored = IndividualFilter(POINTS, TARGETS, DELTA)
    restored.load_state_dict(torch.load(tmp_path / "filter.pt", weights_only=True))
    assert restored.order == individual.order and restored.num_steps == individual.num_steps
    np.testing.assert_array_equal(restored.spent, individual.spent)
    np.testing.assert_array_equal(restored.left_at, individual.left_at)
    np.testing.assert_array_equal(restored.composed_epsilon(), individual.composed_epsilon())
    ratios = np.linspace(0.2, 1.0, POINTS)
    copy = IndividualFilter(POINTS, TARGETS, DELTA)
    copy.load_state_dict(individual.state_dict())
    for _ in range(5):
        expected = copy.step(noise_multiplier=NOISE, sample_rate=SAMPLE_RATE, sensitivity_ratios=ratios)
        np.testing.assert_array_equal(restored.step(noise_multiplier=NOISE, sample_rate=SAMPLE_RATE,
                                                    sensitivity_ratios=ratios), expected)
    np.testing.assert_array_equal(restored.spent, copy.spent)
    state = individual.state_dict()
    refused(lambda: IndividualFilter(POINTS, 6.0, DELTA).load_state_dict(state), "target_epsilon")
    refused(lambda: IndividualFilter(POINTS, TARGETS, DELTA, order=9.0).load_state_dict(state), "order")
    refused(lambda: IndividualFilter(POINTS + 1, 6.0, DELTA).load_state_dict(state), "num_points")
    state["filter"]["budget"] = state["filter"]["budget"] * 2
    refused(lambda: IndividualFilter(POINTS, TARGETS, DELTA).load_state_dict(state), "budgets")


def test_steps_by_hand_choose_the_order_then_keep_it():
    """Without attach: the first step fixes λ_f (individual_filter.default_order at its σ, q and the smallest
    target); the ratios of points no longer active are ignored, and full charges last the uniform run's steps."""
    individual = IndividualFilter(3, [6.0, 6.0, 9.0], DELTA)
    assert individual.order is None and individual.get_epsilon().tolist() == [6.0, 6.0, 9.0]
    refused(lambda: individual.get_epsilon(1e-3), "order")
    steps = 0
    while individual.active[:2].any():
        ratios = [1.0, 0.5, 1.0] if individual.active[0] else [math.nan, 0.5, 1.0]
        individual.step(noise_multiplier=NOISE, sample_rate=SAMPLE_RATE, sensitivity_ratios=ratios)
        steps += 1
    assert individual.order == individual_filter.default_order(SAMPLE_RATE, NOISE, 6.0, DELTA)
    uniform = individual_filter.uniform_steps(SAMPLE_RATE, NOISE, individual.budget[0], individual.order)
    assert individual.left_at[0] == uniform + 1 < individual.left_at[1] and individual.active[2] == (
        individual_filter.uniform_steps(SAMPLE_RATE, NOISE, individual.budget[2], individual.order) >= steps)


def refused(call, name, kind=ValueError):
    with pytest.raises(kind) as error:
        call()
    message = str(error.value)
    assert "\n" not in message and name in message, message


def test_bad_filter_arguments_are_refused():
    for targets in (-1.0, math.nan, math.inf, 0.0, [6.0] * (POINTS - 1), "six"):
        refused(lambda targets=targets: IndividualFilter(POINTS, targets, DELTA), "target_epsilon")
    refused(lambda: IndividualFilter(0, 6.0, DELTA), "num_points")
    refused(lambda: IndividualFilter(POINTS, 6.0, 1.5), "target_delta")
    for order in (1.0, 0.5, math.inf, "two"):
        refused(lambda order=order: IndividualFilter(POINTS, 6.0, DELTA, order=order), "order")
    # §12.1: λ_f = 2 at δ = 1e-5 gives no budget to any ε <= 10.1.
    refused(lambda: IndividualFilter(POINTS, [6.0] + [20.0] * (POINTS - 1), DELTA, order=2.0), "target_epsilon")
    refused(lambda: IndividualFilter(POINTS, 1e-3, DELTA).step(noise_multiplier=NOISE, sample_rate=SAMPLE_RATE,
                                                               sensitivity_ratios=np.ones(POINTS)), "target_epsilon")
    individual = IndividualFilter(POINTS, 6.0, DELTA)
    refused(lambda: individual.step(noise_multiplier=NOISE, sample_rate=SAMPLE_RATE,
                                    sensitivity_ratios=np.full(POINTS, 1.5)), "sensitivity_ratios")
    refused(lambda: individual.step(noise_multiplier=NOISE, sample_rate=SAMPLE_RATE,
                                    sensitivity_ratios=np.ones(3)), "sensitivity_ratios")
    refused(lambda: individual.step(noise_multiplier=0.0, sample_rate=SAMPLE_RATE,
                                    sensitivity_ratios=np.ones(POINTS)), "noise_multiplier")
    refused(lambda: individual.get_epsilon(2.0), "delta")
    assert individual.order is None and individual.num_steps == 0  # a refused step records nothing


def test_bad_attach_arguments_are_refused():
    engine, model, optimizer, loader, _ = private_loop()
    individual = IndividualFilter(POINTS, 6.0, DELTA)
    refused(lambda: individual.attach(optimizer, model, loader, every=2), "every")
    refused(lambda: individual.attach(optimizer.original_optimizer, model, loader), "optimizer", TypeError)
    refused(lambda: individual.attach(optimizer, nn.Linear(5, 2), loader), "model")
    refused(lambda: IndividualFilter(POINTS - 1, 6.0, DELTA).attach(optimizer, model, loader), "data")
    _, other_model, other_optimizer, other_loader, _ = private_loop(poisson=False)
    refused(lambda: individual.attach(other_optimizer, other_model, other_loader), "poisson_sampling=True")
    _, other_model, other_optimizer, other_loader, _ = private_loop(workers=2)
    refused(lambda: individual.attach(other_optimizer, other_model, other_loader), "num_workers")
    _, other_model, other_optimizer, other_loader, _ = private_loop(dropout=0.2)
    refused(lambda: individual.attach(other_optimizer, other_model, other_loader), "dropout")
    filtered = individual.attach(optimizer, model, loader)
    refused(lambda: individual.attach(optimizer, model, loader), "already")
    refused(lambda: IndividualFilter(POINTS, 6.0, DELTA).attach(optimizer, model, loader), "already")
    refused(lambda: IndividualFilter(POINTS, 6.0, DELTA).attach(optimizer, model, filtered), "already")


def test_a_loop_out_of_order_is_stopped_before_the_step():
    """Two batches drawn without a step between them (a prefetch would do that), or a step on a batch of another
    loader: a one-line ValueError, and Opacus's accountant does not count the step."""
    engine, model, optimizer, loader, _ = private_loop()
    filtered = IndividualFilter(POINTS, 6.0, DELTA).attach(optimizer, model, loader)
    batches = iter(filtered)
    next(batches)
    refused(lambda: next(batches), "before optimizer.step()")
    engine, model, optimizer, loader, _ = private_loop()
    IndividualFilter(POINTS, 6.0, DELTA).attach(optimizer, model, loader)
    batch_inputs, labels = next(iter(loader))  # Opacus's own loader, not the filter's
    F.cross_entropy(model(batch_inputs), labels).backward()
    refused(optimizer.step, "optimizer")
    assert opacus_steps(engine) == 0


def test_the_example_trains_with_a_filter_and_prints_guarantees_beside_opacus(tmp_path):
    """examples/opacus_filter.py --smoke: the charges of its run, recomputed, stay within the budgets; each point's
    composition along the run stays at most its guarantee, which is the target; points left, others trained on
    past the steps uniform DP-SGD takes within the target (Opacus's ε, which does not know the filter, passes it)."""
    result = run_in_process(EXAMPLE, "--smoke", "--save", tmp_path / "filter.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "epoch 3: 12 steps" in result.stdout and "5.000 (guarantee, over every trajectory)" in result.stdout
    assert "(certified); Opacus's ε" in result.stdout and "points left the training set" in result.stdout
    saved = torch.load(tmp_path / "filter.pt", weights_only=True)
    individual = IndividualFilter(saved["dataset_size"], 5.0, saved["delta"])
    individual.load_state_dict(saved["filter"])
    assert individual.num_steps == saved["total_steps"] == 12 and within_budgets(individual)
    np.testing.assert_allclose(saved["guarantee"].numpy(), 5.0, rtol=1e-12)
    composed = saved["composed"].numpy()
    assert np.all(composed <= 5.0 * (1 + 1e-9)) and np.array_equal(composed, individual.composed_epsilon())
    assert 0 < (individual.left_at > 0).sum() < individual.num_points and saved["opacus_eps"] > 5.0
    assert f"{(individual.left_at > 0).sum()} of 128 points left" in result.stdout


@pytest.mark.parametrize("flags, flag", [(["--order", "1"], "--order"), (["--target-epsilon", "0.01"],
                                                                        "--target-epsilon"),
                                         (["--order", "2"], "--target-epsilon")])
def test_the_example_refuses_bad_flags_in_one_line_and_writes_nothing(tmp_path, flags, flag):
    result = run_in_process(EXAMPLE, "--smoke", *flags, "--save", "out.pt", cwd=tmp_path)
    assert_usage_error(result, flag)
    assert not (tmp_path / "out.pt").exists()


def test_the_snippet_of_api_md_runs_as_written(capsys):
    text = open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8").read()
    after = text[text.index("## Budgets per point: `IndividualFilter`"):]
    start = after.index("```python\n") + len("```python\n")
    exec(compile(after[start:after.index("```", start)], "docs/api.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "points left; Opacus's ε" in printed and float(printed.split()[0]) == pytest.approx(4.0, rel=1e-12)
