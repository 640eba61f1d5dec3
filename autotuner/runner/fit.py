"""The fit check: before the first row, each row's estimated peak against what the process can hold.

Every launcher's process that measures (get_data's and torch_profiler's run, nsys's worker) calls
:func:`check_fit` before it builds the model. Each planned (point, op, phase) gets the process's
estimated peak while it measures it (autotuner.runner.memory_estimate, the numbers ``dry_run=true``
prints) and the limit (autotuner.measure.limits: on a CPU this process's resident set plus the smaller
of the system's available memory and its cgroup's room; on a GPU its free memory plus what this process
reserved; ``memory_limit_gib=`` where that is smaller). A row over the limit is not run: the runner
records it ``refused`` with both numbers, and one line says what would fit (a shorter sequence, a
smaller batch, a block of fewer layers, the other ops).
``run_unfit=true`` runs them anyway. Under torchrun a row is refused where any rank refuses it, so every
rank runs the same rows (their collectives pair up).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from autotuner.measure.limits import MemoryLimit, memory_limit
from autotuner.runner.memory_estimate import Workspace
from autotuner.runner.plan import plan

if TYPE_CHECKING:
    from autotuner.ops_test.base import OpTest, ShapePoint
    from autotuner.runner import RunSpec
    from autotuner.runner.dry_run import Preview

Key = tuple[str, str, str]  # (point label, op, phase)


@dataclass
class FitCheck:
    """Each row's estimated peak, the limit, and which rows are refused (see the module docstring)."""

    limit: MemoryLimit
    estimates: dict[Key, int] = field(default_factory=dict)  # bytes; a row absent: no estimate
    refused: set[Key] = field(default_factory=set)
    build_peak: int = 0
    run_unfit: bool = False  # the refused rows run all the same
    advice: str = ""  # what would fit, in words
    # per row, what one call costs on meta (FLOPs, bytes moved, aten operations): the plan's time
    # (autotuner.runner.eta)
    costs: dict[Key, tuple[int, int, int]] = field(default_factory=dict)

    def columns(self, key: Key) -> dict[str, Any]:
        """The row's columns of the check: its estimate and the limit."""
        guess = self.estimates.get(key)
        return {
            "estimated_peak_bytes": guess,
            "memory_limit_bytes": self.limit.bytes if guess is not None else None,
        }

    def refuses(self, key: Key) -> bool:
        return key in self.refused and not self.run_unfit

    def reason(self, key: Key) -> str:
        """A refused row's error: the estimate and the limit."""
        return (
            f"does not fit in memory: estimated {_gib(self.estimates[key])}, limit {_gib(self.limit.bytes)} "
            f"({self.limit.source}); run_unfit=true runs it"
        )

    def agree(self, keys: list[Key], device: torch.device) -> None:
        """Under torchrun: refuse the rows any rank refuses (every rank must run the same rows, as their
        collectives pair up). Every rank calls it, with the same ``keys``."""
        flags = torch.tensor([key in self.refused for key in keys], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        self.refused = {key for key, flag in zip(keys, flags.tolist(), strict=True) if flag}

    def out_of_memory(self, key: Key) -> str:
        """What a row killed for memory says: ``out of memory (estimated X GiB, limit Y GiB)``."""
        guess = self.estimates.get(key)
        estimated = f"estimated {_gib(guess)}, " if guess is not None else ""
        return f"out of memory ({estimated}limit {_gib(self.limit.bytes)})"

    def to_json(self) -> dict[str, Any]:
        """The check as plain data (the nsys worker leaves it for its parent: autotuner.launchers.nsys)."""
        return {
            "limit": self.limit.bytes,
            "source": self.limit.source,
            "estimates": [[*key, size] for key, size in self.estimates.items()],
            "refused": [list(key) for key in sorted(self.refused)],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FitCheck:
        estimates = {(str(p), str(o), str(ph)): int(size) for p, o, ph, size in data["estimates"]}
        refused = {(str(p), str(o), str(ph)) for p, o, ph in data["refused"]}
        return cls(MemoryLimit(int(data["limit"]), str(data["source"])), estimates, refused)

    @property
    def builds(self) -> bool:
        """Whether any row runs, so the model is to be built."""
        return self.run_unfit or len(self.refused) < len(self.estimates) or not self.estimates


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB"


def _keys(spec: RunSpec) -> list[Key]:
    return [(point.label, op.name, phase) for point, op, phase in plan(spec)]


def _estimates(preview: Preview) -> dict[Key, int]:
    return {
        (c.point, c.op, c.phase): guess.total
        for c, guess in zip(preview.costs, preview.estimates, strict=True)
        if guess is not None
    }


def check_fit(cfg: Any, spec: RunSpec) -> FitCheck:
    """Estimate every planned row, compare with this process's limit now, and say in one line (stderr,
    rank 0) what is refused and what would fit. Call it before the model is built: the runtime term is
    this process's resident set then. The ranks of a torchrun job agree in the runner (:meth:`agree`). A
    plan that builds no Megatron model (a capture's generic calls) is not estimated: every row runs."""
    from autotuner.runner.dry_run import preview

    limit = run_limit(cfg, spec.device)
    if spec.session is not None:
        return FitCheck(limit, run_unfit=bool(cfg.run_unfit))
    workspace = Workspace.of(cfg, spec.device)
    check = judge(spec, workspace, limit, preview(spec, workspace, totals=False, limit=limit.bytes))
    check.run_unfit = bool(cfg.run_unfit)
    if check.refused and spec.rank == 0:
        print(f"autotuner: {check.advice}", file=sys.stderr)
    return check


def run_limit(cfg: Any, device: torch.device) -> MemoryLimit:
    """The limit a run of ``cfg`` checks against: what ``device`` lets this process hold now
    (autotuner.measure.limits), or ``memory_limit_gib`` where that is smaller (a budget of one's own: a
    machine shared with other work, a smaller device's memory)."""
    limit = memory_limit(device)
    if cfg.memory_limit_gib is None:
        return limit
    budget = int(float(cfg.memory_limit_gib) * 2**30)
    return (
        MemoryLimit(budget, f"memory_limit_gib={cfg.memory_limit_gib:g}") if budget < limit.bytes else limit
    )


def judge(spec: RunSpec, workspace: Workspace, limit: MemoryLimit, seen: Preview) -> FitCheck:
    """The check of a preview made with ``limit`` (``dry_run=true`` shows it as a run would make it)."""
    costs = {
        (c.point, c.op, c.phase): (c.flops, c.bytes_moved, c.memory.operations)
        for c in seen.costs
        if c.flops is not None and c.bytes_moved is not None and c.memory is not None
    }
    check = FitCheck(limit, estimates=_estimates(seen), build_peak=seen.build_peak, costs=costs)
    if seen.build_peak > limit.bytes:  # the parts alone do not fit: nothing runs
        check.refused = set(check.estimates)
    else:
        check.refused = {key for key, size in check.estimates.items() if size > limit.bytes}
    if check.refused:
        check.advice = _advice(spec, workspace, check)
    return check


def _smaller(spec: RunSpec, workspace: Workspace, limit: int, points: list[ShapePoint]) -> ShapePoint | None:
    """The first point of ``points`` at which every planned op fits, or None."""
    from autotuner.runner.dry_run import preview

    for point in points:
        trial = preview(dataclasses.replace(spec, points=[point]), workspace, totals=False, limit=limit)
        if trial.build_peak <= limit and all(e is not None and e.total <= limit for e in trial.estimates):
            return point
    return None


def _advice(spec: RunSpec, workspace: Workspace, check: FitCheck) -> str:
    """One line: how many rows are refused, which, the largest estimate and the limit, and what would fit."""
    from autotuner.ops_test.base import BLOCK, ShapePoint

    refused = [key for key in _keys(spec) if key in check.refused]
    worst = max(check.estimates[key] for key in refused)
    where = sorted({point for point, _, _ in refused}, key=lambda p: [k[0] for k in _keys(spec)].index(p))
    ops = list(dict.fromkeys(op for _, op, _ in refused))
    said = (
        f"{len(refused)} of {len(check.estimates)} rows do not fit in memory and are refused "
        f"({', '.join(ops)} at {', '.join(where)}: estimated up to {_gib(worst)}, limit "
        f"{_gib(check.limit.bytes)}, {check.limit.source})"
    )
    if check.build_peak > check.limit.bytes:
        fewer = " or a block of fewer layers (transformer_block_layers=)" if spec.block_layers > 1 else ""
        return (
            f"{said}; building the model parts alone takes {_gib(check.build_peak)}: choose ops that need "
            "fewer parts (ops=: the embedding and output layer are built only for the ops that use them)"
            f"{fewer}"
        )
    ways = []
    largest = max(spec.points, key=lambda p: (p.seq_len * p.micro_batch_size, p.seq_len))
    multiple = spec.tf_config.tensor_model_parallel_size if spec.tf_config.sequence_parallel else 1
    shorter = [
        ShapePoint(s, largest.micro_batch_size)
        for s in (largest.seq_len >> k for k in range(1, 12))
        if s >= max(16, multiple) and s % multiple == 0
    ]
    found = _smaller(spec, workspace, check.limit.bytes, shorter)
    if found is not None:
        ways.append(f"shapes.seq_len=[{found.seq_len}]")
    if largest.micro_batch_size > 1:
        fewer = [ShapePoint(largest.seq_len, b) for b in range(largest.micro_batch_size // 2, 0, -1)]
        found = _smaller(spec, workspace, check.limit.bytes, fewer)
        if found is not None:
            ways.append(f"shapes.micro_batch_size=[{found.micro_batch_size}]")
    block = [op for op in spec.ops if op.name in ops and BLOCK in op.needs]
    if block and spec.block_layers > 1:
        ways.append(_fewer_layers(spec, workspace, check.limit.bytes, block[0], refused))
    fitting = [op.name for op in spec.ops if op.name not in ops]
    if fitting:
        ways.append(f"the other {len(fitting)} ops as they are (ops=[{','.join(fitting)}])")
    fits = " or ".join(w for w in ways if w) or "nothing smaller that was tried"
    return f"{said}; would fit: {fits}; run_unfit=true runs them"


def _fewer_layers(spec: RunSpec, workspace: Workspace, limit: int, block: OpTest, refused: list[Key]) -> str:
    """``transformer_block_layers=N`` for the most layers below the run's at which the block's refused
    rows fit (empty if none does)."""
    from autotuner.runner.dry_run import preview

    points = [p for p in spec.points if any(k[0] == p.label and k[1] == block.name for k in refused)]
    for layers in range(spec.block_layers - 1, 0, -1):
        trial = preview(
            dataclasses.replace(spec, points=points, block_layers=layers), workspace, totals=False
        )
        rows = [e for c, e in zip(trial.costs, trial.estimates, strict=True) if c.op == block.name]
        if trial.build_peak <= limit and all(e is not None and e.total <= limit for e in rows):
            return f"transformer_block_layers={layers}"
    return ""
