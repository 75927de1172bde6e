"""Measure how much one training point changes a DP-SGD update at saved checkpoints (accounting.md §2).

    python compute_sensitivity.py --run RUN --reduction mean --points 0-9 --stage final --res-name lenet_mean
    python compute_sensitivity.py --exp eps_delta --reduction sum --points all --stage all --res-name lenet_sum

--reduction sum: Δ* = ||h(g*)|| per point and checkpoint. --reduction mean (coupling, the default
estimator): the dataset statistics d*, v_X, b_X of each point and --num-batches draws of Δ_B from
batches of every size k >= k_min, each with its k (accounting.md §3.2, §3.4; --histogram-precision R
stores them as histograms rounded up by at most 1 + R, an upper bound); --estimator jensen
--exp renyi: GLA's statistic S. --run names a run (its run.json supplies the training flags);
without it the training flags name the run, and a run without checkpoints is trained first
(unless --no-train). Rows go to <res-dir>/<res-name>.csv (.parquet once the file holds more than
100,000 rows, or as named by an extension); rerunning adds only what is missing, so
an interrupted run resumes, and another --mc-seed adds an independent set of rows.

    torchrun --nproc-per-node 4 compute_sensitivity.py --points all --stage all --res-name x ...

splits the checkpoints × chunks of --part-points points over the processes; each writes its own
part files and the last to finish merges them into the result file (perinstance/measure/sharded.py).
"""

import sys
import time

import pandas as pd

from perinstance.cli import sensitivity
from perinstance.cli.options import HELP_FORMAT, Parser
from perinstance.errors import run_main
from perinstance.files import results
from perinstance.files.result_file import ResultFile
from perinstance.measure import measurement, sharded
from perinstance.train import distributed, planned_run, runs
from perinstance.train.points import parse_points

# The result file is rewritten whole on each write, so rows are written at most this often (and at the end or
# on an interruption): a kill loses at most this much measuring, and many checkpoints do not cost a quadratic
# number of rewritten rows.
WRITE_EVERY_SECONDS = 60


def build_parser():
    return sensitivity.add_measurement_args(Parser(description=__doc__, formatter_class=HELP_FORMAT))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    flags = vars(build_parser().parse_args(argv))
    given = sensitivity.given_flags(argv)

    # Every flag is checked before anything is trained, measured or written.
    command = sensitivity.parse_command(flags, given)
    run = sensitivity.find_run(command.run, command.training, given)
    request = command.request.for_run(run.config, estimator_given="estimator" in given)
    points = parse_points(command.points, run.universe, run.config.seed)
    result_file = ResultFile.open(request.res_path, request.overwrite, results.run_columns(run.config, request.reduction),
                                  automatic=request.automatic_format)
    if command.no_train:
        sensitivity.require_finished(run)
    world = distributed.World.from_env()
    distributed.make_deterministic(command.device)
    if world.launched:
        with distributed.process_group(world, command.device):
            return sharded.measure(world, request, run, points, result_file, part_points=command.part_points,
                                   device=command.device)

    started = time.time()
    config = planned_run.ensure_trained(run)
    steps = runs.resolve_stages(request.stages, run.saved_steps(), config.total_steps)
    written, skipped, pending, last_write = 0, 0, [], time.time()
    try:
        for step in steps:
            missing = result_file.missing(config.run, step, points, request)
            skipped += sum(len(points) - len(todo) for todo in missing.values())
            needed = sorted(set().union(*missing.values()))
            if not needed:
                continue
            pending.append(measurement.keep_missing(
                measurement.measure_checkpoint(request, run, step, needed, command.device), missing))
            written += len(pending[-1])
            if time.time() - last_write >= WRITE_EVERY_SECONDS:
                result_file.add(pd.concat(pending, ignore_index=True))
                pending, last_write = [], time.time()
    finally:
        # Checkpoints measured before an interruption or an error are kept: a rerun skips them.
        if pending:
            result_file.add(pd.concat(pending, ignore_index=True))

    print(f"{config.run}: {len(points)} points × {len(steps)} stages (steps {', '.join(map(str, steps))}): "
          f"{written} rows written to {result_file.describe()}, {skipped} (point, stage, experiment) combinations "
          f"already there skipped; {time.time() - started:.1f}s")


if __name__ == "__main__":
    run_main(main)
