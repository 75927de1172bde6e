"""The result file compute_sensitivity.py appends to (res/<res-name>.csv or .parquet): the rows
already there, and locked, atomic merges of new ones (docs/sensitivity.md, "Result files")."""

import math
import os
from collections.abc import Sequence

import numpy as np
import pandas as pd

import perinstance
from perinstance.errors import UsageError
from perinstance.files import fileio, results, storage

# A row is identified by these; the first seven name a (run, stage, point, measurement) combination.
COMBINATION_COLUMNS = ["run", "step", "point", "exp", "direction", "alpha", "mc_seed"]
ROW_ORDER = COMBINATION_COLUMNS + ["quantity", "block", "target_batch", "sample"]
TEXT_COLUMNS = ["run", "exp", "reduction", "direction", "quantity", "dataset", "model", "clipping", "update_rule"]


def cell_text(value: object) -> str:
    """A cell as the CSV writes it, so that values read back compare equal to fresh ones."""
    if isinstance(value, float | np.floating):
        return "" if math.isnan(value) else f"{value:.10g}"
    return str(value)


class ResultFile:
    """res/<res-name>.csv or .parquet: rows already there, and locked, atomic merges of new rows.

    Several processes (two measurements, the ranks of one torchrun) may add to one file at once:
    each `add` takes the file's lock (fileio.locked on <res-dir>/<name without extension>, one
    lock whatever the format), reads the file as it is now, merges its rows in and rewrites the
    file atomically, so that no writer loses another's rows.

    `automatic`: named without an extension, the file is CSV while it holds at most
    storage.AUTO_PARQUET_ROWS rows, and Parquet from then on (the CSV is then removed).
    """

    def __init__(self, path: str, rows: pd.DataFrame, config: dict | None = None, replace_file: bool = False,
                 automatic: bool = False) -> None:
        self.path = path  # where the rows are (a new file: where they will go)
        self.config = config  # run columns the rows must agree with (None: not checked)
        self.replace_file = replace_file  # --overwrite 1: the first add replaces the file's rows
        self.automatic = automatic
        self._keep(rows)

    def _keep(self, rows):
        self.rows = rows
        self.done = set(zip(*(self._texts(rows[column]) for column in COMBINATION_COLUMNS)))

    @staticmethod
    def _texts(values):
        """cell_text of every value, computed once per distinct value (a file may hold millions)."""
        codes, distinct = pd.factorize(values, use_na_sentinel=False)
        return np.asarray([cell_text(value) for value in distinct] or [""], dtype=object)[codes]

    @classmethod
    def open(cls, path: str, overwrite: bool, config: dict | None, automatic: bool = False) -> "ResultFile":
        """The file's rows (none with --overwrite 1), refusing rows of another run configuration.

        Checks first that its folder can take the file, and removes the temps that killed
        writes left there."""
        folder = os.path.dirname(path) or "."
        fileio.check_folder(folder, "--res-name")
        if os.path.isdir(path):
            raise UsageError("--res-name", f"{path} is a folder, not a result file")
        fileio.remove_stale_temps(folder)
        if overwrite or not os.path.exists(path):
            return cls(path, pd.DataFrame(columns=results.COLUMNS), config, replace_file=bool(overwrite),
                       automatic=automatic)
        return cls(path, cls._read(path, config), config, automatic=automatic)

    @staticmethod
    def _read(path, config):
        rows = results.read_results(path, flag="--res-name")
        rows[TEXT_COLUMNS] = rows[TEXT_COLUMNS].astype(str)
        texts = {} if config is None else {column: ResultFile._texts(rows[column]) for column in results.CONFIG_COLUMNS}
        differing = [f"column {column} has {'/'.join(sorted(set(text)))} in file, {cell_text(config[column])} now"
                     for column, text in texts.items() if (text != cell_text(config[column])).any()]
        if differing:
            raise UsageError("--res-name", f"refusing to mix: {'; '.join(differing)}; "
                                           "use another --res-name or --overwrite 1")
        return rows[results.COLUMNS]

    def missing(self, run_name: str, step: int, points: Sequence[int],
                request: "perinstance.measure.measurement.Measurement") -> dict[str, list[int]]:
        """{direction: points} whose rows at `step` are not in the file yet (COMBINATION_COLUMNS:
        what was measured and with which Monte-Carlo seed, not the flags that asked for it)."""
        alpha = np.nan if request.alpha is None else float(request.alpha)
        mc_seed = np.nan if request.mc_seed is None else request.mc_seed
        return {direction: [point for point in points
                            if tuple(map(cell_text, (run_name, step, point, request.family, direction, alpha, mc_seed)))
                            not in self.done]
                for direction in request.directions}

    def add(self, rows: pd.DataFrame) -> None:
        """Merge `rows` into the file as it is now and rewrite it atomically, in a fixed row order,
        all under the file's lock; a row that another writer added meanwhile is kept once."""
        stem = os.path.splitext(self.path)[0]
        with fileio.locked(stem, "--res-name"):
            if self.automatic:  # another writer may have turned it Parquet meanwhile
                self.path = results.results_path(os.path.basename(stem), os.path.dirname(stem))
            if self.replace_file or not os.path.exists(self.path):
                current = pd.DataFrame(columns=results.COLUMNS)
            else:
                current = self._read(self.path, self.config)
            merged = pd.concat([frame for frame in (current, rows) if len(frame)] or [rows], ignore_index=True)
            keys = pd.DataFrame({column: self._texts(merged[column]) for column in ROW_ORDER})
            merged = merged[~keys.duplicated(keep="first").to_numpy()]
            merged = merged.sort_values(ROW_ORDER, kind="mergesort", na_position="last", ignore_index=True)
            target = self._target(len(merged))
            storage.write_frame(target, merged[results.COLUMNS], "--res-name")
            if target != self.path and os.path.exists(self.path):
                try:  # the rows live on in the Parquet file just written
                    os.remove(self.path)
                except OSError as error:
                    raise fileio.write_error(self.path, error, "--res-name") from None
            self.path = target
            self.replace_file = False
        self._keep(merged)

    def _target(self, rows):
        """Where `rows` rows go: an automatic name turns Parquet above storage.AUTO_PARQUET_ROWS
        rows and stays Parquet once it is (unless --overwrite 1 starts it afresh)."""
        if not self.automatic:
            return self.path
        stays = storage.extension(self.path) == storage.PARQUET and os.path.exists(self.path) and not self.replace_file
        ending = storage.PARQUET if rows > storage.AUTO_PARQUET_ROWS or stays else storage.CSV
        return os.path.splitext(self.path)[0] + ending

    def describe(self) -> str:
        """The file's path, and why an automatic name is Parquet (for the summary line)."""
        if not (self.automatic and storage.extension(self.path) == storage.PARQUET):
            return self.path
        stem = os.path.basename(os.path.splitext(self.path)[0])
        why = (f"more than {storage.AUTO_PARQUET_ROWS:,} rows" if len(self.rows) > storage.AUTO_PARQUET_ROWS
               else "the file was Parquet already")
        return f"{self.path} (Parquet: {why}; --res-name {stem}.csv keeps CSV)"
