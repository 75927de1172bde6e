"""Nothing lost, nothing accepted that is nonsense (issue 13).

Bad input, as a table: every case runs a script in its own process on a copy of a small world
(a finished run, a result file, an accountant's output), and must exit 2 with one stderr line
that names the flag, no traceback, and every existing file unchanged (checksums). Faults, as
tests: kill -9 at several moments of training and of a measurement, two measurements writing
one result file at once, a full disk (RLIMIT_FSIZE), leftovers of killed writes.

Processes are forked from this one rather than started afresh: torch, opacus and pandas are
imported already, which saves seconds per case. A forked child is still its own process, with
its own exit status, stdout, stderr and file-size limit, and it dies of SIGKILL for real.
"""

import collections
import contextlib
import fcntl
import json
import os
import pickle
import resource
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ROOT, assert_usage_error, run_in_process, snapshot

from perinstance.files import checkpoints, fileio, results
from perinstance.train import runs, training

# --sigma: calibrating σ for a target ε takes Opacus seconds, and every case would pay them.
RUN_WITHOUT_PRIVACY = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--epochs",
                       "1", "--save-freq", "8"]
RUN = [*RUN_WITHOUT_PRIVACY, "--sigma", "1.0"]
STEPS = [0, 8, 16]


# --- running scripts in forked processes -----------------------------------------------------------

def start(script, *args, cwd, before=None):
    """Fork a process that runs `python script args` in `cwd`; returns what `finish` needs.

    Its stdout and stderr are pipes (a file-size limit does not apply to them), drained by
    threads here. `before` runs in the child first: a resource limit, or a fault to inject. The
    child never returns into pytest: it leaves with os._exit and the status the interpreter
    would give.
    """
    pipes = [os.pipe(), os.pipe()]
    pid = os.fork()
    if pid:
        readers = []
        for read_end, write_end in pipes:
            os.close(write_end)
            chunks = []
            reader = threading.Thread(target=drain, args=(read_end, chunks), daemon=True)
            reader.start()
            readers.append((reader, chunks))
        return pid, readers
    status = 1
    try:
        os.chdir(cwd)
        for fd, (read_end, write_end) in zip((1, 2), pipes):
            os.close(read_end)
            os.dup2(write_end, fd)
            os.close(write_end)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (the process ends with it)
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        sys.argv = [script, *map(str, args)]
        if before is not None:
            before()
        try:
            runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
            status = 0
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


def drain(fd, chunks):
    with open(fd, "rb") as pipe:
        chunks.append(pipe.read())


def finish(pid, readers):
    _, status = os.waitpid(pid, 0)
    texts = []
    for reader, chunks in readers:
        reader.join()
        texts.append(b"".join(chunks).decode("utf-8", errors="replace"))
    return SimpleNamespace(returncode=os.waitstatus_to_exitcode(status), stdout=texts[0], stderr=texts[1])


def run(script, *args, cwd, before=None):
    return finish(*start(script, *args, cwd=cwd, before=before))


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def temps(folder):
    """Every temp file of our atomic writes below `folder`."""
    return [os.path.join(where, name) for where, _, names in os.walk(folder) for name in names
            if name.startswith(".tmp-")]


