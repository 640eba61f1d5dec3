"""Compare runs: ``autotuner-compare RUN_DIR [RUN_DIR ...] [labels=[a,b]] [digits=3] [oss_json=FILE]``, and
the OSS benchmark JSON export.

The table follows ``torch.utils.benchmark.Compare``: one table per op, a row per (phase, run) — runs are
the "env" and group the rows — and a column per shape point. Times are trimmed to ``digits``
significant figures in one unit per table. The first run is the baseline: every other run's cell carries
its speed-up over the baseline (``1.25x`` = 1.25 times faster), marked ``~`` where the two medians are
within noise of each other (their distance is under the mean of their IQRs), so a reader does not
mistake noise for a change.

``oss_json=FILE`` writes the rows in the PyTorch OSS benchmark database format (as TorchAO's CI does):
one record per (op, phase, shape point, metric).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotuner.cli import Command, entry, parse
from autotuner.cli import setting as cli_setting
from autotuner.errors import UserError, say_error
from autotuner.ops.naming import PHASES
from autotuner.results import load_run_rows
from autotuner.results.atomic import atomic_write_text, check_writable
from autotuner.results.environment import load_environment
from autotuner.results.table import text_table
from autotuner.results.units import MISSING, common_time_unit, significant
from autotuner.termination import ending_quietly_on_a_closed_pipe

OSS_METRICS = ("median_us", "tflops", "peak_bytes", "activation_bytes")


def load_run(run_dir: str | Path) -> dict[str, Any]:
    """A run's rows (checked: autotuner.results.read_rows) and environment record. A folder without
    results, a results file the tools cannot use or an environment record that is not a JSON object is a
    UserError."""
    path = Path(run_dir)
    rows = load_run_rows(path, "pass the directory of a finished or interrupted run")
    return {"dir": path, "rows": rows, "env": load_environment(path)}


def within_noise(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two rows' medians differ by less than the mean of their IQRs."""
    spread = ((a.get("iqr_us") or 0) + (b.get("iqr_us") or 0)) / 2
    return abs(a["median_us"] - b["median_us"]) <= spread


# What a row was measured with, besides its op, phase and point: runs that differ in one of these compare
# that too (bf16 against fp32, nsys against get_data, TP=2 against TP=1), which the table says first.
SETTINGS = ("case", "dtype", "device", "launcher", "tensor_parallel")


