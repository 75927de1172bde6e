"""Reproduce the papers' findings on your own run: train, measure, account, draw, report.

    python reproduce.py                      # quick preset: embedded MNIST, LeNet-5, CPU
    python reproduce.py --preset mnist --device cuda
    python reproduce.py --dataset imagefolder:/data/my-images
    python reproduce.py --set mean_batch_sizes=64,256 --set num_batches=100

A preset is a typed configuration (ReproduceConfig); `--set FIELD=VALUE` overrides any of its
fields, checked against the field's type (`--dataset X` is `--set dataset=X`). Runs
train_dpsgd.py, compute_sensitivity.py and the accountant scripts exactly as a user would (same
code, same files under models/ and res/), skips what a previous run finished, and writes its
figures, report.md and report.html (the same report as one self-contained page) to --out-dir
(default figures/). The report lists the configuration and every command that produced its
numbers.
"""

import gc
import re
import sys
import time
from collections.abc import Sequence

import numpy as np

from perinstance.cli import options
from perinstance.cli.main import script_mains
from perinstance.cli.options import HELP_FORMAT, Parser, add_device_argument
from perinstance.experiments import (
    audits,
    figures,
    filtered_run,
    main_run,
    membership,
    nonprivate_run,
    one_run,
    point_table,
    report,
    run_report,
    sampling_rates,
)
from perinstance.experiments.commands import Commands, peak_resident_bytes
from perinstance.experiments.config import (
    DATA_ROOT,
    GAP_CANARY_RUN_FIELDS,
    GAP_RUN_FIELDS,
    MAIN_RUN_FIELDS,
    MEAN_RULE_FIELDS,
    PRESETS,
    ReproduceConfig,
    apply_overrides,
    check_config,
    check_dataset,
    field_types,
    variant_tag,
)
from perinstance.files import fileio
from perinstance.plots.report_files import markdown_table
from perinstance.train import runs
from perinstance.train.data import load_dataset


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def build_parser(prog: str | None = None) -> Parser:
    parser = Parser(prog=prog, description=__doc__, formatter_class=HELP_FORMAT)
    parser.add_argument("--preset", default="quick", choices=list(PRESETS), help="the configuration reproduced")
    parser.add_argument("--dataset", default=None, help="override the preset's dataset (e.g. imagefolder:PATH); "
                                                        "the same as --set dataset=...")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help=f"override a field of the preset (repeatable); fields: {', '.join(field_types())}")
    parser.add_argument("--out-dir", default="figures", help="where the figures and report.md go")
    options.add_groups_argument(parser)
    add_device_argument(parser)
    return parser


def parse_args(argv: Sequence[str] | None,
               prog: str | None = None) -> tuple[str, ReproduceConfig, str, str, point_table.Groups | None]:
    """(preset name, configuration with every override applied, device, out_dir, the groups of --groups)."""
    args = build_parser(prog).parse_args(argv)
    assignments = ([f"dataset={args.dataset}"] if args.dataset is not None else []) + args.set
    config = apply_overrides(PRESETS[args.preset], assignments)
    check_config(config)
    check_dataset(config, args.preset, "--dataset" if args.dataset is not None else "--set")
    groups = None if args.groups is None else point_table.read_groups(args.groups)
    if groups is not None:  # its points against the training set before any work: the main run trains on all of it
        groups.check(np.arange(len(load_dataset(config.dataset, DATA_ROOT).train_y)), config.dataset)
    fileio.writable_folder(args.out_dir, "--out-dir")
    return args.preset, config, args.device, args.out_dir, groups


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int | None:
    """The reproduction, with the objects that exist when it starts (the imported modules', living as long as the
    process) frozen out of the cycle collector until it ends: the collection after each step
    (train/memory.release_freed_memory) then takes milliseconds instead of 0.25 s."""
    gc.collect()
    gc.freeze()
    try:
        return reproduce(argv, prog)
    finally:
        gc.unfreeze()


