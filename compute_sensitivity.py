"""Measure how much one training point changes a DP-SGD update at saved checkpoints (accounting.md §2).

    python compute_sensitivity.py --exp eps_delta --reduction sum --points all --stage all --res-name lenet_sum
    python compute_sensitivity.py --exp renyi --reduction mean --points random:10 --stage 0.5 --res-name lenet_mean

--reduction sum: Δ* = ||h(g*)|| per point and checkpoint. --reduction mean: --num-batches samples
of Δ_B (--exp eps_delta), or the Rényi statistic S for --num-iters target batches × --num-batches
sets of α batches, per direction (--exp renyi). The training flags name the run; a run without
checkpoints is trained first (unless --no-train). Rows go to res/<res-name>.csv; rerunning adds
only what is missing, so an interrupted run resumes.
"""

import time

from perinstance import results, sensitivity_cli
from perinstance.errors import run_main
from perinstance.options import Parser, parse_points


def main(argv=None):
    parser = sensitivity_cli.add_measurement_args(Parser(description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)

    # Every flag is checked before anything is trained, measured or written.
    request = sensitivity_cli.parse_request(args)
    run = sensitivity_cli.find_run(args)
    points = parse_points(args.points, run.universe, args.seed)
    result_file = sensitivity_cli.ResultFile.open(request.res_path, request.overwrite,
                                                  results.run_columns(run.metadata, request.reduction))
    if args.no_train:
        sensitivity_cli.require_finished(run, args)

    started = time.time()
    metadata = sensitivity_cli.ensure_trained(run)
    steps = sensitivity_cli.resolve_stages(request.stages, run.saved_steps(), metadata["total_steps"])
    written, skipped = 0, 0
    for step in steps:
        missing = result_file.missing(metadata["run"], step, points, request)
        skipped += sum(len(points) - len(todo) for todo in missing.values())
        needed = sorted(set().union(*missing.values()))
        if not needed:
            continue
        rows = sensitivity_cli.measure_checkpoint(request, run, step, needed, args.device)
        rows = sensitivity_cli.keep_missing(rows, missing)
        result_file.add(rows)
        written += len(rows)

    print(f"{metadata['run']}: {len(points)} points × {len(steps)} stages (steps {', '.join(map(str, steps))}): "
          f"{written} rows written to {request.res_path}, {skipped} (point, stage, experiment) combinations "
          f"already there skipped; {time.time() - started:.1f}s")


if __name__ == "__main__":
    run_main(main)
