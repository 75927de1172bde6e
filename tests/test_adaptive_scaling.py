"""The per-instance analysis runs unchanged on a PSASC run (issue: adaptive scaling)."""

import pandas as pd
from conftest import assert_usage_error
from opacus.accountants.analysis.rdp import compute_rdp

PSASC = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--epochs", "1",
         "--sigma", "0.8", "--cn", "0.5", "--clipping", "psasc", "--scale-r", "0.1", "--scale-s", "0.4",
         "--save-freq", "8"]


def test_psasc_sensitivities_stay_below_c_over_s_and_baseline_is_opacus(tmp_path, run):
    measured = run("compute_sensitivity.py", *PSASC, "--exp", "eps_delta", "--reduction", "sum", "--points", "all",
                   "--stage", "all", "--res-name", "psasc")
    assert measured.returncode == 0, measured.stderr
    rows = pd.read_csv(tmp_path / "res" / "psasc.csv")
    bound = 0.5 / 0.4
    assert (rows["clip_bound"] == bound).all() and (rows["noise_std"] == 0.8 * bound).all()
    assert (rows["value"] <= bound).all()
    assert rows["value"].max() > 0.5  # above C: the bound really is C/s, not C
    accounted = run("renyi_per_instance_sum.py", "--res-name", "psasc", "--alpha", "2", "8", "32")
    assert accounted.returncode == 0, accounted.stderr
    rdp = pd.read_csv(tmp_path / "res" / "psasc_renyi_per_instance_sum.csv")
    sample_rate = 32 / 512
    for alpha, group in rdp.groupby("alpha"):
        expected = compute_rdp(q=sample_rate, noise_multiplier=0.8, steps=1, orders=[alpha])[0]
        baseline = group.loc[group["kind"] == "baseline", "rdp"]
        assert (abs(baseline - expected) <= 1e-9 * expected).all()
        assert (group.loc[group["kind"] == "certified", "rdp"] <= expected * (1 + 1e-9)).all()


def test_scaling_flags_are_checked(tmp_path, run):
    base = ["--dataset", "synthetic", "--model", "mlp", "--epochs", "1"]
    assert_usage_error(run("train_dpsgd.py", *base, "--clipping", "psac", "--scale-r", "0"), "--scale-r")
    assert_usage_error(run("train_dpsgd.py", *base, "--clipping", "psasc", "--scale-s", "-1"), "--scale-s")
    assert_usage_error(run("train_dpsgd.py", *base, "--clipping", "psac", "--scale-s", "0.5"), "--scale-s")
    assert_usage_error(run("train_dpsgd.py", *base, "--scale-r", "0.5"), "--scale-r")
    assert_usage_error(run("train_dpsgd.py", *base, "--clipping", "auto"), "--clipping")
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())