# --- the world every case starts from ---------------------------------------------------------------

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A folder with a finished run (models/<run>), its sum-rule rows of points 0-9 at every
    checkpoint (res/toy.csv), eps_delta.py's output for them, and a file of the user's."""
    folder = tmp_path_factory.mktemp("world")
    measured = run_in_process("compute_sensitivity.py", *RUN, "--points", "0-9", "--stage", "all",
                              "--res-name", "toy", cwd=folder)
    assert measured.returncode == 0, measured.stderr
    accounted = run_in_process("eps_delta.py", "--res-name", "toy", cwd=folder)
    assert accounted.returncode == 0, accounted.stderr
    (folder / "notes.txt").write_text("the user's own notes\n")
    (run_dir,) = os.listdir(folder / "models")
    return SimpleNamespace(path=folder, run=run_dir)


@pytest.fixture
def copy(world, tmp_path):
    """A fresh copy of the world in tmp_path/w; returns (folder, run folder)."""
    folder = tmp_path / "w"
    shutil.copytree(world.path, folder)
    return folder, folder / "models" / world.run


@pytest.fixture
def read_only():
    """Makes folders read-only for the test, even for root (chattr +i), and undoes it after."""
    frozen = []

    def freeze(path):
        os.chmod(path, 0o555)
        frozen.append(path)
        if os.geteuid() == 0:  # root writes through permissions
            if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
                pytest.skip("running as root where chattr +i is not possible: no read-only folder to test")
    yield freeze
    for path in frozen:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        os.chmod(path, 0o755)


# --- ways to damage the world before a case ---------------------------------------------------------

def edit_metadata(change):
    def damage(folder, run_dir, _):
        path = run_dir / "run.json"
        metadata = json.loads(path.read_text())
        path.write_text(json.dumps(change(metadata)))
    return damage


def drop_key(key):
    def change(metadata):
        del metadata[key]
        return metadata
    return change


def foreign_checkpoint(step, drop_later=False):
    """Checkpoint `step` holds another network's tensors (a valid file, foreign keys)."""
    def damage(folder, run_dir, _):
        path = checkpoints.checkpoint_path(str(run_dir), step)
        payload = torch.load(path, weights_only=True)
        payload["model"] = collections.OrderedDict([("conv1.weight", torch.zeros(6, 1, 5, 5))])
        torch.save(payload, path)
        if drop_later:
            for later in STEPS[STEPS.index(step) + 1:]:
                os.remove(checkpoints.checkpoint_path(str(run_dir), later))
    return damage


def metadata_text(text):
    def damage(folder, run_dir, _):
        (run_dir / "run.json").write_text(text)
    return damage


def replace_res_with_file(folder, run_dir, _):
    shutil.rmtree(folder / "res")
    (folder / "res").write_text("not a folder\n")


def freeze(relative, make=False):
    def damage(folder, run_dir, read_only):
        if make:
            os.makedirs(folder / relative)
        read_only(folder / relative)
    return damage


def edit_rows(change, name="toy"):
    """Rewrite res/<name>.csv as pandas would, after `change(frame)`."""
    def damage(folder, run_dir, _):
        path = folder / "res" / f"{name}.csv"
        frame = pd.read_csv(path, keep_default_na=False, na_values=[""])
        change(frame).to_csv(path, index=False)
    return damage


def set_cell(row, column, value):
    def change(frame):
        frame[column] = frame[column].astype(object)
        frame.loc[row, column] = value
        return frame
    return change


def cut_in_line(folder, run_dir, _):
    """res/toy.csv ends in the middle of its line 17, as a killed writer without rename would leave it."""
    path = folder / "res" / "toy.csv"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:16]) + lines[16][:10])


def extra_field(folder, run_dir, _):
    path = folder / "res" / "toy.csv"
    lines = path.read_text().splitlines(keepends=True)
    lines[4] = lines[4].rstrip("\n") + ",9\n"
    path.write_text("".join(lines))


def copy_input(name):
    def damage(folder, run_dir, _):
        shutil.copy(folder / "res" / "toy.csv", folder / "res" / f"{name}.csv")
    return damage


def touch_output(folder, run_dir, _):
    with open(folder / "res" / "toy_eps_delta.csv", "a") as handle:
        handle.write("0,0,sum,none,1,1,1e-05\n")


def code_running_checkpoint(folder, run_dir, _):
    class Payload:
        def __reduce__(self):
            return (os.system, ("touch pwned",))

    with open(checkpoints.checkpoint_path(str(run_dir), 16), "wb") as handle:
        pickle.dump(Payload(), handle)


def write_code_running_pickle(path):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {os.path.join(os.path.dirname(path), 'pwned')}",))

    with open(path, "wb") as handle:
        pickle.dump(Payload(), handle)


def write_numpy_checkpoint(path):
    torch.save({"step": 4, "model": {"weight": np.zeros(3)}, "test_accuracy": 0.5}, path)


