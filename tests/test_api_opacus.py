"""IndividualAccountant with Opacus and dp_accounting (docs/api.md): attach on a PrivacyEngine loop with
BatchMemoryManager against the same loop without it and against a loop that records each step by hand; the
labels of held sensitivities (docs/accounting.md §4); Opacus's get_epsilon(alphas=...) and mechanism();
dp_event against get_epsilon(accountant="pld") through dp_accounting's own accountants."""

import math
import warnings

import dp_accounting
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from opacus.accountants import RDPAccountant
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from perinstance import IndividualAccountant, api, sensitivities

DELTA = 1e-5
ORDERS = list(api.DEFAULT_ORDERS)
POINTS, BATCH, PHYSICAL, CLIP = 48, 12, 5, 1.0

warnings.filterwarnings("ignore", message="Secure RNG turned off")


def private_loop(poisson=True, clipping="flat", dropout=0.0):
    """A model, DPOptimizer and Poisson DataLoader from make_private, seeded: the same run every time."""
    torch.manual_seed(0)
    inputs = torch.randn(POINTS, 5)
    labels = (inputs.sum(dim=1) > 0).long()
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(inputs, labels), batch_size=BATCH),
        noise_multiplier=1.0, max_grad_norm=[CLIP, CLIP] * 2 if clipping == "per_layer" else CLIP,
        poisson_sampling=poisson, clipping=clipping, noise_generator=torch.Generator().manual_seed(0))
    return engine, model, optimizer, loader


def train(model, optimizer, loader, epochs=2, before_step=None):
    """Epochs of Opacus training: in physical batches of at most PHYSICAL (BatchMemoryManager), or, with
    before_step, one Poisson batch per step, before_step() run before each."""
    for _ in range(epochs):
        if before_step is None:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=PHYSICAL,
                                    optimizer=optimizer) as batches:
                for inputs, labels in batches:
                    optimizer.zero_grad()
                    F.cross_entropy(model(inputs), labels).backward()
                    optimizer.step()
            continue
        for inputs, labels in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), labels).backward()
            before_step()
            optimizer.step()


def test_attach_leaves_opacus_epsilon_and_counts_the_real_steps():
    engine, model, optimizer, loader = private_loop()
    train(model, optimizer, loader)
    alone = engine.get_epsilon(DELTA)

    engine, model, optimizer, loader = private_loop()
    accountant = IndividualAccountant(POINTS)
    accountant.attach(optimizer, model, loader)
    train(model, optimizer, loader)
    assert engine.get_epsilon(DELTA) == pytest.approx(alone, rel=1e-12, abs=0)
    # The real steps (Poisson batches), not BatchMemoryManager's skipped ones: Opacus's own count.
    steps = sum(entry[2] for entry in engine.accountant.history)
    assert accountant.num_steps == steps == 2 * len(loader)
    assert [entry[:2] for entry in accountant.history] == [entry[:2] for entry in engine.accountant.history] * len(
        accountant)
    # Its worst case (every Δ*/Γ = 1) is Opacus's RDP ε at the same orders, and every point is at most that.
    worst = IndividualAccountant(POINTS)
    for noise_multiplier, sample_rate, num_steps, _ in accountant.history:
        for _ in range(num_steps):
            worst.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    np.testing.assert_allclose(worst.get_epsilon(DELTA), engine.accountant.get_epsilon(DELTA, alphas=ORDERS),
                               rtol=1e-12)
    eps = accountant.get_epsilon(DELTA)
    assert accountant.kind == "certified" and accountant.held_steps == 0 and accountant.certified.all()
    assert np.all(eps <= worst.get_epsilon(DELTA) * (1 + 1e-12)) and eps.min() < 0.9 * eps.max()


