"""Real training steps, timed and metered: the measured side of ``autotuner.predict ... validate=true``.

A prediction is only as good as its error on the thing it predicts, so this module runs that thing: the
whole Megatron-Core ``GPTModel`` (embedding, the layers, final norm, output layer and loss) trained for a
few steps in a given :class:`~autotuner.predict.layout.Layout`, and reports how long a step took and how
much memory it held.

What one step is (as Megatron's ``train_step`` does it, less what a layout here cannot have)::

    forward_backward_func = megatron.core.pipeline_parallel.get_forward_backward_func()
    forward_backward_func(...)        # this data-parallel rank's micro-batches: forward, loss, backward;
                                      # PP=1: Megatron's no-pipelining schedule (gradients accumulate),
                                      # PP>1: its 1F1B schedule, activations sent between stages (gloo here);
                                      # vpp>1: its interleaved schedule over vpp model chunks per rank
    reduce the gradients              # what Megatron's finalize_model_grads does, timed on its own:
                                      # sequence-parallel ones over TP; with dp > 1 the dense buffer over
                                      # the data-parallel group and the expert buffer over the expert-data-
                                      # parallel group (tp*dp/ep ranks), one all-reduce each, after the
                                      # backward (Megatron's DDP default: overlap_grad_reduce=False);
                                      # with the distributed optimizer a reduce-scatter each instead
    optimizer.step()                  # torch.optim.Adam over this rank's parameters (fp32 masters of a
                                      # bf16/fp16 model's, copied back after), timed on its own
    zero the gradients                # kept allocated in flat buffers, as Megatron's DDP keeps them; Megatron
                                      # zeroes them at the next step's start, the same work, timed here
                                      # with the optimizer, where the prediction counts it
    all-gather the parameters         # distributed optimizer only: each rank stepped its shard; timed
                                      # with the reductions (the data-parallel communication)

Timing: ``time.perf_counter`` around each phase (after ``torch.cuda.synchronize`` on a GPU). ``warmup``
steps first (the first allocates Adam's states; the gradient buffers exist from the start), then one
metered step (below), then ``repeats`` timed steps. Every rank times every step; under torchrun the
ranks meet at a barrier before each step, so a step's time is the slowest rank's (the step ends when the
last stage finishes), and the reported step time is the median over the timed steps of that maximum,
with its interquartile range.

Peak memory: the memory in use when the metered step begins, counted by storage (parameters, their
gradients, the optimizer's states: :func:`autotuner.measure.memory.weight_bytes`), plus the peak above
that during the step from :func:`autotuner.measure.memory.peak_and_held_bytes` (on CPU the running sum
of the allocator events ``torch.profiler`` records with ``profile_memory=True``; on a GPU the caching
allocator's ``max_memory_allocated``): the forward-backward's peak, or what it left in use plus the
optimizer step's peak, whichever is higher. The data-parallel collectives between them (the gradients'
all-reduce or reduce-scatter, the distributed optimizer's all-gather) are not metered: NCCL does them in
place in Megatron's buffers, which the prediction counts, while gloo, their CPU stand-in, copies a whole
buffer into a temporary whose free the profiler can miss (memory module docstring; a DP=2
distributed-optimizer step read 42.1 MB above its resident memory in 2 of 6 identical runs, 21.7 MB in
the others). Collectives inside the forward-backward (TP, EP) stay in it. Process RSS is not used: it
counts the allocator's caches and Python. The metered step is not timed (the profiler slows it). The
peak of a run is the largest over its ranks.

Inside the timed steps each op's time per visit is taken too, by module hooks (autotuner.predict.in_step:
the layers, the final norm and output layer forward and backward, the embedding's and the stage's
forward; each rank's fenced means, ``in_step_s``), for the validation to set beside the op rows it predicted
from. Not with activation recompute.

The model, its data, its gradients and optimizer, and each phase of a step are built and run by
autotuner.predict.stage_trainer (``StageTrainer``; how a pipeline stage gets the single-process model's
weights, how data parallelism splits the batch); this module times and meters them.

Under torchrun (TP x PP x DP processes) call :func:`measure_steps` on every rank, or run
``python -m autotuner.predict.steps`` (:func:`steps_command` builds that command, :func:`run_steps`
runs it and reads the result): tp * pp * dp processes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from autotuner.errors import UserError, say_error
from autotuner.predict.in_step import IN_STEP_KEYS, Visit
from autotuner.predict.layout import Layout
from autotuner.predict.stage_trainer import OPTIMIZER, StageTrainer, flush_inside_layers
from autotuner.predict.step_measurement import RankSteps, StepMeasurement
from autotuner.results.atomic import atomic_write_text, check_writable


def steps_command(
    case: str,
    overrides: list[str],
    layout: Layout,
    repeats: int,
    warmup: int,
    out: str | os.PathLike[str],
    lr: float = 1e-3,
    flush_in_layers: bool = False,
) -> list[str]:
    """The command line that measures these steps: torchrun with TP x PP x DP processes when that is above
    one."""
    args = [
        "-m",
        "autotuner.predict.steps",
        f"out={out}",
        f"case={case}",
        f"repeats={repeats}",
        f"warmup={warmup}",
        f"lr={lr}",
        *(["flush_in_layers=true"] if flush_in_layers else []),
        *(
            f"layout.{f.name}={_text(getattr(layout, f.name))}"
            for f in fields(Layout)
            if getattr(layout, f.name) is not None  # an unset option: its default stands
        ),
        *overrides,
    ]
    world = layout.gpus
    if world == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *args]


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def measure_steps(
    case: str,
    overrides: list[str] | tuple[str, ...],
    layout: Layout,
    repeats: int = 5,
    warmup: int = 2,
    lr: float = 1e-3,
    flush_in_layers: bool = False,
) -> StepMeasurement:
    """Train the case's whole model in ``layout`` for ``warmup`` + 1 + ``repeats`` steps and measure them
    (module docstring). Under torchrun every rank calls this and gets the same result (all ranks' data).
    ``overrides``: the project's config overrides (``hf.``, ``tf.``, ``device=``, ``seed=``...);
    ``flush_in_layers``: autotuner.predict.stage_trainer.flush_inside_layers (the calibration's
    flushed host work)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from autotuner.measure.memory import peak_and_held_bytes, weight_bytes

    if repeats < 1 or warmup < 0:
        raise UserError(f"repeats={repeats}, warmup={warmup}: give repeats >= 1 and warmup >= 0")
    overrides = list(overrides)
    trainer = StageTrainer(case, overrides, layout, lr)
    spec, device, clock, world = trainer.spec, trainer.device, trainer.clock, trainer.spec.world
    if flush_in_layers:
        flush_inside_layers(trainer.chunks, device)
    sync = trainer.sync

    fb_s: list[float] = []
    reduce_s: list[float] = []
    opt_s: list[float] = []
    losses: list[float] = []
    resident = step_peak = parameters = 0
    for step in range(warmup + 1 + repeats):
        if world > 1:
            dist.barrier()
        if step == warmup:  # the metered step
            resident = trainer.resident_bytes()
            parameters = weight_bytes(trainer.model.parameters())
            stored: list[list[dict[str, Any]]] = []
            # the data-parallel collectives between the metered phases (module docstring, "Peak memory")
            backward_peak, held = peak_and_held_bytes(
                lambda: stored.append(trainer.forward_backward()),  # noqa: B023 - called right here
                device,
            )
            trainer.reduce()
            optimizer_peak, _ = peak_and_held_bytes(trainer.optimizer_step, device)
            trainer.gather_params()
            step_peak = max(backward_peak, held + optimizer_peak)
            fb_s.append(0.0)
            reduce_s.append(0.0)
            opt_s.append(0.0)
            store = stored[0]
        else:
            sync()
            timed = clock is not None and step > warmup  # the hooks time the timed steps alone
            if timed:
                clock.start_step()
            start = time.perf_counter()
            store = trainer.forward_backward()
            sync()
            backward_done = time.perf_counter()
            if timed:
                clock.recording = False
                clock.collect()
            trainer.reduce()
            sync()
            reduced = time.perf_counter()
            trainer.optimizer_step()
            sync()
            stepped = time.perf_counter()
            if trainer.sharded:
                trainer.gather_params()
                sync()
            fb_s.append(backward_done - start)
            reduce_s.append(reduced - backward_done + time.perf_counter() - stepped)
            opt_s.append(stepped - reduced)
        if store:
            losses.append(float(torch.stack([item["loss"] for item in store]).float().mean()))
    mine = RankSteps(
        rank=spec.rank,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=trainer.dp_rank,
        forward_backward_s=tuple(fb_s),
        reduce_s=tuple(reduce_s),
        optimizer_s=tuple(opt_s),
        losses=tuple(losses),
        parameter_bytes=int(parameters),
        resident_bytes=int(resident),
        step_peak_bytes=int(step_peak),
        in_step_s=_present(clock.per_visit()) if clock is not None else {},
        optimizer_tensors=len(trainer.masters),
    )
    ranks = _gather(mine, world, len(fb_s)) if world > 1 else (mine,)
    # the timeline of the timed step whose forward-backward (the slowest rank's) is the median: every
    # rank picks the same from the gathered times
    slowest = sorted(
        range(warmup + 1, warmup + 1 + repeats),
        key=lambda i: (max(r.forward_backward_s[i] for r in ranks), i),
    )
    chosen = slowest[(len(slowest) - 1) // 2]
    if clock is not None and clock.timelines:
        visits = tuple(clock.timelines[chosen - warmup - 1])
        wall = clock.step_walls[chosen - warmup - 1]
        ranks = _gather_timelines(ranks, visits, wall) if world > 1 else (replace(mine, timeline=visits),)
    return StepMeasurement(
        case=case,
        overrides=tuple(overrides),
        layout=layout,
        command=tuple(steps_command(case, overrides, layout, repeats, warmup, "<out.json>", lr)),
        warmup=warmup,
        repeats=repeats,
        device=str(device),
        optimizer=f"{OPTIMIZER}(lr={lr})"
        + (" over fp32 master weights" if trainer.mixed else "")
        + (", sharded over the data-parallel ranks (distributed optimizer)" if trainer.sharded else ""),
        schedule=f"megatron.core.pipeline_parallel.schedules.{trainer.schedule.__name__}",
        ranks=ranks,
        timeline_step=chosen,
    )


def _present(medians: tuple[float, ...]) -> dict[str, float]:
    """IN_STEP_KEYS' medians as {key: seconds}, without those not timed (NaN)."""
    return {k: v for k, v in zip(IN_STEP_KEYS, medians, strict=True) if not math.isnan(v)}


def _gather(mine: RankSteps, world: int, steps: int) -> tuple[RankSteps, ...]:
    """Every rank's RankSteps on every rank, as one float64 tensor each (no pickled objects)."""
    import torch
    import torch.distributed as dist

    def pack(r: RankSteps) -> Any:
        losses = list(r.losses) + [float("nan")] * (steps - len(r.losses))
        head = [
            r.rank,
            r.tp_rank,
            r.pp_rank,
            r.dp_rank,
            r.parameter_bytes,
            r.resident_bytes,
            r.step_peak_bytes,
            len(r.losses),
            r.optimizer_tensors,
        ]
        times = [*r.forward_backward_s, *r.reduce_s, *r.optimizer_s]
        in_step = [r.in_step_s.get(key, math.nan) for key in IN_STEP_KEYS]
        return torch.tensor([*head, *in_step, *times, *losses], dtype=torch.float64)

    local = pack(mine)
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)
    ranks = []
    for packed in everyone:
        v = packed.tolist()
        head, in_step, rest = v[:9], v[9 : 9 + len(IN_STEP_KEYS)], v[9 + len(IN_STEP_KEYS) :]
        ranks.append(
            RankSteps(
                rank=int(head[0]),
                tp_rank=int(head[1]),
                pp_rank=int(head[2]),
                dp_rank=int(head[3]),
                parameter_bytes=int(head[4]),
                resident_bytes=int(head[5]),
                step_peak_bytes=int(head[6]),
                forward_backward_s=tuple(rest[:steps]),
                reduce_s=tuple(rest[steps : 2 * steps]),
                optimizer_s=tuple(rest[2 * steps : 3 * steps]),
                losses=tuple(rest[3 * steps : 3 * steps + int(head[7])]),
                in_step_s=_present(tuple(in_step)),
                optimizer_tensors=int(head[8]),
            )
        )
    return tuple(sorted(ranks, key=lambda r: r.rank))


def _gather_timelines(
    ranks: tuple[RankSteps, ...], mine: tuple[Visit, ...], wall: float
) -> tuple[RankSteps, ...]:
    """Every rank's timeline on every rank, on one time axis: the wall clock at each rank's start mark
    (``wall``) minus the earliest rank's shifts its visits (autotuner.predict.in_step). One float64
    all-gather: a first row with the wall clock, then each visit as four numbers (its key's index in
    IN_STEP_KEYS, the layer, start, end), padded with NaN to the longest rank's."""
    import torch
    import torch.distributed as dist

    longest = torch.tensor([len(mine)], dtype=torch.int64)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    local = torch.full((int(longest.item()) + 1, 4), math.nan, dtype=torch.float64)
    local[0, 0] = wall
    for row, (key, layer, start, end) in enumerate(mine, start=1):
        local[row] = torch.tensor([IN_STEP_KEYS.index(key), layer, start, end], dtype=torch.float64)
    everyone = [torch.empty_like(local) for _ in ranks]
    dist.all_gather(everyone, local)
    origin = min(float(packed[0, 0]) for packed in everyone)
    by_rank = {}
    for who, packed in enumerate(everyone):
        shift = float(packed[0, 0]) - origin
        visits = tuple(
            (IN_STEP_KEYS[int(k)], int(layer), start + shift, end + shift)
            for k, layer, start, end in packed[1:].tolist()
            if not math.isnan(k)
        )
        by_rank[who] = (visits, shift)
    return tuple(replace(r, timeline=by_rank[r.rank][0], timeline_start_s=by_rank[r.rank][1]) for r in ranks)


class StepsFailed(RuntimeError):
    """The steps' processes ended with an error (its last line is the message) or past their time."""


def run_steps(
    case: str,
    overrides: list[str],
    layout: Layout,
    out: str | os.PathLike[str],
    repeats: int = 5,
    warmup: int = 2,
    lr: float = 1e-3,
    timeout_s: float = 600,
    flush_in_layers: bool = False,
) -> StepMeasurement:
    """Measure in fresh processes (torchrun for TP x PP > 1) and read the result back from ``out``.
    A run past ``timeout_s`` (a rank that hangs in the pipeline) is killed; either failure raises
    :class:`StepsFailed`."""
    command = steps_command(case, overrides, layout, repeats, warmup, out, lr, flush_in_layers)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    try:
        proc = run_process_group(command, env, timeout_s)
    except subprocess.TimeoutExpired:
        raise StepsFailed(f"measured steps ran past {timeout_s:g} s and were ended") from None
    if proc.returncode != 0:
        # the whole of the workers' output beside where the result would have been: the one line says
        # why, the file says where (every rank's traceback, torchrun's summary)
        log = Path(out).with_suffix(".stderr.txt")
        atomic_write_text(log, proc.stderr)
        raise StepsFailed(
            f"measured steps failed ({proc.returncode}): {_worker_error(proc.stderr)} (all output: {log})"
        )
    return StepMeasurement.from_json(json.loads(Path(out).read_text()))


def run_process_group(
    command: list[str], env: dict[str, str] | None, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """``command`` run to its end in a session of its own, its output captured (``env``: None inherits
    this process's). Whatever ends the wait early ends every process the command started, not only the
    first: a SIGTERM sent to this process (what SLURM sends at the time limit) or a Ctrl-C reaches none of
    them, and a torchrun killed outright leaves its workers running (it starts each in a session of its
    own, so only its own shutdown reaches them; a hung rank would hold its core until its collective's
    timeout). So on the timeout (subprocess.TimeoutExpired, raised), any exception, or a SIGTERM (handled
    while the command runs, then passed on to this process's own handler or default) the session gets
    SIGTERM, which torchrun passes on to its workers, killing those left after its own 30 s; then, after
    :data:`STEPS_STOP_GRACE_S`, SIGKILL to whatever is left of it."""
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    on_main = threading.current_thread() is threading.main_thread()  # only it may set a handler
    previous = (signal.getsignal(signal.SIGTERM) or signal.SIG_DFL) if on_main else signal.SIG_DFL

    def on_sigterm(signum: int, frame: Any) -> None:
        _stop_session(proc)
        signal.signal(signum, previous)
        os.kill(os.getpid(), signum)  # as if the handler had not been here

    if on_main:
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException:
        _stop_session(proc)
        raise
    finally:
        # unless the SIGTERM came and was passed on: what handled it then stays (autotuner.termination's
        # handler leaves SIG_DFL while it unwinds, so that a second SIGTERM ends the process at once)
        if on_main and signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, previous)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


# Seconds a stopped steps' session gets to end on SIGTERM: past torchrun's own 30 s for its workers (the
# nsys launcher's STOP_GRACE_S is another thing: how long nsys may take to save its report).
STEPS_STOP_GRACE_S = 35.0


def _stop_session(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to every process of ``proc``'s session, then SIGKILL to any left after the grace."""
    with contextlib.suppress(ProcessLookupError):  # raised once every process of the session has ended
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STEPS_STOP_GRACE_S)
        time.sleep(0.1)  # torchrun ends first; its workers, signalled too, a moment after
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:")


def _worker_error(stderr: str) -> str:
    """The line of a failed run's stderr that says why: a worker's own one-line error, else the last
    exception a worker printed (not torchrun's summary of the failure, whose last line is a rule of
    ``=``), else the rank and exit code of torchrun's root cause (a worker killed by a signal prints
    nothing), else the last line. A worker's uncaught exception comes with each line prefixed by
    ``[rank<N>]:`` (the excepthook torch.distributed sets once a process group exists); the prefix goes."""
    lines = [_RANK_PREFIX.sub("", line).strip() for line in stderr.splitlines()]
    lines = [line for line in lines if line]
    for line in lines:
        if line.startswith("autotuner: error:"):
            return line
    raised = [
        line
        for line in lines
        if re.match(r"[A-Za-z_][\w.]*(Error|Exception)\b", line) and "ChildFailedError" not in line
    ]
    if raised:
        return raised[-1]
    summary = "\n".join(lines)
    rank, code = (
        re.search(r"^rank\s*: (\d+)", summary, re.M),
        re.search(r"^exitcode\s*: (-?\d+)", summary, re.M),
    )
    if rank and code:
        number = int(code.group(1))
        how = f"exited with {number}"
        if number < 0:
            with contextlib.suppress(ValueError):
                how = f"was killed by {signal.Signals(-number).name}"
        return f"rank {rank.group(1)} {how}, printing no error"
    return lines[-1] if lines else ""


def _value(text: str) -> Any:
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def parse_args(argv: list[str]) -> tuple[dict[str, Any], Layout, list[str]]:
    """``out=`` ``case=`` ``repeats=`` ``warmup=`` ``lr=`` ``flush_in_layers=`` and ``layout.<field>=``
    (``layout.dtype`` defaults to the device's: fp32 on a CPU, bf16 on a GPU); anything else is a config
    override passed on."""
    own: dict[str, Any] = {
        "case": "tiny",
        "repeats": 5,
        "warmup": 2,
        "lr": 1e-3,
        "out": None,
        "flush_in_layers": False,
    }
    layout: dict[str, Any] = {}
    overrides = []
    layout_fields = {f.name for f in fields(Layout)}
    for arg in argv:
        key, sep, text = arg.partition("=")
        if not sep:
            raise UserError(f"{arg!r} is not key=value: give e.g. layout.tp=2 or hf.hidden_size=256")
        if key.startswith("layout."):
            name = key.removeprefix("layout.")
            if name not in layout_fields:
                raise UserError(
                    f"unknown layout field {name!r}: use one of {', '.join(sorted(layout_fields))}"
                )
            layout[name] = _value(text)
        elif key in own:
            own[key] = text if key in ("case", "out") else _value(text)
        else:
            overrides.append(arg)
    if not own["out"]:
        raise UserError("no out=: give out=<file.json> for the measured steps")
    check_writable(own["out"], f"out={own['out']}")  # before the steps: their end writes it
    for key, least in (("repeats", 1), ("warmup", 0)):
        if not isinstance(own[key], int) or isinstance(own[key], bool) or own[key] < least:
            raise UserError(f"{key}={own[key]!r} is not an integer >= {least}: give e.g. {key}={least + 1}")
    if not isinstance(own["lr"], (int, float)) or not math.isfinite(own["lr"]) or own["lr"] <= 0:
        raise UserError(f"lr={own['lr']!r} is not a learning rate above 0: give e.g. lr=1e-3")
    if not isinstance(own["flush_in_layers"], bool):
        raise UserError(
            f"flush_in_layers={own['flush_in_layers']!r} is not true or false: give flush_in_layers=true"
        )
    if "seq_len" not in layout:
        raise UserError("no layout.seq_len: give e.g. layout.seq_len=32")
    if "dtype" not in layout:
        # the steps run on this machine: its dtype, as the profiler's dtype=auto picks it (a Layout's own
        # default, bf16, is for predicting a GPU job; CPU bf16 matrix products are ~250x slower)
        from autotuner.model.runtime import resolve_device, resolve_dtype

        layout["dtype"] = resolve_dtype("auto", resolve_device("auto"))
    return own, Layout(**layout), overrides


USAGE = (
    "usage: python -m autotuner.predict.steps layout.seq_len=N out=FILE.json [case=tiny] [layout.tp=N] "
    "[layout.pp=N] [layout.vpp=N] [layout.dp=N] [layout.ep=N] [layout.micro_batch_size=N] "
    "[layout.global_batch_size=N] [layout.dtype=fp32|bf16] [repeats=5] [warmup=2] [lr=1e-3] [the "
    "profiler's config overrides: device=cpu hf.<field>=V tf.<field>=V ...] (under torchrun with "
    "tp x pp x dp processes when that is above one; the layout fields are autotuner.predict.layout.Layout's)"
)


def main(argv: list[str] | None = None) -> None:
    from autotuner.model.runtime import quiet_megatron_import

    args = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(args):
        print(USAGE)
        return
    try:
        own, layout, overrides = parse_args(args)
        quiet_megatron_import()
        result = measure_steps(
            own["case"], overrides, layout, own["repeats"], own["warmup"], own["lr"], own["flush_in_layers"]
        )
    except UserError as exc:
        say_error("autotuner", exc)
        raise SystemExit(exc.exit_code) from None
    if result.ranks and int(os.environ.get("RANK", 0)) == 0:
        data = result.to_json()
        data["command"] = steps_command(
            own["case"],
            overrides,
            layout,
            own["repeats"],
            own["warmup"],
            own["out"],
            own["lr"],
            own["flush_in_layers"],
        )
        atomic_write_text(own["out"], json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