def default_labels(paths: Sequence[str]) -> list[str]:
    """Each run's folder name; where two share it (runs/tiny/get_data/12-00-00, runs/tiny/nsys/12-00-00),
    as many of their last path parts as tell them apart; one folder given twice, numbered."""
    parts = [Path(p).resolve().parts for p in paths]
    for depth in range(1, max(map(len, parts)) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{p[-1]} #{i + 1}" for i, p in enumerate(parts)]  # one folder twice: its name, numbered


def _measured_with(run: dict[str, Any]) -> dict[str, str]:
    """A run's :data:`SETTINGS` as its rows hold them (several values joined by ``/``) and its device's
    name as its environment record does."""

    def held(setting: str) -> str:
        seen = sorted({str(row[setting]) for row in run["rows"] if row.get(setting) is not None})
        return "/".join(seen) or "?"

    values = {setting: held(setting) for setting in SETTINGS}
    values["device_name"] = str(((run["env"] or {}).get("environment") or {}).get("device_name"))
    return values


def differences(runs: Sequence[dict[str, Any]], labels: Sequence[str]) -> str | None:
    """One line naming the :data:`SETTINGS` (and the device's name) in which the runs differ, each run's
    values beside its label; None when they differ in none."""
    measured = [_measured_with(run) for run in runs]
    found = []
    for setting in measured[0]:
        values = [each[setting] for each in measured]
        if len(set(values)) > 1:
            each = ", ".join(f"{label}: {v}" for label, v in zip(labels, values, strict=True))
            found.append(f"{setting} ({each})")
    return f"the runs differ in {'; '.join(found)}: each ratio compares that too" if found else None


def _no_time(row: dict[str, Any]) -> str:
    """What a table cell says for a row without a time: its status (failed, skipped, ...), ``no median``
    for an ok row without one, ``no status`` for a row without one."""
    status = row.get("status")
    return "no median" if status == "ok" else str(status or "no status")


def render(runs: Sequence[dict[str, Any]], labels: Sequence[str], digits: int = 3) -> str:
    """The comparison tables, one per op, as text."""
    index, why = {}, {}
    for label, run in zip(labels, runs, strict=True):
        for row in run["rows"]:
            key = (label, row["op"], row["phase"], row["point"])
            if row.get("status") == "ok" and row.get("median_us") is not None:
                index[key] = row
            elif why.get(key) != "failed":  # a failed rank's row says more than another rank's
                why[key] = _no_time(row)
    ops = list(dict.fromkeys(row["op"] for run in runs for row in run["rows"]))
    points = list(dict.fromkeys(row["point"] for run in runs for row in run["rows"]))
    blocks = []
    for op in ops:
        cells = [r["median_us"] for (_, o, _, _), r in index.items() if o == op]
        unit, scale = common_time_unit(cells, digits)  # us where the op has no time in any run
        header = [f"[ {op} ]  ({unit})", *points]
        lines = []
        for phase in PHASES:
            for position, label in enumerate(labels):
                line = [f"{phase:8} {label}"]
                for point in points:
                    row = index.get((label, op, phase, point))
                    if row is None:
                        line.append(why.get((label, op, phase, point), MISSING))
                        continue
                    text = significant(row["median_us"] / scale, digits)
                    base = index.get((labels[0], op, phase, point))
                    if position and base is not None:
                        speedup = base["median_us"] / row["median_us"]
                        text += f" ({'~' if within_noise(base, row) else ''}{speedup:.2f}x)"
                    if row.get("warnings"):
                        text += " !"
                    line.append(text)
                lines.append(line)
        blocks.append(text_table(header, lines, [False] + [True] * len(points), rule=False))
    legend = (
        f"baseline: {labels[0]}; (N.NNx) = speed-up over the baseline, ~ = within noise (IQR); "
        f"! = the sampler warned (see results.csv); failed, skipped, ...: the row's status, no time (its "
        f"error column says why); no median: ok but without one; {MISSING} = no row (not measured)"
    )
    return "\n\n".join([*blocks, legend])


def oss_records(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's rows as PyTorch OSS benchmark database records (one per row and metric)."""
    env = run["env"].get("environment", {})
    records = []
    for row in run["rows"]:
        if row.get("status") != "ok":
            continue
        for metric in OSS_METRICS:
            value = row.get(metric)
            if value is None:
                continue
            records.append(
                {
                    "benchmark": {
                        "name": "autotuner op benchmark",
                        "mode": "training",
                        "dtype": row["dtype"],
                        "extra_info": {
                            "device": row["device"],
                            "arch": env.get("device_name"),
                            "launcher": row["launcher"],
                            "phase": row["phase"],
                            "shape": row["point"],
                        },
                    },
                    "model": {
                        "name": f"{row['case']}.{row['op']}",
                        "type": "megatron-core operator",
                        "origins": ["autotuner"],
                    },
                    "metric": {
                        "name": f"{row['phase']}_{metric}",
                        "benchmark_values": [value],
                        "target_value": None,
                    },
                    "runners": [
                        {"name": env.get("hostname"), "type": row["device"], "arch": env.get("device_name")}
                    ],
                    "dependencies": {
                        k: env.get(k) for k in ("torch", "megatron_core", "transformers") if env.get(k)
                    },
                }
            )
    return records


@dataclass(frozen=True)
class CompareSettings:
    labels: list[str] | None = cli_setting(
        None, "names of the runs, one each, in order (default: their folders' names)", "[A,B]"
    )
    digits: int = cli_setting(3, "significant figures of the times, 1 to 15", "N")
    oss_json: str | None = cli_setting(
        None, "also write every run's rows in the OSS benchmark JSON format here", "FILE"
    )


COMMAND = Command(
    "autotuner-compare",
    "autotuner.compare",
    "Compare runs in one table per op, the first run the baseline (a speed-up beside every other's time).",
    "RUN_DIR",
    CompareSettings,
)


@ending_quietly_on_a_closed_pipe
@entry(COMMAND)
def main(argv: Sequence[str] | None = None) -> int:
    paths, args, _ = parse(COMMAND, argv)
    if not 1 <= args.digits <= 15:
        say_error(COMMAND.name, f"digits={args.digits}: give 1 to 15")
        return 2
    try:
        runs = [load_run(r) for r in paths]
        labels = list(args.labels) if args.labels else default_labels(paths)
        if len(labels) != len(runs):
            raise UserError(
                f"labels names {len(labels)} runs but {len(runs)} were given: give one label per run"
            )
        if len(set(labels)) != len(labels):
            raise UserError(f"labels={labels} names two runs alike: give each run a label of its own")
        if args.oss_json:
            check_writable(args.oss_json, f"oss_json={args.oss_json}", reads=paths)
    except UserError as exc:
        say_error(COMMAND.name, exc)
        return exc.exit_code
    if args.oss_json:  # written before the table is printed: kept if the reader stops reading (| head)
        records = [record for run in runs for record in oss_records(run)]
        try:
            atomic_write_text(Path(args.oss_json), json.dumps(records, indent=1) + "\n")
        except OSError as exc:  # permissions, a full disk: found only by writing
            error = UserError(
                f"cannot write {args.oss_json}: {exc.strerror or exc}: give a path you can write"
            )
            say_error(COMMAND.name, f"{error}")
            return error.exit_code
    differ = differences(runs, labels)
    if differ:
        print(differ + "\n")
    print(render(runs, labels, args.digits))
    if args.oss_json:
        print(f"\n{len(records)} records in {args.oss_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