def test_attach_measures_at_the_parameters_each_step_starts_from():
    """A loop that measures Δ* by hand before each real step (θ_{t−1}) records the same sensitivities as attach;
    measured after the step (θ_t) they differ, so the test can tell."""
    engine, model, optimizer, loader = private_loop()
    attached = IndividualAccountant(POINTS)
    attached.attach(optimizer, model, loader)
    train(model, optimizer, loader, before_step=lambda: None)

    engine, model, optimizer, loader = private_loop()
    before = []
    train(model, optimizer, loader, before_step=lambda: before.append(
        sensitivities(model, loader, CLIP).numpy() / CLIP))
    after = sensitivities(model, loader, CLIP).numpy() / CLIP
    recorded = [entry[3] for entry in attached.history for _ in range(entry[2])]
    assert len(recorded) == len(before) == attached.num_steps
    np.testing.assert_allclose(np.array(recorded), np.array(before), rtol=1e-12, atol=0)
    assert not np.allclose(before[-1], after, rtol=1e-3)  # the last step moved the parameters


def test_measuring_every_k_steps_holds_sensitivities_and_labels_held_estimates():
    engine, model, optimizer, loader = private_loop()
    accountant = IndividualAccountant(POINTS)
    with accountant.attach(optimizer, model, loader, every=3):
        train(model, optimizer, loader)
    steps = accountant.num_steps
    assert accountant.held_steps == steps - math.ceil(steps / 3) and accountant.kind == "held_estimate"
    # The same steps fed by hand, measured=False where held: the same accountant.
    again = IndividualAccountant(POINTS)
    for noise_multiplier, sample_rate, num_steps, ratios in accountant.history:
        for step in range(num_steps):
            again.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, sensitivity_ratios=ratios,
                       measured=step == 0)
    assert again.held_steps == accountant.held_steps and again.kind == "held_estimate"
    np.testing.assert_array_equal(again.get_epsilon(DELTA), accountant.get_epsilon(DELTA))


def test_detach_stops_recording_and_opacus_goes_on():
    engine, model, optimizer, loader = private_loop()
    accountant = IndividualAccountant(POINTS)
    handle = accountant.attach(optimizer, model, loader)
    train(model, optimizer, loader, epochs=1)
    handle.detach()
    recorded = accountant.num_steps
    train(model, optimizer, loader, epochs=1)
    assert accountant.num_steps == recorded and sum(entry[2] for entry in engine.accountant.history) == 2 * recorded
    with pytest.raises(ValueError, match="optimizer"):
        handle.detach()


def test_dropout_in_training_makes_every_step_held():
    engine, model, optimizer, loader = private_loop(dropout=0.2)
    accountant = IndividualAccountant(POINTS)
    with pytest.warns(UserWarning, match="dropout"):
        accountant.attach(optimizer, model, loader)
    train(model, optimizer, loader, epochs=1)
    assert accountant.kind == "held_estimate" and accountant.held_steps == accountant.num_steps


def refused(call, name, kind=ValueError):
    with pytest.raises(kind) as error:
        call()
    message = str(error.value)
    assert "\n" not in message and name in message, message


def test_bad_attach_arguments_are_refused():
    engine, model, optimizer, loader = private_loop()
    accountant = IndividualAccountant(POINTS)
    refused(lambda: accountant.attach(optimizer.original_optimizer, model, loader), "optimizer", TypeError)
    refused(lambda: accountant.attach(optimizer, nn.Linear(5, 2), loader), "model")
    refused(lambda: accountant.attach(optimizer, model, loader, every=0), "every")
    refused(lambda: accountant.attach(optimizer, model, loader, points=[0, 1]), "points")
    refused(lambda: accountant.attach(optimizer, model, loader.dataset), "poisson_sampling=True")
    accountant.attach(optimizer, model, loader)
    refused(lambda: accountant.attach(optimizer, model, loader), "already")
    _, model, optimizer, loader = private_loop(poisson=False)
    refused(lambda: IndividualAccountant(POINTS).attach(optimizer, model, loader), "poisson_sampling=True")
    _, model, optimizer, loader = private_loop(clipping="per_layer")
    refused(lambda: IndividualAccountant(POINTS).attach(optimizer, model, loader), "clipping='flat'")


# --- Opacus's and dp_accounting's habits -------------------------------------------------------

