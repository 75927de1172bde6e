"""The individual Rényi filter and per-point clipping in the trainer (perinstance/train/filtering.py, docs/accounting.md
§12): the identities of §12.5 that a trained run must show (1: every point's charges, recomputed with Opacus from the
recorded bounds and from the recorded Δ*, stay within its budget; 2: a point that left is in no later batch; 3: at Γ
every point stays exactly the uniform run's T steps; 4: no clipped norm passes its bound), planted faults that
identity 1 catches, a killed run that resumes to the same bytes, torchrun's lockstep, the composition's guarantee,
and bad input refused in one line with no file changed."""

import math
import os

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import assert_usage_error, run_in_process, snapshot
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from test_distributed import torchrun
from test_tracking import interrupt_after

from perinstance.accounting import individual_filter
from perinstance.cli import options
from perinstance.files import checkpoints, results, storage, tracked_rows
from perinstance.persample import gradients
from perinstance.train import data, filtering, runs, sampling, training

# 512 synthetic points, q = 1/16, σ = 1, Γ = 4 (so that many points stay below Γ): with a budget of ε = 3.5 at
# order 4 the points at Γ leave after 21 steps and about a third stay to the cap of 40.
FILTERED = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--sigma", "1.0",
            "--cn", "4", "--total-steps", "40", "--save-freq", "8", "--budget-eps", "3.5", "--filter-order", "4"]
RELATIVE = 1e-9  # §12.5 identity 1's tolerance


def parse(*argv):
    return options.parse_training_flags(list(map(str, argv)))


def train(tmp_path, *flags, name="a"):
    return training.train(parse(*FILTERED, *flags, "--models-dir", tmp_path / name), quiet=True)


def tracked_table(run_dir):
    return storage.read_frame(tracked_rows.table_path(str(run_dir)))


def filter_record(run_dir):
    return storage.read_frame(results.results_path(filtering.RECORD, str(run_dir))).set_index("point")


def opacus_charges(run, ratio):
    """ρ = RDP_SGM(q, σ/r; λ_f) of each ratio by Opacus's compute_rdp, one call per distinct ratio (0 at r = 0)."""
    levels, where = np.unique(ratio, return_inverse=True)
    order = run.point_filter["order"]
    values = [0.0 if level == 0 else float(compute_rdp(q=run.sample_rate, noise_multiplier=run.noise_multiplier / level,
                                                             steps=1, orders=[order])[0])
              for level in levels]
    return np.asarray(values)[where].reshape(np.shape(ratio))


def step_ratios(run, rows, quantity):
    """(T, points): the ratio each step t = 1..T charges, from the rows of `quantity` at the steps before it (each row
    holds until the next); held_bound rows are r·Γ, grad_norm rows Δ* turned into min(1, (1 + m)·Δ*/Γ) unrounded."""
    rows = rows[rows["quantity"] == quantity].pivot(index="step", columns="point", values="value")
    held = rows.reindex(range(run.total_steps)).ffill().to_numpy(dtype=float)
    if quantity == "grad_norm":
        return np.minimum(1.0, (1 + run.clip_margin) * held / run.clip_bound)
    return held / run.clip_bound


def identity_1(run_dir, quantity="held_bound"):
    """§12.5 identity 1: each point's charges at every step it was in the training set, recomputed with Opacus from
    the recorded ratios, summed exactly. Returns (sums, the record) for the caller to hold against the budgets."""
    run, record = runs.load_run(str(run_dir)), filter_record(run_dir)
    charges = opacus_charges(run, step_ratios(run, tracked_table(run_dir), quantity))
    active = np.arange(1, run.total_steps + 1)[:, None] <= record["steps_active"].to_numpy()[None, :]
    sums = np.array([math.fsum(column) for column in np.where(active, charges, 0.0).T])
    return sums, record


