"""The loss-threshold membership attack (Yu et al., Appendix D): its math, and the script on tiny runs."""

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_usage_error, run_in_process, snapshot

from perinstance.accounting import audit_bounds
from perinstance.audit import membership
from perinstance.train import runs, sampling, training
from perinstance.train.data import load_dataset

RUN = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--epochs", "1",
       "--save-freq", "8"]
STEPS = 16
SPLITS = 5


# --- the attack's math ----------------------------------------------------------------------------

def brute_force_threshold(members, nonmembers):
    """Every observed loss and +inf tried in turn; the first with the best TPR − FPR."""
    best, chosen = -np.inf, None
    for threshold in sorted(set(members) | set(nonmembers)) + [np.inf]:
        gain = np.mean(members < threshold) - np.mean(nonmembers < threshold)
        if gain > best:
            best, chosen = gain, threshold
    return chosen


def test_best_threshold_is_the_brute_force_one():
    rng = np.random.default_rng(0)
    for _ in range(20):
        members, nonmembers = rng.gamma(1.0, 1.0, 15).round(1), rng.gamma(1.5, 1.0, 11).round(1)
        assert audit_bounds.best_loss_threshold(members, nonmembers) == brute_force_threshold(members, nonmembers)


def test_attack_accuracy_by_hand():
    # Perfectly separated losses: accuracy 1 whatever the split; the same losses: no advantage.
    rng = np.random.default_rng(1)
    assert audit_bounds.loss_threshold_attack(np.arange(10) / 10, np.arange(10) + 5.0, rng, 3)[:2] == (1.0, 1.0)
    same = rng.random(4000)
    accuracy, advantage, _ = audit_bounds.loss_threshold_attack(same[:2000], same[2000:], rng, 3)
    assert abs(accuracy - 0.5) < 0.03 and advantage == pytest.approx(2 * accuracy - 1)
    # A threshold is scored only on the half it was not chosen on: two members and two non-members
    # with the members' losses lower in one half and higher in the other give advantage −1 or 0.
    accuracy, _, _ = audit_bounds.loss_threshold_attack(np.array([0.0, 3.0]), np.array([1.0, 2.0]), rng, 50)
    assert accuracy < 0.5


def test_class_members_match_the_test_counts():
    train_labels = np.array([0] * 10 + [1] * 3 + [2] * 6)
    test_labels = np.array([0] * 4 + [1] * 5 + [2] * 6)
    chosen = membership.class_members(train_labels, test_labels, 3, seed=4)
    assert [len(chosen[label]) for label in range(3)] == [4, 3, 6]
    assert all(set(train_labels[rows]) == {label} for label, rows in chosen.items())
    again = membership.class_members(train_labels, test_labels, 3, seed=4)
    assert all(np.array_equal(chosen[label], again[label]) for label in range(3))


# --- membership_inference.py on tiny runs --------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A DP run and the same configuration trained without privacy, and a composed-ε file for the DP run."""
    folder = tmp_path_factory.mktemp("membership")
    for name, flags in (("private", []), ("public", ["--dp", "0"])):
        result = run_in_process("train_dpsgd.py", *RUN, *flags, "--save-name", name, "--models-dir",
                                folder / "models", cwd=folder)
        assert result.returncode == 0, result.stderr
    labels = load_dataset("synthetic").train_y.numpy()
    eps = 1.0 + labels + np.random.default_rng(2).random(len(labels))
    rows = [(point, kind, value, STEPS) for point, value in enumerate(eps) for kind, value in
            (("certified", value), ("baseline", 9.0))]
    pd.DataFrame(rows, columns=["point", "kind", "eps", "steps"]).to_csv(folder / "eps.csv", index=False)
    return folder


@pytest.fixture
def attack(tmp_path, models):
    def run(*flags, eps_csv=None, check=True):
        result = run_in_process("membership_inference.py", "--run", "private", "--nondp-run", "public",
                                "--models-dir", models / "models", "--eps-csv", eps_csv or models / "eps.csv",
                                "--splits", SPLITS, "--out", tmp_path / "out.csv", "--figure", tmp_path / "out.png",
                                *flags, cwd=tmp_path)
        if check:
            assert result.returncode == 0, result.stderr
        path = tmp_path / "out.csv"
        return result, (pd.read_csv(path) if path.exists() else None)
    return run


def independent_attack(member_losses, nonmember_losses, rng, splits):
    """The split-and-evaluate procedure written out, with the brute-force threshold."""
    accuracies = []
    for _ in range(splits):
        members, nonmembers = rng.permutation(member_losses), rng.permutation(nonmember_losses)
        half_members, half_nonmembers = len(members) // 2, len(nonmembers) // 2
        threshold = brute_force_threshold(members[:half_members], nonmembers[:half_nonmembers])
        accuracies.append((1 + np.mean(members[half_members:] < threshold)
                           - np.mean(nonmembers[half_nonmembers:] < threshold)) / 2)
    return np.mean(accuracies)