@pytest.mark.parametrize("write", [write_code_running_pickle, write_numpy_checkpoint], ids=["pickle", "numpy"])
def test_a_checkpoint_of_other_objects_is_refused_in_one_plain_line(tmp_path, write):
    """torch's own message for such a file advises retrying with weights_only=False and, for some
    files, holds terminal escape codes (and a warning about the pickle protocol goes to stderr):
    the error says instead, in one plain line, that the file is refused and never unpickled."""
    write(checkpoints.checkpoint_path(str(tmp_path), 4))
    with pytest.raises(checkpoints.UsageError) as error, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoints.load_checkpoint(str(tmp_path), 4)
    message = str(error.value)
    assert "step_0000004.pt holds objects other than tensors" in message and "never unpickled" in message
    assert "weights_only" not in message and "\x1b" not in message and "\n" not in message
    assert not caught and not (tmp_path / "pwned").exists()


def truncate_checkpoint(folder, run_dir, _):
    with open(checkpoints.checkpoint_path(str(run_dir), 16), "r+b") as handle:
        handle.truncate(200)


def run_name_is_a_file(folder, run_dir, _):
    (folder / "models" / "taken").write_text("a file where the run folder would go\n")


# --- bad input: one line naming the flag, exit 2, nothing changed ----------------------------------

TRAIN, MEASURE = "train_dpsgd.py", "compute_sensitivity.py"
MEASURE_FLAGS = [*RUN, "--points", "10-12", "--res-name", "toy"]
ACCOUNTANTS = ["eps_delta.py", "renyi_per_instance_sum.py", "renyi_per_instance_sum_compo.py"]

