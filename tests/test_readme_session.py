"""The README's command-line session reaches its headline: it trains with --track-points all, composes the tracked
file (Δ* of every point at every step), and that compose prints a certified composed ε, the bound the headline
table shows. The session runs as written, every command, on a small configuration (512 points, 16 steps, fewer
audited points and trials) given by flags the session's own commands take."""

import os
import re
import shlex

import pandas as pd
import pytest
from conftest import ROOT, load_script, run_in_process

from perinstance.cli.main import COMMANDS
from perinstance.train.data import EMBEDDED_TRAIN_SIZE

HEADING = "## The command line"
# The small configuration: flags replaced where the session gives them, and flags added to its training.
SMALL_POINTS, SMALL_BATCH, SMALL_EPOCHS = 512, 32, 1
SMALL_STEPS = SMALL_POINTS * SMALL_EPOCHS // SMALL_BATCH
SMALL = {"--epochs": str(SMALL_EPOCHS), "--steps": str(SMALL_STEPS), "--points": "random:8", "--spread": "4",
         "--trials": "20000"}
SMALL_TRAINING = ["--dataset", f"first:{SMALL_POINTS}:mnist-embedded", "--batch-size", str(SMALL_BATCH)]
TRACKED = "tracked_norms"


def session():
    """The session's commands, as argument lists without the leading `perinstance`."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        section = handle.read().split(HEADING, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    commands = [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    assert commands and all(command[0] == "perinstance" for command in commands)
    return [command[1:] for command in commands]


def parsed(command):
    name, *argv = command
    return load_script(COMMANDS[name].script).build_parser().parse_args(argv)


def tracked_inputs(args, run_dir):
    """Whether an accountant's arguments read the run's tracked file."""
    by_name = os.path.normpath(args.res_dir or "") == os.path.normpath(run_dir) and args.res_name == TRACKED
    by_path = args.res_file in {os.path.join(run_dir, f"{TRACKED}.{ending}") for ending in ("csv", "parquet")}
    return by_name or by_path


def test_the_session_tracks_every_step_and_composes_the_tracked_file():
    commands = session()
    (train,) = [parsed(command) for command in commands if command[0] == "train"]
    assert train.track_points == ["all"]
    run_dir = os.path.join(train.models_dir, train.save_name)
    composed = [parsed(command) for command in commands if command[0] == "compose"]
    assert composed and all(tracked_inputs(args, run_dir) for args in composed)
    assert composed[0].accountant == "rdp" and composed[0].holder_b == "inf"
    # The per-step ε of the headline is at the last step of the run the session trains (T = epochs·N/B).
    (per_step,) = [parsed(command) for command in commands if command[0] == "eps-delta"]
    assert tracked_inputs(per_step, run_dir)
    assert per_step.steps == [str(round(train.epochs * EMBEDDED_TRAIN_SIZE / train.batch_size))]


def small(command):
    """The command with the small configuration's values."""
    name, *argv = command
    given = [flag for flag in SMALL if flag in argv]
    for flag in given:
        argv[argv.index(flag) + 1] = SMALL[flag]
    return name, argv + (SMALL_TRAINING if name == "train" else [])


def test_the_session_run_small_prints_a_certified_composed_eps(tmp_path):
    replaced = set()
    printed = {}
    for command in session():
        name, argv = small(command)
        replaced.update(flag for flag in SMALL if flag in argv)
        result = run_in_process(COMMANDS[name].script, *argv, cwd=tmp_path)
        assert result.returncode == 0, (command, result.stderr[-2000:])
        printed.setdefault(name, result.stdout)
    assert replaced == set(SMALL), "the small configuration no longer matches the session"
    # The first compose is the headline's: every point, Rényi DP, b = ∞, Δ* at every step.
    compose = printed["compose"]
    assert "Δ* at every step (a bound along the observed run)" in compose
    assert "kinds: certified = certified bound; baseline = data-independent baseline" in compose
    written = re.search(r"^wrote (.+)$", compose, re.M).group(1)
    frame = pd.read_csv(tmp_path / written)
    assert set(frame["kind"]) == {"certified", "baseline"}
    assert frame.loc[frame["kind"] == "certified", "point"].nunique() == SMALL_POINTS


@pytest.mark.parametrize("flag", sorted(SMALL))
def test_each_small_flag_is_one_the_session_gives(flag):
    assert any(flag in command for command in session())