def reproduce(argv: Sequence[str] | None = None, prog: str | None = None) -> int | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    preset, config, device, out_dir, groups = parse_args(argv, prog)
    name = f"{preset}-{slug(config.dataset)}"
    commands = Commands(script_mains())
    started = time.time()

    # 1-3. The main run (sum rule, with the one-run audit's canaries and Δ* of its tracked points at every step), Δ*
    # of every point at every checkpoint, and the accountants on it.
    main = main_run.train_and_measure(commands, config, preset, name, device)
    main_name, run = main.name, main.run
    accounted = main_run.account_main_run(commands, config, main)

    # 4. The mean update rule at several sampling rates, in two controlled designs (figure 3).
    mean_name = f"{name}{variant_tag(config, preset, MAIN_RUN_FIELDS + MEAN_RULE_FIELDS)}-mean"
    mean_results = {"fixed": sampling_rates.fixed_checkpoint_design(commands, config, main_name, mean_name, run,
                                                                    main.sensitivities, device),
                    "matched": sampling_rates.matched_steps_design(commands, config, mean_name, run, device)}

    # 5. The bounds held against attacks: the per-instance audits, the realised-size mean rule's gap to the sum
    # rule's accounting on a small run, and the membership attack per class against a non-private run.
    gap_name = f"{name}{variant_tag(config, preset, GAP_RUN_FIELDS)}-gap"
    attack_findings = {"audit": audits.audit_rules(commands, config, main_name, mean_name, out_dir, device),
                       "gap": audits.gap_audit(commands, config, gap_name, out_dir, device)}
    nodp_name, attack_findings["nonprivate"] = nonprivate_run.train_nonprivate(commands, config, preset, name, device)
    attack_findings["membership"] = membership.membership_attack(commands, config, main_name, nodp_name, out_dir,
                                                                 device)

    # 6. The one-run audit: the main run's canaries per norm group against the accounting of their sensitivity,
    # and a realised-size mean-rule run's canaries against the sum rule's accounting.
    attack_findings["one_run"] = (one_run.main_run_audit(commands, config, main_name, out_dir) if config.canaries
                                  else None)
    gap_canary_name = f"{name}{variant_tag(config, preset, GAP_CANARY_RUN_FIELDS)}-gap-canaries"
    attack_findings["one_run_gap"] = one_run.gap_run_audit(commands, config, gap_canary_name, device)

    # 7. The individual Rényi filter at the main run's σ, q and ε against uniform DP-SGD (skipped when filter_cap
    # is 0).
    attack_findings["filter"] = filtered_run.filter_comparison(commands, config, preset, name, main, out_dir, device)

    # 8. Figures and report.
    with commands.timed("figures 1-6 and their numbers"):
        findings = figures.draw_figures(out_dir, config, main, accounted, mean_results, device)
    # The main run's points: points.csv, the galleries, ε per class and per group (run_report.PointReport).
    with commands.timed("points.csv and the galleries"):
        findings["points"] = run_report.per_point_report(
            out_dir, runs.open_run(main.run_dir, "models", DATA_ROOT), main, accounted, groups, device, DATA_ROOT,
            with_summary=False, class_accuracy=findings["test_accuracy_per_class"])
    findings.update(attack_findings)
    written, markdown, page = report.write_report(out_dir, preset, config, argv, commands, run, findings,
                                                  time.time() - started)
    print("\n" + "\n".join(markdown_table(commands.timing_table(time.time() - started))))
    print(f"\nreproduce.py --preset {preset}: {len(report.figures_drawn(config))} figures, {markdown} and {page} "
          f"written in {time.time() - started:.0f}s; peak resident memory {peak_resident_bytes() / 1e9:.2f} GB; one row per "
          f"training point in {findings['points'].points_path}")
    for index, finding in enumerate(written.findings, 1):
        print(f"  {index}. {finding.title}: {finding.takeaway}")

