"""A composition is a bound only when Δ* was measured at every step (docs/accounting.md §4): the rule that
decides it (reading.every_step), the labels of renyi_per_instance_sum_compo.py's output, and --steps,
which keeps a run's checkpoints out of every-step rows. Every composed number is held against Opacus's RDP
of each step, computed here one step at a time."""

import numpy as np
import pandas as pd
import pytest
from conftest import assert_usage_error
from opacus.accountants.analysis import rdp as opacus_rdp

from perinstance.analysis import reading
from perinstance.files.results import COLUMNS

SIGMA, CLIP, RATE, BATCH, SIZE, STEPS = 1.1, 1.0, 0.05, 50, 1000, 24
ORDERS = [2, 4, 8, 16, 32, 64]
CHECKPOINTS = (0, 8, 16, 24)


def rows(norms, run="a", seed=0):
    """grad_norm rows of {(step, point): Δ*}."""
    base = dict(run=run, seed=seed, stage="", total_steps=STEPS, label=1, correct=1, loss=0.5, exp="tracked",
                reduction="sum", direction="none", target_batch=0, sample=0, quantity="grad_norm", alpha="",
                sigma=SIGMA, clip_bound=CLIP, sample_rate=RATE, batch_size=BATCH, dataset_size=SIZE,
                noise_std=SIGMA * CLIP, dataset="synthetic", model="mlp", clipping="flat", update_rule="sum",
                target_eps="", delta=1e-5, accuracy=0.9)
    return pd.DataFrame([dict(base, step=step, point=point, value=value) for (step, point), value in norms.items()],
                        columns=COLUMNS)


def rising(step, point):
    """Δ* that grows between checkpoints: holding the checkpoint's value undercharges every later step."""
    return CLIP * min(1.0, 0.2 + 0.03 * (step % 8) + 0.1 * point)


def norms_at(steps, points=range(3), value=rising):
    return {(step, point): value(step, point) for step in steps for point in points}


def write(tmp_path, name, frame):
    (tmp_path / "res").mkdir(exist_ok=True)
    frame.to_csv(tmp_path / "res" / f"{name}.csv", index=False)


def loaded(tmp_path, frame):
    write(tmp_path, "rows", frame)
    source = reading.Source(res_name="rows", res_file=None, res_dir=str(tmp_path / "res"))
    return reading.load(source, ["grad_norm"], one_run=False)


def compose(run, tmp_path, name, *flags):
    out = f"{name}_{len(list(tmp_path.glob(f'{name}_*.csv')))}.csv"
    result = run("renyi_per_instance_sum_compo.py", "--res-name", name, "--alpha", *map(str, ORDERS), "--rounding", "0",
                 "--holder-b", "inf", *flags, "--out", out)
    assert result.returncode == 0, result.stderr
    return pd.read_csv(tmp_path / out), result


def opacus_eps(step_norms):
    """ε at δ = 1e-5 of the steps whose Δ* are `step_norms` (one per step), by Opacus, step by step."""
    rdp = sum(opacus_rdp.compute_rdp(q=RATE, noise_multiplier=SIGMA * CLIP / norm, steps=1, orders=ORDERS)
              for norm in step_norms)
    return opacus_rdp.get_privacy_spent(orders=ORDERS, rdp=np.asarray(rdp), delta=1e-5)[0]


@pytest.mark.parametrize("steps, every", [
    (range(STEPS), True),
    (range(STEPS + 1), True),  # the row at T (θ_T) charges no step
    (range(1, STEPS), False),  # step 0 missing
    ([step for step in range(STEPS) if step != 5], False),
    (CHECKPOINTS, False),
])
def test_every_step_means_a_value_at_every_step_0_to_T_minus_1(tmp_path, steps, every):
    assert reading.every_step(loaded(tmp_path, rows(norms_at(steps)))) is every


def test_every_run_must_be_every_step(tmp_path):
    full = rows(norms_at(range(STEPS)))
    assert reading.every_step(loaded(tmp_path, pd.concat([full, rows(norms_at(range(STEPS)), run="b", seed=1)])))
    assert not reading.every_step(loaded(tmp_path, pd.concat([full, rows(norms_at(CHECKPOINTS), run="b",
                                                                             seed=1)])))