@pytest.mark.parametrize("every", [1, 3])
def test_identity_1_every_points_recomputed_charges_stay_within_its_budget(tmp_path, every):
    outcome = train(tmp_path, "--filter-every", every)
    sums, record = identity_1(outcome.run_dir)
    budget = record["budget"].to_numpy()
    left = record["left_step"].notna().to_numpy()
    assert 0 < left.sum() < len(record)  # some points left, others trained to the cap
    assert np.all(sums <= budget * (1 + RELATIVE))
    # The charges recorded are the ones the filter summed, and a point leaves only when its next charge would pass
    # its budget (from its last measured Δ*, as the trainer rounds it).
    np.testing.assert_allclose(sums, record["spent"], rtol=RELATIVE)
    run = outcome.run
    rows = tracked_table(outcome.run_dir)
    measured = rows[rows["quantity"] == "grad_norm"].pivot(index="step", columns="point", values="value")
    last = (record.loc[left, "left_step"].to_numpy(dtype=int) - 1) // every * every
    norms = measured.to_numpy()[np.searchsorted(measured.index, last), np.flatnonzero(left)]
    refused = opacus_charges(run, filtering.held_ratio(norms, run.clip_bound, run.clip_margin))
    assert np.all(sums[left] + refused > budget[left])
    # Independently of the trainer's rounding, from Δ* itself: the charges of §12.2 (k = 1) and §12.4 (k > 1).
    raw, _ = identity_1(outcome.run_dir, "grad_norm")
    assert np.all(raw <= budget * (1 + RELATIVE)) and np.all(raw <= sums * (1 + RELATIVE))


@pytest.mark.parametrize("fault", ["half", "drawn_only"])
def test_a_planted_fault_fails_identity_1(tmp_path, monkeypatch, fault):
    """§12.5 identity 6: a filter that charges half, or only the points drawn at the step, lets points stay past their
    budget, which identity 1 shows."""
    charges = filtering.PerPointBounds.charges
    if fault == "half":
        monkeypatch.setattr(filtering.PerPointBounds, "charges", lambda self, ratio: charges(self, ratio) / 2)
    else:
        def before_step(self, step):
            drawn = np.zeros(self.run.dataset_size, dtype=bool)
            drawn[sampling.poisson_batch(self.run.seed, step, self.run.dataset_size, self.run.sample_rate)] = True
            self.filter.step(step, np.where(drawn, self.charges(self.ratio), 0.0))

        monkeypatch.setattr(filtering.PerPointBounds, "before_step", before_step)
    sums, record = identity_1(train(tmp_path).run_dir)
    assert np.any(sums > record["budget"].to_numpy() * (1 + RELATIVE))


def test_identity_2_a_point_that_left_is_never_drawn_again(tmp_path, monkeypatch):
    batches = {}
    privatised = training.Trainer.privatised_gradient

    def recording(self, step, batch, *rest):
        batches[step] = np.array(batch)
        return privatised(self, step, batch, *rest)

    monkeypatch.setattr(training.Trainer, "privatised_gradient", recording)
    outcome = train(tmp_path, "--filter-every", 2)
    left = filter_record(outcome.run_dir)["left_step"].fillna(np.inf).to_numpy()
    run = outcome.run
    assert sorted(batches) == list(range(1, run.total_steps + 1))
    for step, batch in batches.items():
        assert np.all(left[batch] > step)
        # The others' draws are those of the run without a filter: the Poisson draw over every point, less those out.
        drawn = sampling.poisson_batch(run.seed, step, run.dataset_size, run.sample_rate)
        np.testing.assert_array_equal(batch, drawn[left[drawn] > step])
    assert any(len(batch) < len(sampling.poisson_batch(run.seed, step, run.dataset_size, run.sample_rate))
               for step, batch in batches.items())
    # A point out of training is measured again only at θ_T (the final parameters' loss and correctness).
    rows = tracked_table(outcome.run_dir).query("quantity == 'grad_norm' and step < @run.total_steps")
    assert np.all(rows["step"].to_numpy() < left[rows["point"].to_numpy()])
    assert (tracked_table(outcome.run_dir).query("quantity == 'grad_norm'")["step"] == run.total_steps).sum() == \
        run.dataset_size


