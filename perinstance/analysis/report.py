"""The output side of the four accountant scripts (docs/accountants.md): where the output goes, its
provenance, the printed table and summary, and the locked, atomic write.

An output is one long-format CSV (a row per value, labelled by kind and direction,
perinstance/accounting/guarantees.py) with a hidden provenance file beside it that names the script and
input it comes from and its checksum: what lets the same script on the same input replace it
without --overwrite, and nothing else.
"""

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

from perinstance.accounting.guarantees import Direction, Kind
from perinstance.accounting.intervals import quantile
from perinstance.analysis.reading import Source, run_key
from perinstance.errors import UsageError
from perinstance.files import fileio, storage

TABLE_ROWS = 20
PROVENANCE_FORMAT = 1
KIND_LABEL = {Kind.ESTIMATE: "estimate (Monte Carlo, not a bound)",
              Kind.HELD_ESTIMATE: "held estimate (Δ* held between measurements, not a bound)",
              Kind.CERTIFIED: "certified bound", Kind.GUARANTEE: "guarantee (the filter's budget, every trajectory)",
              Kind.BASELINE: "data-independent baseline", Kind.GLA_STATISTIC: "GLA statistic (loose)"}
# The kind a summary is about: a guarantee or a bound when there is one.
MAIN_KINDS = (Kind.GUARANTEE, Kind.CERTIFIED, Kind.HELD_ESTIMATE, Kind.ESTIMATE, Kind.GLA_STATISTIC, Kind.BASELINE)


@dataclass(frozen=True)
class Output:
    """Where an accountant writes, checked (output_path): `script` wrote it from `source`, the
    input file, unless `overwrite` lets it replace anything."""

    path: str
    script: str
    source: str
    overwrite: bool

    def check_replaceable(self) -> None:
        """Refuse (one line naming --out) an existing file that is not this script's own earlier
        output for this same input (its provenance file says so and its checksum still matches),
        unless --overwrite."""
        if os.path.lexists(self.path) and not self.overwrite and not _own_output(self.path, self.script, self.source):
            raise UsageError("--out", f"{self.path} exists and is not {self.script}.py's earlier output for "
                                      f"{self.source}; refusing to replace it (use another --out, or --overwrite)")


def output_path(source: Source, script: str) -> Output:
    """The Output of accountants.Source `source` for `script`: --out, or <res-dir>/<res-name>_<script>.csv,
    or <stem>_<script>.csv next to --res-file; checked before any work so that an output never
    clobbers a file.

    Refused (one line naming --out): the input file itself, a folder, a destination folder that
    cannot be created or written (fileio.check_output: its missing folders are created when the output is
    written), and an existing file that Output.check_replaceable refuses.
    """
    if source.out:
        path = source.out
    elif source.res_name is not None:
        stem = os.path.splitext(source.res_name)[0] if storage.extension(source.res_name) else source.res_name
        path = os.path.join(source.res_dir, f"{stem}_{script}.csv")
    else:
        stem = os.path.splitext(os.path.basename(source.res_file))[0]
        path = os.path.join(os.path.dirname(source.res_file), f"{stem}_{script}.csv")
    input_path = source.path[0]
    if _same_file(path, input_path):
        raise UsageError("--out", f"{path} is the input file; choose another output")
    fileio.check_output(path, "--out")
    output = Output(path, script, input_path, source.overwrite)
    output.check_replaceable()
    return output


def _same_file(path, other):
    if os.path.exists(path) and os.path.exists(other):
        return os.path.samefile(path, other)
    return os.path.realpath(path) == os.path.realpath(other)


def provenance_path(path: str) -> str:
    """The hidden file beside an output that records where it comes from."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.provenance.json")


def _own_output(path, script, source):
    """`path` is what `script` wrote from `source` and nobody has changed it since."""
    try:
        with open(provenance_path(path), encoding="utf-8") as handle:
            provenance = json.load(handle)
        return (isinstance(provenance, dict) and provenance.get("script") == script
                and provenance.get("input") == _input_seen_from(path, source)
                and provenance.get("sha256") == fileio.sha256_of(path))
    except (OSError, ValueError):
        return False


def _input_seen_from(path, source):
    """The input's path relative to the output's folder: still right when both move together."""
    return os.path.relpath(os.path.realpath(source), os.path.realpath(os.path.dirname(path) or "."))


def write_output(output: Output, frame: pd.DataFrame) -> None:
    """Write the output CSV atomically, then its provenance beside it, under the output's lock: two
    accountants writing one --out at once take turns, each checks again that it may replace what
    is there now, and a CSV never ends up beside another writer's provenance."""
    text = fileio.csv_text(frame)
    with fileio.locked(output.path, "--out"):
        output.check_replaceable()
        fileio.write_text(output.path, text, flag="--out")
        fileio.write_json(provenance_path(output.path), {
            "format": PROVENANCE_FORMAT, "script": output.script, "input": _input_seen_from(output.path, output.source),
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}, flag="--out")