# (script, flags, text the error line must contain, damage done to the world before the case)
BAD_INPUTS = [
    # every float flag of training: NaN, ±inf and values outside the domain
    (TRAIN, ["--eps", "nan"], "--eps", None),
    (TRAIN, ["--eps", "inf"], "--eps", None),
    (TRAIN, ["--eps", "-1"], "--eps", None),
    (TRAIN, ["--eps", "1e300"], "--eps", None),  # Opacus's calibration would never end
    (TRAIN, ["--eps", "1e-12"], "--eps", None),  # no σ reaches it
    (TRAIN, ["--sigma", "nan"], "--sigma", None),  # used to hang
    (TRAIN, ["--sigma", "inf"], "--sigma", None),
    (TRAIN, ["--sigma", "0"], "--sigma", None),
    (TRAIN, ["--sigma", "1e-300"], "--sigma", None),  # σ² underflows in the accounting
    (TRAIN, ["--lr", "nan"], "--lr", None),
    (TRAIN, ["--lr", "-0.5"], "--lr", None),
    (TRAIN, ["--lr", "inf"], "--lr", None),
    (TRAIN, ["--lr", "1e300"], "--lr", None),  # overflows the float32 step
    (TRAIN, ["--gamma", "-1", "--dec-lr", "0.5"], "--gamma", None),  # a negative learning rate
    (TRAIN, ["--gamma", "0", "--dec-lr", "0.5"], "--gamma", None),
    (TRAIN, ["--gamma", "1e200", "--dec-lr", "0.2", "0.4"], "--gamma", None),  # lr·γ² overflows
    (TRAIN, ["--gamma", "nan"], "--gamma", None),
    (TRAIN, ["--dec-lr", "nan"], "--dec-lr", None),
    (TRAIN, ["--delta", "nan"], "--delta", None),
    (TRAIN, ["--delta", "1"], "--delta", None),
    (TRAIN, ["--cn", "nan"], "--cn", None),
    (TRAIN, ["--cn", "0"], "--cn", None),
    (TRAIN, ["--cn", "1e300"], "--cn", None),  # the noise σC overflows
    (TRAIN, ["--epochs", "nan"], "--epochs", None),
    (TRAIN, ["--epochs", "inf"], "--epochs", None),
    (TRAIN, ["--epochs", "1e300"], "--epochs", None),  # T would overflow
    (TRAIN, ["--momentum", "nan"], "--momentum", None),
    (TRAIN, ["--momentum", "1"], "--momentum", None),
    (TRAIN, ["--clipping", "psac", "--scale-r", "nan"], "--scale-r", None),
    (TRAIN, ["--clipping", "psasc", "--scale-s", "inf"], "--scale-s", None),
    (TRAIN, ["--clipping", "psasc", "--scale-s", "0"], "--scale-s", None),
    (TRAIN, ["--clipping", "psasc", "--scale-s", "1e-300"], "--scale-s", None),  # Γ = C/s overflows
    (TRAIN, ["--seed", "-1"], "--seed", None),
    # destinations
    (TRAIN, ["--seed", "1", "--models-dir", "notes.txt"], "--models-dir", None),
    (TRAIN, ["--seed", "1", "--models-dir", "notes.txt/models"], "--models-dir", None),
    (TRAIN, ["--seed", "1", "--models-dir", "locked"], "--models-dir", freeze("locked", make=True)),
    (TRAIN, ["--seed", "1", "--save-name", "taken"], "--save-name", run_name_is_a_file),
    # foreign and malformed run folders
    (TRAIN, [], "run.json is not run metadata", metadata_text("[1, 2, 3]\n")),
    (TRAIN, [], "lacks the key total_steps", edit_metadata(drop_key("total_steps"))),
    (TRAIN, [], "run.json: checkpoint_steps", edit_metadata(lambda m: {**m, "checkpoint_steps": "all"})),
    (TRAIN, [], "has format 3, newer", edit_metadata(lambda m: {**m, "format": 3})),
    (TRAIN, [], "step_0000008.pt does not fit", foreign_checkpoint(8, drop_later=True)),
    (TRAIN, ["--save-name", "{run}", "--save-freq", "4"], "different flags", None),  # refusing to mix
    (MEASURE, ["--stage", "final"], "step_0000016.pt does not fit", foreign_checkpoint(16)),
    (MEASURE, ["--stage", "final"], "step_0000016.pt", truncate_checkpoint),
    (MEASURE, ["--stage", "final"], "step_0000016.pt holds objects other than tensors", code_running_checkpoint),
    # measurement: training flags, its own flags, its result file
    (MEASURE, ["--cn", "nan"], "--cn", None),
    (MEASURE, ["--epochs", "inf"], "--epochs", None),
    (MEASURE, ["--points", "1-"], "--points", None),
    (MEASURE, ["--stage", "finale"], "--stage", None),
    (MEASURE, ["--stage", "final", "--clipping", "psac"], "refusing to mix", None),
    (MEASURE, [], "--res-name", replace_res_with_file),
    (MEASURE, [], "--res-name", freeze("res")),
    (MEASURE, [], "res/toy.csv line 17 is cut off", cut_in_line),
    (MEASURE, [], "res/toy.csv line 5 has 36 fields", extra_field),
    (MEASURE, [], "res/toy.csv line 9 (column value): inf", edit_rows(set_cell(7, "value", "inf"))),
    # accountants: float flags
    ("eps_delta.py", ["--delta", "nan"], "--delta", None),
    ("eps_delta.py", ["--delta", "inf"], "--delta", None),
    ("eps_delta.py", ["--delta", "1"], "--delta", None),
    ("renyi_per_instance_sum.py", ["--alpha", "nan"], "--alpha", None),
    ("renyi_per_instance_sum_compo.py", ["--alpha", "2", "inf"], "--alpha", None),
    ("renyi_per_instance_sum_compo.py", ["--holder-b", "nan"], "--holder-b", None),
    ("renyi_per_instance_sum_compo.py", ["--rounding", "nan"], "--rounding", None),
    ("renyi_per_instance_sum_compo.py", ["--delta", "-inf"], "--delta", None),
    # accountants: outputs never clobber
    ("eps_delta.py", ["--out", "res/toy.csv"], "--out", None),
    ("eps_delta.py", ["--out", "./res/../res/toy.csv"], "--out", None),
    ("eps_delta.py", ["--out", "notes.txt"], "--out", None),
    ("renyi_per_instance_sum.py", ["--out", "res/toy_eps_delta.csv"], "--out", None),  # another script's
    ("eps_delta.py", ["--res-name", "other", "--out", "res/toy_eps_delta.csv"], "--out", copy_input("other")),
    ("eps_delta.py", [], "--out", touch_output),  # its own output, changed since
    ("eps_delta.py", ["--out", "res"], "--out", None),
    ("eps_delta.py", ["--out", "notes.txt/out.csv"], "--out", None),
    ("eps_delta.py", ["--out", "notes.txt/deeper/out.csv"], "--out", None),
    ("eps_delta.py", ["--out", "locked/out.csv"], "--out", freeze("locked", make=True)),
    ("eps_delta.py", ["--out", "locked/new/out.csv"], "--out", freeze("locked", make=True)),
    # accountants: damaged result files, named by file, line and column
    ("eps_delta.py", [], "res/toy.csv line 17 is cut off", cut_in_line),
    ("renyi_per_instance_sum_compo.py", [], "res/toy.csv line 5 has 36 fields", extra_field),
    ("renyi_per_instance_sum.py", [], "res/toy.csv line 4 (column sigma): an empty", edit_rows(set_cell(2, "sigma", ""))),
    ("renyi_per_instance_sum_compo.py", [], "res/toy.csv line 31 (column noise_std)",
     edit_rows(set_cell(29, "noise_std", "nan"))),
    ("eps_delta.py", [], "res/toy.csv line 2 (column step): 'x'", edit_rows(set_cell(0, "step", "x"))),
]