def mixed_accountant():
    """Three points over 60 steps: Δ*/Γ changing every 20 steps, one point at the worst case throughout."""
    accountant = IndividualAccountant(3)
    for step in range(60):
        ratios = [[0.3, 0.8, 1.0], [0.05, 0.6, 1.0], [0.0, 0.9, 1.0]][step // 20]
        accountant.step(noise_multiplier=1.1, sample_rate=0.05, sensitivity_ratios=ratios)
    return accountant


def test_get_epsilon_takes_opacus_alphas():
    accountant = mixed_accountant()
    np.testing.assert_array_equal(accountant.get_epsilon(DELTA, alphas=[2, 4, 8, 16]),
                                  accountant.get_epsilon(DELTA, orders=[2, 4, 8, 16]))
    np.testing.assert_array_equal(accountant.get_epsilon(DELTA, [2, 4, 8, 16]),
                                  accountant.get_epsilon(DELTA, orders=[2, 4, 8, 16]))
    refused(lambda: accountant.get_epsilon(DELTA, alphas=[2], orders=[3]), "alphas")
    refused(lambda: accountant.get_epsilon(DELTA, alphas=[2], accountant="pld"), "alphas")
    refused(lambda: accountant.get_epsilon(DELTA, alphas=[0.5]), "alphas")
    assert IndividualAccountant.mechanism() == "individual" != RDPAccountant.mechanism()


def test_dp_event_gives_dp_accountings_epsilon():
    """dp_accounting's PLDAccountant on dp_event(point) is get_epsilon(accountant="pld") of the point (the same
    pessimistic discretisation; its composition order differs, whence 1e-6), and its RdpAccountant an upper bound
    close to get_epsilon's RDP (its fractional-order RDP is looser than Opacus's)."""
    accountant = mixed_accountant()
    pld_eps = accountant.get_epsilon(DELTA, accountant="pld")
    rdp_eps = accountant.get_epsilon(DELTA)
    for point in range(3):
        event = accountant.dp_event(point)
        reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3).compose(event)
        assert reference.get_epsilon(DELTA) == pytest.approx(pld_eps[point], rel=1e-6)
        rdp = dp_accounting.rdp.RdpAccountant(ORDERS).compose(event)
        assert rdp_eps[point] <= rdp.get_epsilon(DELTA) * (1 + 1e-9)
        assert rdp.get_epsilon(DELTA) == pytest.approx(rdp_eps[point], rel=1e-3)
    # The worst-case point is Opacus's mechanism itself; the event composes with other mechanisms.
    assert accountant.dp_event(2) == dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        0.05, dp_accounting.GaussianDpEvent(1.1)), 60)
    combined = dp_accounting.ComposedDpEvent([accountant.dp_event(0), dp_accounting.GaussianDpEvent(5.0)])
    assert dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3).compose(combined).get_epsilon(
        DELTA) > pld_eps[0]
    # A point at Δ* = 0 for 20 steps: those steps are no event at all.
    assert sum(part.count for part in accountant.dp_event(0).events) == 40
    refused(lambda: accountant.dp_event(3), "point")
    assert isinstance(IndividualAccountant(2).dp_event(0), dp_accounting.NoOpDpEvent)


def test_held_sensitivities_make_a_held_estimate_except_at_the_worst_case():
    """§4: values reused from an earlier measurement are a held-Δ* estimate; a point held at Δ*/Γ = 1 (the worst case,
    Δ* <= Γ always) stays a bound; steps without sensitivities are bounds."""
    accountant = IndividualAccountant(2)
    accountant.step(noise_multiplier=1.0, sample_rate=0.1)
    accountant.step(noise_multiplier=1.0, sample_rate=0.1)
    assert accountant.kind == "certified"
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, sensitivity_ratios=[0.4, 1.0])
    assert accountant.kind == "certified" and accountant.held_steps == 0
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, sensitivity_ratios=[0.4, 1.0])  # the same values: held
    assert accountant.kind == "held_estimate" and accountant.held_steps == 1
    assert accountant.certified.tolist() == [False, True]
    measured = IndividualAccountant(2)
    for _ in range(2):
        measured.step(noise_multiplier=1.0, sample_rate=0.1, sensitivity_ratios=[0.4, 1.0], measured=True)
    assert measured.kind == "certified"
    measured.step(noise_multiplier=1.0, sample_rate=0.1, sensitivity_ratios=[0.3, 1.0], measured=False)
    assert measured.kind == "held_estimate"
    refused(lambda: measured.step(noise_multiplier=1.0, sample_rate=0.1, measured="yes"), "measured")