def test_per_class_attack_next_to_class_eps_and_accuracy(attack, models, tmp_path):
    result, rows = attack()
    assert (tmp_path / "out.png").exists()
    assert list(rows["model"].unique()) == ["DP", "non-private"] and len(rows) == 8
    dataset = load_dataset("synthetic")
    labels, test_labels = dataset.train_y.numpy(), dataset.test_y.numpy()
    eps = pd.read_csv(models / "eps.csv").query("kind == 'certified'")
    expected_eps = eps.groupby(labels[eps["point"]])["eps"].mean()
    for model, name in (("DP", "private"), ("non-private", "public")):
        mine = rows[rows["model"] == model].set_index("class")
        np.testing.assert_allclose(mine["mean_eps"], expected_eps.loc[mine.index])
        run_dir = models / "models" / name
        network, _ = training.load_model(runs.load_run(run_dir), run_dir, STEPS)
        with torch.no_grad():
            train_losses = F.cross_entropy(network(dataset.train_x), dataset.train_y, reduction="none").numpy()
            test_logits = network(dataset.test_x)
        test_losses = F.cross_entropy(test_logits, dataset.test_y, reduction="none").numpy()
        members = membership.class_members(labels, test_labels, 4, 0)
        for label in range(4):
            nonmember = test_labels == label
            assert mine.loc[label, "members"] == min(np.sum(labels == label), nonmember.sum())
            assert mine.loc[label, "test_accuracy"] == pytest.approx(
                np.mean(test_logits[nonmember].argmax(1).numpy() == label))
            rng = sampling.stream_rng(0, sampling.MEMBERSHIP_STREAM, label, 1)
            expected = independent_attack(train_losses[members[label]], test_losses[nonmember], rng, SPLITS)
            assert mine.loc[label, "attack_accuracy"] == pytest.approx(expected, abs=1e-12)
        r = np.corrcoef(mine["mean_eps"], mine["attack_accuracy"])[0, 1]
        assert f"{model:>12}: mean attack accuracy {mine['attack_accuracy'].mean():.4f}" in result.stdout
        assert f"attack accuracy {r:.3f}" in result.stdout


def test_outputs_in_missing_folders_create_them_and_a_file_in_the_way_is_refused(attack, tmp_path):
    out, figure = tmp_path / "new" / "deeper" / "a.csv", tmp_path / "figs" / "a.png"
    attack("--out", out, "--figure", figure)
    assert len(pd.read_csv(out)) == 8 and figure.exists()
    (tmp_path / "notes.txt").write_text("the user's\n")
    before = snapshot(tmp_path)
    for flag in ("--out", "--figure"):
        result, _ = attack(flag, tmp_path / "notes.txt" / "a.csv", check=False)
        assert_usage_error(result, flag)
        assert "notes.txt is a file" in result.stderr
    assert snapshot(tmp_path) == before


def test_a_file_without_kinds_is_read_as_it_is(attack, models, tmp_path):
    plain = pd.read_csv(models / "eps.csv").query("kind == 'certified'")[["point", "eps"]]
    plain.to_csv(tmp_path / "plain.csv", index=False)
    _, rows = attack(eps_csv=tmp_path / "plain.csv")
    _, reference = attack()
    pd.testing.assert_series_equal(rows["mean_eps"], reference["mean_eps"])


BAD_FILES = {
    "point out of range": lambda frame: frame.assign(point=frame["point"] + 10_000),
    "other run length": lambda frame: frame.assign(steps=STEPS + 1),
    "no eps column": lambda frame: frame.drop(columns="eps"),
    "negative eps": lambda frame: frame.assign(eps=-1.0),
    "point twice": lambda frame: pd.concat([frame, frame.head(2)]),
    "class without points": lambda frame: frame[frame["point"].isin(
        np.flatnonzero(load_dataset("synthetic").train_y.numpy() != 2))],
}


@pytest.mark.parametrize("change", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_eps_file_is_refused(attack, models, tmp_path, change):
    path = tmp_path / "bad_eps.csv"
    change(pd.read_csv(models / "eps.csv")).to_csv(path, index=False)
    before = snapshot(tmp_path)
    result, _ = attack(eps_csv=path, check=False)
    assert_usage_error(result, "--eps-csv")
    assert snapshot(tmp_path) == before


BAD_FLAGS = [
    (["--splits", "0"], "--splits"),
    (["--stage", "all"], "--stage"),
    (["--stage", "late"], "--stage"),
    (["--run", "public"], "--run"),
    (["--nondp-run", "private"], "--nondp-run"),
    (["--nondp-run", "nosuch"], "--nondp-run"),
    (["--eps-csv", "nosuch.csv"], "--eps-csv"),
]


@pytest.mark.parametrize("flags, flag", BAD_FLAGS, ids=[" ".join(flags) for flags, _ in BAD_FLAGS])
def test_bad_flags_are_one_line_and_write_nothing(attack, tmp_path, flags, flag):
    before = snapshot(tmp_path)
    result, _ = attack(*flags, check=False)
    assert_usage_error(result, flag)
    assert snapshot(tmp_path) == before