def case_id(case):
    script, flags, expected, damage = case
    return f"{script.removesuffix('.py')}[{' '.join(flags) or (damage.__qualname__.split('.')[0] if damage else '')}]"


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[case_id(case) for case in BAD_INPUTS])
def test_bad_input_is_one_line_and_changes_nothing(copy, read_only, case):
    folder, run_dir = copy
    script, flags, expected, damage = case
    if damage is not None:
        damage(folder, run_dir, read_only)
    flags = [flag.replace("{run}", run_dir.name) for flag in flags]
    if script == TRAIN:
        args = [*(RUN_WITHOUT_PRIVACY if "--eps" in flags else RUN), *flags]
    elif script == MEASURE:
        args = [*MEASURE_FLAGS, *flags]
    else:
        args = ["--res-name", "toy", *flags] if "--res-name" not in flags else flags
    before = snapshot(folder)
    result = run(script, *args, cwd=folder)
    assert_usage_error(result, expected if expected.startswith("--") else "")
    assert expected in result.stderr, (expected, result.stderr)
    assert snapshot(folder) == before, "an existing file was changed, or a file was written"
    assert not (folder / "pwned").exists()


@pytest.mark.parametrize("script", ACCOUNTANTS)
def test_an_output_in_missing_folders_creates_them(copy, script):
    folder, _ = copy
    result = run(script, "--res-name", "toy", "--out", "new/deeper/out.csv", cwd=folder)
    assert result.returncode == 0, result.stderr
    assert len(pd.read_csv(folder / "new" / "deeper" / "out.csv"))


def test_measured_rows_and_a_run_in_missing_folders_create_them(copy):
    folder, _ = copy
    measured = run(MEASURE, *MEASURE_FLAGS, "--res-dir", "new/res", cwd=folder)
    assert measured.returncode == 0, measured.stderr
    assert len(pd.read_csv(folder / "new" / "res" / "toy.csv"))
    trained = run(TRAIN, *RUN, "--models-dir", "other/models", "--save-name", "fresh", cwd=folder)
    assert trained.returncode == 0, trained.stderr
    assert (folder / "other" / "models" / "fresh" / "run.json").exists()


def test_own_output_is_replaced_and_overwrite_replaces_a_foreign_file(copy):
    folder, _ = copy
    again = run("eps_delta.py", "--res-name", "toy", "--delta", "1e-6", cwd=folder)
    assert again.returncode == 0, again.stderr  # its own earlier output for the same input
    assert set(pd.read_csv(folder / "res" / "toy_eps_delta.csv")["delta"]) == {1e-6}
    forced = run("eps_delta.py", "--res-name", "toy", "--out", "notes.txt", "--overwrite", "1", cwd=folder)
    assert forced.returncode == 0, forced.stderr
    assert set(pd.read_csv(folder / "notes.txt")["point"]) == set(range(10))
    assert not temps(folder)