def test_one_point_missing_one_step_is_not_every_step(tmp_path):
    norms = norms_at(range(STEPS))
    del norms[(7, 2)]
    assert not reading.every_step(loaded(tmp_path, rows(norms)))


def test_every_step_rows_compose_to_a_certified_bound(tmp_path, run):
    write(tmp_path, "every", rows(norms_at(range(STEPS + 1))))
    frame, result = compose(run, tmp_path, "every")
    assert set(frame["kind"]) == {"certified", "baseline"}
    assert "Δ* at every step (a bound along the observed run)" in result.stdout
    assert "certified = certified bound" in result.stdout and "held" not in result.stdout
    bound = frame[frame["kind"] == "certified"].set_index("point")["eps"]
    for point in range(3):
        # Step t is charged at θ_{t−1}: the rows at steps 0..T−1.
        assert bound[point] == pytest.approx(opacus_eps([rising(step, point) for step in range(STEPS)]), rel=1e-9)


def test_checkpoints_hold_delta_between_them_a_held_estimate_that_can_fall_below_the_bound(tmp_path, run):
    write(tmp_path, "every", rows(norms_at(range(STEPS + 1))))
    write(tmp_path, "checkpoints", rows(norms_at(CHECKPOINTS)))
    bound = compose(run, tmp_path, "every")[0].query("kind == 'certified'").set_index("point")["eps"]
    estimate, result = compose(run, tmp_path, "checkpoints")
    assert set(estimate["kind"]) == {"held_estimate", "baseline"}
    assert "Δ* at 4 checkpoints, held between them (not a bound" in result.stdout
    assert "held_estimate = held_estimate (Δ* held between checkpoints, not a bound)" in result.stdout
    assert "summary of eps (held_estimate: Δ* held between checkpoints, not a bound;" in result.stdout
    held = estimate[estimate["kind"] == "held_estimate"].set_index("point")["eps"]
    for point in range(3):
        charged = [rising(max(c for c in CHECKPOINTS if c <= step), point) for step in range(STEPS)]
        assert held[point] == pytest.approx(opacus_eps(charged), rel=1e-9)
    # Δ* rises between the checkpoints here: every point's estimate is below its bound.
    assert np.all(held < bound)
    # --steps keeps the checkpoints of the every-step rows: the same estimate, the same label.
    selected, result = compose(run, tmp_path, "every", "--steps", ",".join(map(str, CHECKPOINTS)))
    pd.testing.assert_frame_equal(selected, estimate)


def test_steps_keeps_the_rows_of_those_steps_and_refuses_steps_without_rows(tmp_path, run):
    write(tmp_path, "every", rows(norms_at(range(STEPS))))
    frame, result = compose(run, tmp_path, "every", "--steps", "0-23", f"{STEPS}")
    assert "1 of the 25 requested steps have no rows" in result.stderr
    assert set(frame["kind"]) == {"certified", "baseline"}
    write(tmp_path, "checkpoints", rows(norms_at(CHECKPOINTS)))
    assert_usage_error(run("renyi_per_instance_sum_compo.py", "--res-name", "checkpoints", "--steps", "3", "5"),
                       "--steps")
    assert_usage_error(run("renyi_per_instance_sum_compo.py", "--res-name", "checkpoints", "--steps", "99"), "--steps")
    assert_usage_error(run("eps_delta.py", "--res-name", "checkpoints", "--steps", "x"), "--steps")


def test_pld_follows_the_same_rule(tmp_path, run):
    write(tmp_path, "every", rows(norms_at(range(STEPS))))
    write(tmp_path, "checkpoints", rows(norms_at(CHECKPOINTS)))
    every, _ = compose(run, tmp_path, "every", "--accountant", "pld")
    held, result = compose(run, tmp_path, "checkpoints", "--accountant", "pld")
    assert set(every["kind"]) == {"certified", "baseline"} and set(held["kind"]) == {"held_estimate", "baseline"}
    assert "Δ* held between checkpoints" in result.stdout
    # PLD is the tighter accountant of the same pairs (§8).
    rdp = compose(run, tmp_path, "every")[0]
    assert np.all(every.query("kind == 'certified'")["eps"].to_numpy() < rdp.query("kind == 'certified'")["eps"])