# --- the printed table and summary (§3.5) -------------------------------------------------------

def report(output: Output, result: pd.DataFrame, value: str, keys: list[str], groups: list[str],
           correct: pd.DataFrame | None = None, notes: dict | None = None) -> None:
    """Print the guarantee (direction max) with its kinds side by side and a summary, then write
    `result` (long format: one row per key and kind) to `output` (an Output). `notes`: {Kind: words} where a
    kind means more than KIND_LABEL says (a composition's estimate that holds values between checkpoints),
    said in the kinds line and the summary line."""
    notes = notes or {}
    labels = {kind: f"{kind} ({notes[kind]})" if kind in notes else label for kind, label in KIND_LABEL.items()}
    # The max over directions where there is one; a file that measured one direction shows that one.
    has_max = "direction" in result and (result["direction"] == Direction.MAX).any()
    shown = result[result["direction"] == Direction.MAX] if has_max else result
    wide = shown.pivot_table(index=keys, columns="kind", values=value, aggfunc="first").reset_index()
    kinds = [kind for kind in Kind if kind in wide.columns]
    main = next(kind for kind in MAIN_KINDS if kind in kinds)
    if Kind.BASELINE in kinds and main != Kind.BASELINE:
        wide["ratio"] = wide[main] / wide[Kind.BASELINE]
    print(wide.head(TABLE_ROWS).to_string(index=False, float_format=lambda number: f"{number:.4g}"))
    if len(wide) > TABLE_ROWS:
        print(f"... {len(wide) - TABLE_ROWS} more rows in {output.path}")
    print("kinds: " + "; ".join(f"{kind} = {labels[kind]}" for kind in kinds))
    if correct is not None:
        correct = wide[keys].merge(correct, on=[key for key in keys if key in correct.columns], how="left")["correct"]
    frame = wide.assign(subset="all")
    if correct is not None and set(correct.dropna().unique()) >= {0, 1}:
        labelled = wide.assign(subset=np.where(correct.to_numpy() == 1, "correct", "misclassified"))
        frame = pd.concat([frame, labelled], ignore_index=True)
    summary = frame.groupby(groups + ["subset"], sort=True).apply(_summarise_kinds, kinds, main,
                                                                  include_groups=False).reset_index()
    named = f"{main}: {notes[main]}" if main in notes else main
    print(f"\nsummary of {value} ({named}; medians; '2x below': share of points with {main} <= baseline/2)")
    print(summary.to_string(index=False, float_format=lambda number: f"{number:.4g}"))
    write_output(output, result)
    print(f"wrote {output.path}")


def _summarise_kinds(group, kinds, main):
    summary = {"points": len(group)}
    for kind in kinds:
        summary[str(kind)] = np.nanmedian(group[kind].to_numpy(dtype=float))
    values = group[main].to_numpy(dtype=float)
    summary[f"{main} q10"] = quantile(values, 0.1)
    summary[f"{main} q90"] = quantile(values, 0.9)
    if Kind.BASELINE in kinds and main != Kind.BASELINE:
        summary["2x below"] = np.mean(values <= group[Kind.BASELINE].to_numpy(dtype=float) / 2)
    return pd.Series(summary)


def correct_table(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame | None:
    """`correct` per `keys` from the measured rows (None when the rows do not all record it)."""
    correct = pd.to_numeric(rows["correct"], errors="coerce")
    if correct.isna().any():
        return None
    return rows[keys].assign(correct=correct).groupby(keys, as_index=False)["correct"].first()


def correct_at_end(rows: pd.DataFrame) -> pd.DataFrame | None:
    """`correct` per point at each run's last checkpoint (majority over runs; a tie is misclassified),
    as a frame (point, correct); None when the rows do not all record it."""
    correct = pd.to_numeric(rows["correct"], errors="coerce")
    if correct.isna().any():
        return None
    last = rows["step"] == rows.groupby(run_key(rows))["step"].transform("max")
    share = correct[last].groupby(rows.loc[last, "point"]).mean()
    return pd.DataFrame({"point": share.index, "correct": (share > 0.5).astype(int).to_numpy()})