def test_an_output_is_written_under_its_lock(copy, monkeypatch):
    """Two accountants writing one --out at once take turns: the CSV and its provenance are written
    while the output's lock is held (another open of the lock file cannot take it meanwhile)."""
    folder, _ = copy
    written = []
    write_text = fileio.write_text

    def probing(path, text, flag=None):
        probe = os.open(fileio.lock_path(folder / "res" / "toy_eps_delta.csv"), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(probe)
        written.append(os.path.basename(path))
        write_text(path, text, flag)

    monkeypatch.setattr(fileio, "write_text", probing)
    result = run_in_process("eps_delta.py", "--res-name", "toy", "--delta", "1e-6", cwd=folder)
    assert result.returncode == 0, result.stderr
    assert written == ["toy_eps_delta.csv", ".toy_eps_delta.csv.provenance.json"]


def test_an_output_another_writer_replaced_meanwhile_is_refused(copy, monkeypatch):
    """The output was free when the accountant started; by the time it takes the lock to write,
    another program has put its own file there: refused, that file untouched."""
    folder, _ = copy
    locked = fileio.locked

    @contextlib.contextmanager
    def after_a_foreign_write(path, flag=None):
        with open(path, "w") as handle:
            handle.write("someone else's\n")
        with locked(path, flag):
            yield

    monkeypatch.setattr(fileio, "locked", after_a_foreign_write)
    result = run_in_process("eps_delta.py", "--res-name", "toy", "--out", "res/fresh.csv", cwd=folder)
    assert_usage_error(result, "--out")
    assert (folder / "res" / "fresh.csv").read_text() == "someone else's\n"
    assert not (folder / "res" / ".fresh.csv.provenance.json").exists()


# --- kill -9: resume is bitwise identical and leaves nothing behind --------------------------------

def kill_when_renaming(name, after=False):
    """Kill the process as os.replace moves a finished temp file onto `name` (before or after)."""
    def arm():
        rename = os.replace

        def replace(source, target, *args, **kwargs):
            if os.path.basename(target) != name:
                return rename(source, target, *args, **kwargs)
            if after:
                rename(source, target, *args, **kwargs)
            kill_self()
        os.replace = replace
    return arm


def kill_mid_write(name):
    """Kill the process halfway through writing the temp file of `name`: it is cut in half first."""
    def arm():
        sync = os.fsync

        def fsync(fd):
            if os.readlink(f"/proc/self/fd/{fd}").endswith(name):
                os.ftruncate(fd, os.fstat(fd).st_size // 2)
                kill_self()
            sync(fd)
        os.fsync = fsync
    return arm


def kill_at_step(step):
    """Kill the process as it starts training step `step` (between checkpoints)."""
    def arm():
        take_step = training.Trainer.step

        def step_or_die(self, number):
            if number == step:
                kill_self()
            return take_step(self, number)
        training.Trainer.step = step_or_die
    return arm


def final_state(run_dir):
    payload = checkpoints.load_checkpoint(str(run_dir), STEPS[-1])
    return payload["model"], payload["optimizer"]["state"]


KILLS = {
    "writing run.json": kill_when_renaming("run.json"),
    "mid-write of a checkpoint": kill_mid_write("step_0000008.pt"),
    "before renaming a checkpoint": kill_when_renaming("step_0000008.pt"),
    "right after a checkpoint": kill_when_renaming("step_0000008.pt", after=True),
    "between checkpoints": kill_at_step(12),
}


# momentum: the optimizer state must be restored too for the bits to agree
MOMENTUM_RUN = [*RUN, "--momentum", "0.5"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run folder of MOMENTUM_RUN trained in one go."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    result = run(TRAIN, *MOMENTUM_RUN, cwd=folder)
    assert result.returncode == 0, result.stderr
    (run_name,) = os.listdir(folder / "models")
    return folder / "models" / run_name


@pytest.mark.parametrize("moment", KILLS)
def test_kill_during_training_then_resume_is_bitwise_identical(uninterrupted, tmp_path, moment):
    killed = run(TRAIN, *MOMENTUM_RUN, cwd=tmp_path, before=KILLS[moment])
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run_dir = tmp_path / "models" / uninterrupted.name
    assert checkpoints.saved_steps(str(run_dir))[-1:] != [STEPS[-1]]  # really interrupted
    resumed = run(TRAIN, *MOMENTUM_RUN, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    expected, got = final_state(uninterrupted), final_state(run_dir)
    for key in expected[0]:
        assert torch.equal(expected[0][key], got[0][key]), key
    for index, state in expected[1].items():
        assert torch.equal(state["momentum_buffer"], got[1][index]["momentum_buffer"]), index
    assert not temps(tmp_path)


def test_kill_during_a_measurement_then_rerun_completes_and_cleans_up(copy):
    folder, _ = copy
    flags = [*RUN, "--points", "10-19", "--stage", "all", "--res-name", "toy"]
    killed = run(MEASURE, *flags, cwd=folder, before=kill_mid_write("toy.csv"))
    assert killed.returncode == -signal.SIGKILL
    assert temps(folder)  # the killed write's temp is there...
    finished = run(MEASURE, *flags, cwd=folder)
    assert finished.returncode == 0, finished.stderr
    assert not temps(folder)  # ...and the rerun removed it
    rows = results.read_results(str(folder / "res" / "toy.csv"))
    assert sorted(zip(rows["point"], rows["step"])) == sorted((point, step) for point in range(20) for step in STEPS)


# --- concurrent writers --------------------------------------------------------------------------

def slow_reads(seconds):
    """Hold every read of a result file for `seconds`, so that two writers' read-modify-write
    cycles overlap: without the lock, both would read the file before either writes."""
    def arm():
        read = results.read_results

        def read_slowly(*args, **kwargs):
            frame = read(*args, **kwargs)
            time.sleep(seconds)
            return frame
        results.read_results = read_slowly
    return arm


def unlocked_writes_meet(writers):
    """Remove the lock, and hold every result-file write until `writers` processes have reached theirs: each has
    read the file (absent or as it was) before any writes, the race the lock exists for, made certain."""
    def arm():
        from perinstance.files import result_file, storage

        write = storage.write_frame
        result_file.fileio.locked = lambda *args, **kwargs: contextlib.nullcontext()

        def write_when_all_arrived(path, *args, **kwargs):
            os.makedirs("arrived", exist_ok=True)
            open(os.path.join("arrived", str(os.getpid())), "w").close()
            deadline = time.monotonic() + 60
            while len(os.listdir("arrived")) < writers and time.monotonic() < deadline:
                time.sleep(0.05)
            return write(path, *args, **kwargs)
        storage.write_frame = write_when_all_arrived
    return arm


def measure_at_once(folder, point_sets, without_lock=False):
    before = unlocked_writes_meet(len(point_sets)) if without_lock else slow_reads(0.3)
    children = [start(MEASURE, *RUN, "--points", points, "--stage", "all", "--res-name", "both", cwd=folder,
                      before=before) for points in point_sets]
    return [finish(*child) for child in children]


def test_concurrent_measurements_lose_no_row(copy):
    folder, _ = copy
    point_sets = ["0-9", "10-19"]
    for result in measure_at_once(folder, point_sets):
        assert result.returncode == 0, result.stderr
    rows = results.read_results(str(folder / "res" / "both.csv"))
    assert sorted(zip(rows["point"], rows["step"])) == sorted((point, step) for point in range(20) for step in STEPS)
    # The same values as one process measuring points 0-9 alone (res/toy.csv).
    alone = results.read_results(str(folder / "res" / "toy.csv"))
    mine = rows[rows["point"] < 10].reset_index(drop=True)
    pd.testing.assert_frame_equal(mine, alone)
    assert not temps(folder)


def test_the_lock_is_what_keeps_the_rows(copy):
    """The race of the test above is real: without the lock, one writer's rows are lost."""
    folder, _ = copy
    for result in measure_at_once(folder, ["0-9", "10-19"], without_lock=True):
        assert result.returncode == 0, result.stderr
    rows = results.read_results(str(folder / "res" / "both.csv"))
    assert len(rows) < 20 * len(STEPS)


def test_lock_is_exclusive_between_processes(tmp_path):
    target = tmp_path / "table.csv"
    with fileio.locked(target):
        pid = os.fork()
        if pid == 0:  # the child must not get the lock while the parent holds it
            import fcntl
            handle = os.open(fileio.lock_path(target), os.O_RDWR)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os._exit(0)
            except BlockingIOError:
                os._exit(7)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 7
    with fileio.locked(target):  # and it is free again afterwards
        pass


# --- a full disk ---------------------------------------------------------------------------------

def file_size_limit(limit):
    def arm():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return arm


def assert_no_space(result, path):
    """A full disk: one last stderr line naming the file, exit 2, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"error: no space left while writing {path}"


def test_full_disk_while_writing_a_checkpoint(copy):
    folder, _ = copy
    result = run(TRAIN, *RUN, "--seed", "3", cwd=folder, before=file_size_limit(4096))  # run.json fits, not a checkpoint
    (run_name,) = [name for name in os.listdir(folder / "models") if "seed3" in name]
    run_dir = folder / "models" / run_name
    assert_no_space(result, checkpoints.checkpoint_path(os.path.join("models", run_name), 0))
    assert sorted(os.listdir(run_dir)) == ["run.json"]  # no partial checkpoint, no temp file
    runs.load_run(str(run_dir))
    resumed = run(TRAIN, *RUN, "--seed", "3", cwd=folder)  # space again: the run trains
    assert resumed.returncode == 0, resumed.stderr


def test_full_disk_while_writing_a_result_file(copy):
    folder, _ = copy
    path = folder / "res" / "toy.csv"
    before = snapshot(folder)
    result = run(MEASURE, *RUN, "--points", "10-19", "--stage", "all", "--res-name", "toy", cwd=folder,
                 before=file_size_limit(path.stat().st_size + 100))
    assert_no_space(result, os.path.join("res", "toy.csv"))
    assert snapshot(folder) == before


def test_full_disk_while_writing_an_output(copy):
    folder, _ = copy
    before = snapshot(folder)
    result = run("eps_delta.py", "--res-name", "toy", "--delta", "1e-6", cwd=folder, before=file_size_limit(200))
    assert_no_space(result, os.path.join("res", "toy_eps_delta.csv"))
    assert snapshot(folder) == before


# --- temps left by killed writes -----------------------------------------------------------------

def dead_pid():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_only_our_stale_temps_are_removed(copy):
    folder, run_dir = copy
    ours_dead = f"{fileio.TEMP_PREFIX}{fileio.HOST_TAG}-{dead_pid()}-0123abcd-step_0000016.pt"
    ours_alive = f"{fileio.TEMP_PREFIX}{fileio.HOST_TAG}-{os.getpid()}-0123abcd-step_0000016.pt"
    legacy = ".tmp-ab_cd123step_0000008.pt"
    foreign = [".tmp-notes", "notes.tmp-1", ".tmp-perinstance-mine.txt", ".tmp-abcdefghnotes.txt", "step_0000016.pt.tmp"]
    for folder_of, name in [(run_dir, ours_dead), (run_dir, ours_alive), (run_dir, legacy),
                            (folder / "res", ours_dead.replace("step_0000016.pt", "toy.csv"))] + \
            [(run_dir, name) for name in foreign] + [(folder / "res", name) for name in foreign]:
        (folder_of / name).write_bytes(b"partial")
    rerun = run(TRAIN, *RUN, cwd=folder)  # a finished run: nothing to train, the folder is cleaned
    assert rerun.returncode == 0 and "already trained" in rerun.stdout, rerun.stderr
    measured = run(MEASURE, *RUN, "--points", "0", "--res-name", "toy", cwd=folder)
    assert measured.returncode == 0, measured.stderr
    assert sorted(name for name in os.listdir(run_dir) if "tmp" in name) == sorted([ours_alive, *foreign])
    assert sorted(name for name in os.listdir(folder / "res") if "tmp" in name) == sorted(foreign)