def test_identity_3_at_gamma_every_point_stays_the_uniform_runs_steps(tmp_path):
    """With a clip norm far below every gradient norm every Δ* is Γ, and a budget of exactly the uniform run's RDP after
    T steps (the exactly rounded sum) keeps every point for exactly T steps of the longer run."""
    steps, order, sample_rate, sigma = 23, 3.0, 32 / 512, 1.0
    budget = math.fsum([individual_filter.uniform_charge(sample_rate, sigma, order)] * steps)
    gap = individual_filter.conversion_gap(1e-5, order)
    target = budget - gap
    while target + gap < budget:
        target = np.nextafter(target, np.inf)
    while target + gap > budget and np.nextafter(target, -np.inf) + gap >= budget:
        target = np.nextafter(target, -np.inf)
    assert individual_filter.uniform_steps(sample_rate, sigma, target + gap, order) == steps
    flags = [*FILTERED[:FILTERED.index("--cn")], "--cn", "1e-4", "--total-steps", steps + 4, "--budget-eps",
             repr(float(target)), "--filter-order", order, "--models-dir", tmp_path]
    outcome = training.train(parse(*flags), quiet=True)
    record = filter_record(outcome.run_dir)
    assert (record["steps_active"] == steps).all() and (record["left_step"] == steps + 1).all()
    assert outcome.run.total_steps == steps + 4  # training ran on, with no point left, to its fixed number of steps
    assert checkpoints.saved_steps(outcome.run_dir)[-1] == steps + 4


def test_identity_4_no_clipped_norm_passes_its_bound(tmp_path, monkeypatch):
    """Between measurements every point is clipped at its held bound: no transformed norm w·||g|| exceeds it, and
    some points are clipped below where DP-SGD would clip them (else the check could not fail)."""
    calls, steps = [], []
    weights_of = filtering.PerPointBounds.weights
    clipped_sum = gradients.clipped_gradient_sum

    def weights(self, indices):
        calls.append({"step": steps[-1], "indices": indices.numpy().copy()})
        return weights_of(self, indices)

    def summing(model, inputs, labels, weights_of_norms, loss_fn=None):
        def recording(norms):
            values = weights_of_norms(norms)
            calls[-1].update(norms=norms.numpy().copy(), transformed=(values * norms).numpy().copy())
            return values
        return clipped_sum(model, inputs, labels, recording, loss_fn)

    step_of = training.Trainer.step

    def step(self, number):
        steps.append(number)
        return step_of(self, number)

    monkeypatch.setattr(filtering.PerPointBounds, "weights", weights)
    monkeypatch.setattr(gradients, "clipped_gradient_sum", summing)
    monkeypatch.setattr(training.Trainer, "step", step)
    outcome = training.train(parse(*FILTERED[:FILTERED.index("--budget-eps")], "--track-points", "all",
                                   "--track-every", 5, "--filter-margin", 0.1, "--models-dir", tmp_path), quiet=True)
    run = outcome.run
    bounds = step_ratios(run, tracked_table(outcome.run_dir), "held_bound") * run.clip_bound
    harder = 0
    for call in calls:
        bound = bounds[call["step"] - 1, call["indices"]]
        assert np.all(call["transformed"] <= bound * (1 + 1e-6))  # float32 arithmetic
        harder += np.sum((call["norms"] > bound) & (bound < run.clip_bound))
    assert harder > 0


def test_a_killed_run_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    """Killed right after checkpoint 16 (between two measurements of --filter-every 3), or before it is saved: the
    resumed run ends with the uninterrupted one's files, byte for byte."""
    whole = train(tmp_path, "--filter-every", 3)
    for name, before in (("b", False), ("c", True)):
        with monkeypatch.context() as patch:
            interrupt_after(patch, 16, before_checkpoint=before)
            with pytest.raises(KeyboardInterrupt):
                train(tmp_path, "--filter-every", 3, name=name)
        resumed = train(tmp_path, "--filter-every", 3, name=name)
        assert resumed.resumed_from == (8 if before else 16)
        assert snapshot(resumed.run_dir) == snapshot(whole.run_dir)


