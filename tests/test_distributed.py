"""Work spread over torchrun's processes (perinstance/train/distributed.py) on CPU with Gloo: training runs
over seeds, and sensitivities sharded into per-rank parts merged once into the single-process result."""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pandas as pd
import pytest
import torch
from conftest import ROOT, assert_usage_error, run_in_process

from perinstance.cli.options import parse_seeds
from perinstance.errors import UsageError
from perinstance.files import checkpoints
from perinstance.train import distributed, runs

RUN = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--epochs", "1",
       "--save-freq", "8", "--clipping", "psac", "--sigma", "1.0"]  # --sigma: no calibration, fast


def torchrun_command(script, *args, processes=2):
    """`script` under torchrun (its module form: CI need not have torchrun on PATH)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
            os.path.join(ROOT, script), *map(str, args)]


def torchrun(script, *args, cwd, processes=2):
    return subprocess.run(torchrun_command(script, *args, processes=processes), cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def rank_lines(output):
    return sorted(line for line in output.splitlines() if line.startswith("rank "))


# --- the world, the devices, the seeds ----------------------------------------------------------

def test_a_plain_start_is_rank_0_of_1():
    world = distributed.World.from_env({})
    assert (world.rank, world.size, world.launched, world.label) == (0, 1, False, "rank 0/1")
    assert world.share(range(5)) == [0, 1, 2, 3, 4]


def test_torchrun_variables_give_each_rank_a_disjoint_share():
    items = list(range(11))
    shares = []
    for rank in range(3):
        world = distributed.World.from_env({"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank)})
        assert world.launched and world.label == f"rank {rank}/3"
        shares.append(world.share(items))
    assert shares == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]


@pytest.mark.parametrize("environ", [{"WORLD_SIZE": "2"}, {"WORLD_SIZE": "2", "RANK": "2"},
                                     {"WORLD_SIZE": "two", "RANK": "0"}])
def test_inconsistent_torchrun_variables_are_usage_errors(environ):
    with pytest.raises(UsageError):
        distributed.World.from_env(environ)


def test_auto_device_is_cuda_only_when_present(monkeypatch):
    alone = distributed.World()
    second = distributed.World(rank=1, size=2, local_rank=1, launched=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.resolve_device("auto", alone) == "cpu"
    assert distributed.resolve_device("auto", second) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed.resolve_device("auto", alone) == "cuda"
    assert distributed.resolve_device("auto", second) == "cuda:1"
    assert distributed.resolve_device("cuda", second) == "cuda:1"
    assert distributed.resolve_device("cuda:0", second) == "cuda:0"
    assert distributed.resolve_device("cpu", second) == "cpu"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # two processes, one GPU
    with pytest.raises(UsageError) as error:
        distributed.resolve_device("auto", second)
    assert error.value.flag == "--device"


def test_parse_seeds():
    assert parse_seeds(["0-3", "7,9", "2"]) == [0, 1, 2, 3, 7, 9]
    for bad in (["-1"], ["3-1"], ["a"], [""], ["0-1000000"]):
        with pytest.raises(UsageError) as error:
            parse_seeds(bad)
        assert error.value.flag == "--seeds"


# --- training runs over seeds -------------------------------------------------------------------

def checkpoint_bytes(run_dir):
    return {step: open(checkpoints.checkpoint_path(run_dir, step), "rb").read()
            for step in checkpoints.saved_steps(run_dir)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Seeds 0 and 1 trained by torchrun with 2 processes (one run each), and the result. The
    measurements below use seed 0's run."""
    folder = tmp_path_factory.mktemp("trained")
    result = torchrun("train_dpsgd.py", *RUN, "--seeds", "0-1", cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder, result


def test_torchrun_spreads_the_seeds_over_the_ranks(trained):
    folder, result = trained
    lines = rank_lines(result.stdout)
    assert len(lines) == 2, result.stdout
    assert lines[0].startswith("rank 0/2: 1 of 2 runs (seed 0): 1 trained, 0 already trained")
    assert lines[1].startswith("rank 1/2: 1 of 2 runs (seed 1): 1 trained, 0 already trained")
    names = sorted(os.listdir(folder / "models"))
    assert len(names) == 2 and "_seed0_" in names[0] and "_seed1_" in names[1]


def test_a_run_of_seeds_is_the_run_of_its_single_seed(trained, tmp_path):
    folder, _ = trained
    # --device auto is the CPU here, and the device is not part of a run's identity.
    result = run_in_process("train_dpsgd.py", *RUN, "--seed", "1", "--device", "auto", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (name,) = os.listdir(tmp_path / "models")
    assert checkpoint_bytes(tmp_path / "models" / name) == checkpoint_bytes(folder / "models" / name)


def test_seeds_and_leave_one_out_runs_resume_and_name_each_run(tmp_path):
    first = run_in_process("train_dpsgd.py", *RUN, "--epochs", "0.25", "--seeds", "3", "--less-points", "5", "9",
                           cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    names = sorted(os.listdir(tmp_path / "models"))
    assert len(names) == 2 and all("_seed3_" in name for name in names)
    assert {runs.load_run(tmp_path / "models" / name).less_point for name in names} == {5, 9}
    assert "rank 0/1: 2 of 2 runs (seed 3 without 5, seed 3 without 9): 2 trained" in first.stdout
    again = run_in_process("train_dpsgd.py", *RUN, "--epochs", "0.25", "--seeds", "3", "--less-points", "5", "9",
                           cwd=tmp_path)
    assert "0 trained, 2 already trained" in again.stdout


@pytest.mark.parametrize("flags, flag", [
    (["--seeds", "0-1", "--save-name", "one"], "--save-name"),
    (["--less-points", "3", "--less-point", "2"], "--less-points"),
    (["--less-points", "512"], "--less-points"),
    (["--seeds", "x"], "--seeds"),
])
def test_bad_run_lists_are_usage_errors(flags, flag, tmp_path):
    result = run_in_process("train_dpsgd.py", *RUN, *flags, cwd=tmp_path)
    assert_usage_error(result, flag)
    assert not os.path.exists(tmp_path / "models")


# --- items and parts ------------------------------------------------------------------------------

def test_items_cover_every_missing_point_once_in_chunks():
    missing = {"add": [1, 5, 9], "remove": [0, 1, 2, 3, 4, 5, 6]}
    items = distributed.plan_items(8, missing, part_points=3)
    assert [item.points for item in items] == [(0, 1, 2), (3, 4, 5), (6, 9)]
    assert all(item.step == 8 for item in items)
    for direction, points in missing.items():
        covered = [point for item in items for d, wanted in item.wanted if d == direction for point in wanted]
        assert covered == points
    assert len({item.key for item in items}) == 3
    assert distributed.plan_items(8, missing, 3)[0].key == items[0].key  # a rerun finds the same parts
    assert distributed.plan_items(16, missing, 3)[0].key != items[0].key


def test_parts_are_merged_once_when_all_are_there(tmp_path):
    import pandas as pd

    result_path = str(tmp_path / "res" / "out.csv")
    items = distributed.plan_items(0, {"none": list(range(5))}, part_points=2)
    parts = distributed.Parts(result_path, "job")
    merged = []
    for item in items[:-1]:
        parts.write(item, pd.DataFrame({"point": list(item.points)}))
        assert not parts.merge_once(items, merged.append)
    parts.write(items[-1], pd.DataFrame({"point": list(items[-1].points)}))
    assert parts.merge_once(items, merged.append)
    assert not parts.merge_once(items, merged.append)  # a later rank finds nothing left to merge
    assert len(merged) == 1 and [list(frame["point"]) for frame in merged[0]] == [[0, 1], [2, 3], [4]]
    assert not os.path.exists(parts.directory)


# --- sensitivities sharded over the ranks -------------------------------------------------------

MEASURE = [*RUN, "--reduction", "sum", "--points", "all", "--stage", "all", "--no-train"]
KEY_COLUMNS = ["run", "step", "point", "exp", "direction", "quantity", "sample"]


@pytest.fixture(scope="module")
def single(trained):
    """The single-process result file of seed 0's run (512 points × 3 checkpoints)."""
    folder, _ = trained
    result = run_in_process("compute_sensitivity.py", *MEASURE, "--res-name", "single", cwd=folder)
    assert result.returncode == 0, result.stderr
    return (folder / "res" / "single.csv").read_bytes()


def test_two_ranks_merge_to_the_single_process_file(trained, single):
    folder, _ = trained
    result = torchrun("compute_sensitivity.py", *MEASURE, "--part-points", "256", "--res-name", "two", cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = rank_lines(result.stdout)
    # Items are (checkpoint, chunk of 256 points), dealt in turn: each rank gets one chunk at every checkpoint.
    assert lines[0].startswith("rank 0/2: 256 points × 3 checkpoints (3 of 6 parts to do)"), lines
    assert lines[1].startswith("rank 1/2: 256 points × 3 checkpoints (3 of 6 parts to do)"), lines
    assert sum("merged all 6 parts" in line for line in lines) == 1
    assert (folder / "res" / "two.csv").read_bytes() == single
    assert leftover_parts(folder, "two.csv") == []


def leftover_parts(folder, name):
    """Files left under res/.parts/<name> (none once a job is merged)."""
    return [os.path.join(path, file) for path, _, files in os.walk(folder / "res" / ".parts" / name) for file in files]


def worker_pid(tag, rank):
    """The pid of torchrun's worker `rank` among the processes started with PERINSTANCE_TEST_TAG=tag."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = set(handle.read().split(b"\0"))
        except OSError:
            continue
        if f"PERINSTANCE_TEST_TAG={tag}".encode() in environ and f"LOCAL_RANK={rank}".encode() in environ:
            return int(entry)
    return None


def wait_for(condition, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers in /proc")
def test_a_killed_rank_leaves_parts_that_a_rerun_completes(trained, single):
    folder, _ = trained
    flags = [*MEASURE, "--part-points", "32", "--res-name", "killed"]
    # The items as rank 0 lists them: 16 chunks of 32 points at each of the 3 checkpoints, dealt in turn.
    items = [item for step in (0, 8, 16) for item in distributed.plan_items(step, {"none": list(range(512))}, 32)]
    job = folder / "res" / ".parts" / "killed.csv"

    def written(share):
        return [item for item in share if job.exists() and any(
            name.startswith(item.key) for directory in job.iterdir() for name in os.listdir(directory))]

    tag = uuid.uuid4().hex
    launch = subprocess.Popen(torchrun_command("compute_sensitivity.py", *flags), cwd=folder, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PERINSTANCE_TEST_TAG": tag})
    try:
        wait_for(lambda: written(items[1::2]))  # rank 1 has written its first part: freeze it there
        victim = worker_pid(tag, 1)
        os.kill(victim, signal.SIGSTOP)
        wait_for(lambda: len(written(items[0::2])) == len(items[0::2]))  # rank 0 finishes its share
        os.kill(victim, signal.SIGKILL)
        output, _ = launch.communicate(timeout=300)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode != 0
    assert not (folder / "res" / "killed.csv").exists()  # nothing merged: rank 1's share is incomplete
    done = len(written(items))
    assert len(items[0::2]) < done < len(items)
    assert "rank 1/2:" not in output

    rerun = torchrun("compute_sensitivity.py", *flags, cwd=folder)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    lines = rank_lines(rerun.stdout)
    left = len(items) - done
    assert all(f"parts to do; {done} of {len(items)} parts were already there" in line for line in lines), lines
    assert sorted(int(line.split("(")[1].split(" of ")[0]) for line in lines) == sorted(
        [len(range(0, left, 2)), len(range(1, left, 2))])  # only the missing parts, split over the ranks
    merged = (folder / "res" / "killed.csv").read_bytes()
    assert merged == single
    rows = pd.read_csv(folder / "res" / "killed.csv")
    assert not rows.duplicated(KEY_COLUMNS).any() and len(rows) == 512 * 3
    assert leftover_parts(folder, "killed.csv") == []


def test_a_rank_killed_while_it_merges_leaves_no_parts_after_a_rerun(trained, single, monkeypatch):
    """A rank that dies after it wrote the result file but before it removed the parts: the rerun
    finds nothing left to measure and removes them (the torchrun path, in this process as rank 0
    of 1)."""
    folder, _ = trained
    flags = [*MEASURE, "--part-points", "256", "--res-name", "merged"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    remove = shutil.rmtree

    def killed(path, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed)
    first = run_in_process("compute_sensitivity.py", *flags, cwd=folder)
    monkeypatch.setattr(shutil, "rmtree", remove)
    assert first.returncode == 130, first.stderr
    assert (folder / "res" / "merged.csv").read_bytes() == single
    assert len(leftover_parts(folder, "merged.csv")) == 6
    rerun = run_in_process("compute_sensitivity.py", *flags, cwd=folder)
    assert rerun.returncode == 0, rerun.stderr
    assert "nothing left to measure" in rerun.stdout
    assert leftover_parts(folder, "merged.csv") == []
    assert (folder / "res" / "merged.csv").read_bytes() == single


# --- the mean rule's Monte-Carlo blocks sharded over the ranks --------------------------------------

MEAN = ["--reduction", "mean", "--points", "0-3", "--stage", "final", "--num-batches", "256", "--mc-blocks", "4",
        "--no-train"]


def test_monte_carlo_blocks_are_split_over_the_ranks(trained):
    """4 points at one checkpoint, 4 Monte-Carlo blocks: each rank measures 2 blocks, and the merged
    file is the single-process file byte for byte; a rerun finds nothing left to measure."""
    folder, _ = trained
    (name, _) = sorted(os.listdir(folder / "models"))  # seed 0's run, analysed under the mean rule
    alone = run_in_process("compute_sensitivity.py", "--run", name, *MEAN, "--res-name", "mean_single", cwd=folder)
    assert alone.returncode == 0, alone.stderr
    # "--": torchrun would take --run as its own --run-path.
    result = torchrun("compute_sensitivity.py", "--", "--run", name, *MEAN, "--res-name", "mean_two", cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = rank_lines(result.stdout)
    assert lines[0].startswith("rank 0/2: 4 points × 1 checkpoints × 2 of 4 Monte-Carlo blocks (2 of 4 parts"), lines
    assert lines[1].startswith("rank 1/2: 4 points × 1 checkpoints × 2 of 4 Monte-Carlo blocks (2 of 4 parts"), lines
    assert sum("merged all 4 parts" in line for line in lines) == 1
    single = (folder / "res" / "mean_single.csv").read_bytes()
    assert (folder / "res" / "mean_two.csv").read_bytes() == single
    rows = pd.read_csv(folder / "res" / "mean_two.csv")
    samples = rows[rows["quantity"] == "batch_sensitivity"]
    assert sorted(samples["block"].unique()) == [0, 1, 2, 3] and len(samples) > 4 * 200
    assert (rows["quantity"] != "batch_sensitivity").sum() == 3 * 4  # d*, v_X, b_X once per point
    assert not rows.duplicated(KEY_COLUMNS + ["block"]).any()
    assert leftover_parts(folder, "mean_two.csv") == []
    again = torchrun("compute_sensitivity.py", "--", "--run", name, *MEAN, "--res-name", "mean_two", cwd=folder)
    assert all("nothing left to measure" in line for line in rank_lines(again.stdout)), again.stdout


def test_a_block_part_holds_its_blocks_draws_and_block_0_the_statistics():
    items = distributed.plan_items(8, {"none": [0, 1, 2]}, part_points=2, blocks=3)
    assert [(item.points, item.blocks) for item in items] == [
        ((0, 1), (0,)), ((0, 1), (1,)), ((0, 1), (2,)), ((2,), (0,)), ((2,), (1,)), ((2,), (2,))]
    assert len({item.key for item in items}) == 6 and "_blocks_1-1_" in items[1].key
    assert distributed.plan_items(8, {"none": [0, 1, 2]}, part_points=2)[0].blocks == ()
