"""compute_sensitivity.py under torchrun: the measurement split over the ranks, merged once.

    torchrun --nproc-per-node K compute_sensitivity.py --points all --stage all --res-name x ...

Rank 0 trains the run if needed, lists the work left (checkpoints × chunks of --part-points
points whose rows the result file lacks, × the --mc-blocks Monte-Carlo blocks of the mean rule's
coupling draws) and sends the list to every rank; rank r measures
items r, r+K, r+2K, ... and writes each one's rows to its own part file, atomically. The rank
that finds every part there merges them into the result file, once, under its lock. A killed
rank loses only the item it was measuring: rerunning the same command (with any K) measures
only the items without a part and then merges. The rows are those of the single-process
command: a point's values do not depend on the points measured with it, nor a block's draws on
the blocks measured with it (perinstance/measure/coupling.py).
"""

import json
import time
from collections.abc import Sequence

import pandas as pd

from perinstance.errors import UsageError
from perinstance.files.result_file import ResultFile
from perinstance.measure import gradient_rows, measurement
from perinstance.measure.measurement import Measurement
from perinstance.train import distributed, planned_run, runs
from perinstance.train.planned_run import PlannedRun
from perinstance.train.runs import RunConfig

# Sum rule: points per part. A multiple of the engine's chunk (gradient_rows.ROW_CHUNK), so that
# every point is computed in the same chunk as by a single process. The mean rule needs a pass
# over the whole training set per part, so by default all points of a checkpoint make one part.
DEFAULT_PART_POINTS = 4 * gradient_rows.ROW_CHUNK


def part_size(part_points: int | None, request: Measurement, points: Sequence[int]) -> int:
    """Points per part: --part-points, or the default of the rule."""
    if part_points is not None and part_points <= 0:
        raise UsageError("--part-points", f"must be > 0, got {part_points}")
    if part_points is not None:
        return part_points
    return DEFAULT_PART_POINTS if request.rule == "sum" else max(len(points), 1)


def measure(world: distributed.World, request: Measurement, run: PlannedRun, points: Sequence[int],
            result_file: ResultFile, *, part_points: int | None = None, device: str = "cpu") -> None:
    """This rank's share of the measurement; prints its `rank R/W:` line."""
    started = time.time()
    chunk = part_size(part_points, request, points)
    # Coupling draws: one part per Monte-Carlo block (each rank computes the per-sample gradients
    # of the checkpoint again, and only its blocks' draws); the dataset statistics go with block 0.
    blocks = request.mc_blocks if request.family == measurement.COUPLING and request.num_batches > 0 else 0

    def plan():
        config = planned_run.ensure_trained(run)
        steps = runs.resolve_stages(request.stages, run.saved_steps(), config.total_steps)
        items = [item for step in steps
                 for item in distributed.plan_items(step, result_file.missing(config.run, step, points, request),
                                                    chunk, blocks)]
        parts = job_parts(request, config, points)
        return config, items, [item for item in items if not parts.has(item)]

    config, items, todo = distributed.from_rank0(world, plan)
    run.config, run.finished = config, True
    parts = job_parts(request, config, points)
    mine = world.share(todo)
    for item in mine:
        rows = measurement.measure_checkpoint(request, run, item.step, list(item.points), device,
                                                  item.blocks or None)
        parts.write(item, measurement.keep_missing(rows, {direction: list(wanted) for direction, wanted in item.wanted}),
                    "--res-name")

    merged = parts.merge_once(items, lambda frames: result_file.add(pd.concat(frames, ignore_index=True)),
                              "--res-name")
    measured_points = len({point for item in mine for point in item.points})
    measured_steps = len({item.step for item in mine})
    measured_blocks = (f" × {len({block for item in mine for block in item.blocks})} of {blocks} Monte-Carlo blocks"
                       if blocks else "")
    resumed = f"; {len(items) - len(todo)} of {len(items)} parts were already there" if len(todo) < len(items) else ""
    outcome = (f"merged all {len(items)} parts into {request.res_path}" if merged else
               "nothing left to measure" if not items else "the last rank to finish merges")
    print(f"{world.label}: {measured_points} points × {measured_steps} checkpoints{measured_blocks} ({len(mine)} of "
          f"{len(todo)} parts to do{resumed}); {outcome}; {time.time() - started:.1f}s", flush=True)


def job_parts(request: Measurement, config: RunConfig, points: Sequence[int]) -> distributed.Parts:
    """The part files of this request for these points: the same command finds the same folder
    again, also once nothing is left to measure (to remove what a rank killed while it merged left)."""
    description = json.dumps([config.run, repr(request), [int(point) for point in points]])
    return distributed.Parts(request.res_path, description)