def test_run_json_records_the_filter_and_a_resume_with_other_filter_flags_is_refused(tmp_path):
    budgets = tmp_path / "budgets.csv"
    pd.DataFrame({"point": [0, 1], "eps": [3.6, 5.0]}).to_csv(budgets, index=False)
    flags = [*FILTERED, "--budgets", budgets, "--filter-every", 2, "--save-name", "x", "--total-steps", 8]
    result = run_in_process("train_dpsgd.py", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "points left" in result.stdout and "filter at order 4" in result.stdout
    run = runs.load_run(str(tmp_path / "models" / "x"))
    assert run.point_filter["order"] == 4 and run.point_filter["budget_eps"] == 3.5
    assert run.point_filter["budgets_sha256"] and run.measure_every == 2 and run.clip_margin == filtering.DEFAULT_MARGIN
    assert filter_record(tmp_path / "models" / "x").loc[1, "target_eps"] == 5.0
    before = snapshot(tmp_path / "models")
    assert_usage_error(run_in_process("train_dpsgd.py", *flags, "--filter-margin", 0.5, cwd=tmp_path), "--overwrite")
    budgets.write_text("point,eps\n0,3.6\n1,6.0\n")
    assert_usage_error(run_in_process("train_dpsgd.py", *flags, cwd=tmp_path), "--budgets")
    assert snapshot(tmp_path / "models") == before


def test_the_composition_prints_each_guarantee_and_a_certified_eps_never_above_it(tmp_path, run, monkeypatch):
    monkeypatch.setattr(storage, "AUTO_PARQUET_ROWS", 500)  # both records past the threshold: Parquet
    outcome = train(tmp_path, "--filter-every", 4)
    path = tracked_rows.table_path(outcome.run_dir)
    assert path.endswith(".parquet") and results.results_path(filtering.RECORD, outcome.run_dir).endswith(".parquet")
    composed = run("renyi_per_instance_sum_compo.py", "--res-file", path, "--out", "c.csv")
    assert composed.returncode == 0, composed.stderr
    assert "held between them (a bound along the observed run" in composed.stdout and "guarantee" in composed.stdout
    frame = pd.read_csv(tmp_path / "c.csv").pivot(index="point", columns="kind", values="eps")
    assert set(frame.columns) == {"guarantee", "certified", "baseline"}
    record = filter_record(outcome.run_dir)
    np.testing.assert_allclose(frame["guarantee"], record["guarantee_eps"], rtol=1e-9)
    assert np.all(frame["certified"] <= frame["guarantee"] * (1 + RELATIVE))
    # Composed at the filter's order alone, a point's certified ε is Opacus's conversion of its charges' sum.
    alone = run("renyi_per_instance_sum_compo.py", "--res-file", path, "--alpha", 4, "--out", "one.csv")
    assert alone.returncode == 0, alone.stderr
    certified = pd.read_csv(tmp_path / "one.csv").query("kind == 'certified'").set_index("point")["eps"]
    sums, _ = identity_1(outcome.run_dir)
    expected = [get_privacy_spent(orders=[4.0], rdp=[total], delta=1e-5)[0] for total in sums]
    np.testing.assert_allclose(certified.sort_index(), expected, rtol=1e-9)
    # By privacy loss distributions too: the same kinds, the bound below the uniform baseline.
    by_pld = run("renyi_per_instance_sum_compo.py", "--res-file", path, "--accountant", "pld", "--out", "pld.csv")
    assert by_pld.returncode == 0, by_pld.stderr
    frame = pd.read_csv(tmp_path / "pld.csv").pivot(index="point", columns="kind", values="eps")
    assert set(frame.columns) == {"guarantee", "certified", "baseline"}
    assert np.all(frame["certified"] <= frame["baseline"]) and np.any(frame["certified"] < frame["baseline"] / 2)


def test_per_point_clipping_without_a_filter_composes_to_a_certified_bound(tmp_path, run):
    flags = [*FILTERED[:FILTERED.index("--budget-eps")], "--track-points", "random:40", "--track-every", 4]
    result = run("train_dpsgd.py", *flags)
    assert result.returncode == 0, result.stderr
    assert "tracked 40 points at every 4 steps" in result.stdout
    (run_dir,) = [entry.path for entry in os.scandir(tmp_path / "models")]
    frame = tracked_table(run_dir)
    assert sorted(frame.loc[frame["quantity"] == "grad_norm", "step"].unique()) == [0, 4, 8, 12, 16, 20, 24, 28, 32,
                                                                                   36, 40]
    assert not os.path.exists(os.path.join(run_dir, filtering.RECORD + ".csv"))
    composed = run("renyi_per_instance_sum_compo.py", "--res-file", tracked_rows.table_path(run_dir), "--out", "c.csv")
    assert composed.returncode == 0, composed.stderr
    assert set(pd.read_csv(tmp_path / "c.csv")["kind"]) == {"certified", "baseline"}


def test_two_ranks_filter_in_lockstep_as_one_process(tmp_path):
    """torchrun with 2 Gloo processes: rank 0 gathers both halves of the points at each measurement, and the filter
    takes the same points out at the same steps as a single process (the values agree to float32 rounding)."""
    flags = [*FILTERED, "--filter-every", 2]
    (tmp_path / "two").mkdir()
    result = torchrun("train_dpsgd.py", *flags, cwd=tmp_path / "two")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "measured 256 of 512 tracked points at every 2 steps" in result.stdout
    single = train(tmp_path, "--filter-every", 2, name="one")
    two_dir = tmp_path / "two" / "models" / single.run.run
    pd.testing.assert_series_equal(filter_record(two_dir)["left_step"], filter_record(single.run_dir)["left_step"])
    for step in checkpoints.saved_steps(single.run_dir):
        assert open(checkpoints.checkpoint_path(str(two_dir), step), "rb").read() == \
            open(checkpoints.checkpoint_path(single.run_dir, step), "rb").read()


BAD = [
    (["--budget-eps", "-1"], "--budget-eps"),
    (["--budget-eps", "0"], "--budget-eps"),
    (["--budget-eps", "nan"], "--budget-eps"),
    (["--budgets", "budgets.csv"], "--budgets"),  # lists point 512 of 512 points
    (["--budgets", "twice.csv", "--budget-eps", "4"], "--budgets"),
    (["--budgets", "nan.csv", "--budget-eps", "4"], "--budgets"),
    (["--budgets", "missing.csv"], "--budgets"),
    (["--budget-eps", "4", "--reduction", "mean"], "--reduction"),
    (["--budget-eps", "4", "--clipping", "psac"], "--clipping"),
    (["--budget-eps", "4", "--clipping", "psasc"], "--clipping"),
    (["--budget-eps", "2", "--filter-order", "2"], "--filter-order"),  # needs ε > 10.1 at order 2
    (["--budget-eps", "4", "--no-dp"], "--budget-eps"),
    (["--budget-eps", "4", "--track-points", "0-9"], "--track-points"),
    (["--budget-eps", "4", "--canaries", "8"], "--canaries"),
    (["--budget-eps", "4", "--filter-order", "1"], "--filter-order"),
    (["--budget-eps", "4", "--filter-margin", "0.5"], "--filter-margin"),
    (["--budget-eps", "4", "--filter-every", "0"], "--filter-every"),
    (["--filter-every", "4"], "--filter-every"),
    (["--track-every", "4"], "--track-every"),
    (["--budget-eps", "4", "--track-every", "4"], "--track-every"),
]


@pytest.mark.parametrize("flags, flag", BAD, ids=[" ".join(flags) for flags, _ in BAD])
def test_bad_filter_input_is_one_line_naming_the_flag_and_changes_no_file(tmp_path, flags, flag):
    (tmp_path / "budgets.csv").write_text("point,eps\n0,4\n512,4\n")
    (tmp_path / "twice.csv").write_text("point,eps\n3,4\n7,5\n3,6\n")
    (tmp_path / "nan.csv").write_text("point,eps\n3,nan\n")
    (tmp_path / "missing.csv").write_text("point,eps\n3,4\n")
    before = snapshot(tmp_path)
    base = FILTERED[:FILTERED.index("--budget-eps")]
    assert_usage_error(run_in_process("train_dpsgd.py", *base, *flags, cwd=tmp_path), flag)
    assert snapshot(tmp_path) == before


def test_total_steps_fixes_t_and_holdout_trains_on_all_but_the_held_out_points(tmp_path):
    args = parse("--dataset", "holdout:112:synthetic", "--model", "mlp", "--sigma", 1, "--total-steps", 7, "--epochs", 3,
                 "--models-dir", tmp_path)
    outcome = training.train(args, quiet=True)
    assert outcome.run.total_steps == 7 and outcome.run.dataset_size == 400
    assert "epochs" not in outcome.run.flags  # --total-steps gives T: --epochs names nothing
    dataset = training.load_dataset("holdout:112:synthetic")
    full = training.load_dataset("synthetic")
    held = np.sort(np.random.default_rng(data.HOLDOUT_SEED).choice(512, 112, replace=False))
    kept = np.setdiff1d(np.arange(512), held)
    assert len(dataset.test_y) == 112 and torch.equal(dataset.test_x, full.train_x[held])
    assert torch.equal(dataset.train_x, full.train_x[kept]) and torch.equal(dataset.train_y, full.train_y[kept])
