"""Device calibration: the ceilings an op's achieved rate is judged against, and the rates the predictor
needs that no op row holds (``autotuner-calibrate --help``; docs/measurement.md, docs/predict.md).

``autotuner-calibrate [device=...] [out=FILE]`` measures, with the get_data sampler: matrix-product FLOP/s
per dtype; copy and zeroing bandwidth over a buffer far past the last-level cache; the caches; on a GPU
host-to-device and device-to-host bandwidth (pageable and pinned); torch's Adam step over fp32 parameters
per parameter and per tensor; the gradient accumulation per micro-batch, per gradient dtype; on a CPU a
training step's host work outside its ops and Adam's cost inside a step beyond its back-to-back rate (a
CPU host's own terms, zero on a GPU). Under torchrun, ``collectives=true`` measures the collectives
between the processes and merges them into the file; ``links=true`` measures a cluster's links level by
level (autotuner.measure.links) and writes a cluster file that predict and tune take as ``cluster=FILE``.

The file (default ``runs/calibration/<device>.json``, autotuner.results.calibration) names the device and
versions it was measured with; get_data runs read it to give every row its bound and ceiling fraction.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from autotuner.cli import Command, entry, parse, setting
from autotuner.errors import UserError, say_error
from autotuner.measure.cache import last_level_cache_bytes, shared_cache_bytes, warm_cache_bytes
from autotuner.measure.timer import DeviceTimer, RankAgreement, SamplingPolicy, sample
from autotuner.model.host_heap import keep_freed_memory
from autotuner.model.runtime import (
    DTYPES,
    device_name,
    environment,
    gloo_has_sequence_parallel_collectives,
    resolve_device,
)
from autotuner.notices import say_notes
from autotuner.ops.naming import PHASES
from autotuner.ops_test.base import OpCall
from autotuner.ops_test.functional_ops import copy_call, matmul_call, transfer_call
from autotuner.results.atomic import atomic_write_text, check_writable
from autotuner.results.calibration import (
    ADAM_IN_STEP,
    ADAM_PER_TENSOR,
    ADAM_TOGETHER,
    ADAM_ZERO_STATE,
    COLLECTIVES,
    DEFAULT_DIR,
    GRAD_ACCUMULATION,
    HOST_WORK,
    HOST_WORK_FLUSHED,
    LINK_KEYS,
    ZEROING_BANDWIDTH,
    bus_factor,
    default_path,
    link_key,
    load,
    merge_links,
)
from autotuner.results.units import human_bytes
from autotuner.termination import check_stop, ending_as_a_command

# Matrix sizes: big enough to reach the unit's peak, small enough for a CPU in seconds. CPUs without
# bf16/fp16 units run those products ~250x slower than fp32, hence the small CPU sizes for them.
MATMUL_SIZE = {
    "cuda": {"fp32": 8192, "bf16": 8192, "fp16": 8192},
    "cpu": {"fp32": 1024, "bf16": 128, "fp16": 128},
}

# The Adam step's parameters: the four weight matrices of Llama-shaped layers (hidden h, FFN width f:
# the fused QKV, the attention output, the gated FC1, FC2), as (h, f, layers); their parameters,
# gradients and two states together far larger than the last-level cache, as a model's are. The mix of
# sizes matters on a CPU: on this project's 2-core VM one Adam step took 1.1-1.4 ns per parameter over
# equal 256K-element tensors and 2.1-2.7 over a layer's mixed sizes (the llama-shaped model's own: 2.2).
ADAM_LAYERS = {"cuda": (4096, 11008, 1), "cpu": (512, 1408, 4)}
# The Adam step's second set: many small tensors (count, elements each), whose step is mostly the cost
# per tensor that a set of a few large ones hides.
ADAM_SMALL_TENSORS = (256, 256)
# The gradient every timed Adam step gets (a fixed value: its states neither zero nor denormal).
ADAM_GRAD = 1e-3

# Host transfer sizes tried for the pageable ceilings (the best rate is kept).
TRANSFER_SIZES = (16 * 2**20, 64 * 2**20, 256 * 2**20)

# Collective sizes (bytes of the full buffer: the all-reduced tensor, the gathered output, the scattered
# input). NCCL over NVLink reaches its bus-bandwidth plateau from about 64-256 MiB (nccl-tests' curves);
# gloo over loopback from some tens of MiB. The smallest size shows the latency a small collective pays.
COLLECTIVE_SIZES = {"cuda": (2**20, 2**24, 2**28, 2**30), "cpu": (2**16, 2**20, 2**24, 2**26)}
# The largest two sizes' bus bandwidths within this fraction of each other: the plateau was reached.
PLATEAU_FRACTION = 0.15


# How every rate here is sampled: fewer warm-up calls than an op's row takes (the calls are large).
POLICY = SamplingPolicy(warmup=2, min_samples=5, budget_s=1.0, target_rel_ci=0.02)


def _median_s(call: OpCall, device: torch.device, policy: SamplingPolicy) -> float:
    check_stop()  # a Ctrl-C a finalizer swallowed ends the calibration here, not minutes later
    return sample(DeviceTimer(device), lambda: call.fn(*call.inputs), policy).median_ns * 1e-9


def calibrate(device: torch.device, policy: SamplingPolicy | None = None) -> dict[str, Any]:
    """Measure the ceilings of ``device`` with the functional ops' calls at peak sizes; plain data."""
    keep_freed_memory(device)  # as the processes whose rows and steps these rates serve
    policy = policy or POLICY
    peak_flops = {}
    for dtype, n in MATMUL_SIZE[device.type].items():
        peak_flops[dtype] = 2 * n**3 / _median_s(matmul_call(n, n, n, device, DTYPES[dtype]), device, policy)
    bandwidth, zeroing, size = memory_rates(device, policy)
    result: dict[str, Any] = {
        "device_type": device.type,
        "environment": environment(device),
        "peak_flops": peak_flops,
        "memory_bandwidth": bandwidth,
        ZEROING_BANDWIDTH: zeroing,
        "buffer_bytes": size,
        # where a warm row's data sit between calls, so where a step's op can find them again:
        # autotuner.predict.caches.cache_plan (the shared cache; a core's own in a calibration without it)
        "warm_cache_bytes": warm_cache_bytes(device),
        "shared_cache_bytes": shared_cache_bytes(device),
        "shared_cache_bytes_reported": last_level_cache_bytes(device),
    }
    per_parameter, per_tensor, count = adam_rates(device, policy)
    result["adam_seconds_per_parameter"] = per_parameter
    result[ADAM_PER_TENSOR] = per_tensor
    result["adam_parameters"] = count
    result[ADAM_ZERO_STATE] = adam_zero_state_seconds(device, policy, per_parameter, per_tensor)
    result[GRAD_ACCUMULATION] = grad_accumulation_seconds(device, policy, size)
    if device.type == "cuda":
        # A pageable copy is staged through a pinned buffer by the driver, and its rate depends on the size
        # (seen on an H100: 9.7 GB/s at 400 MiB, 16 GB/s at 32 MiB); the ceiling is the best of a few sizes.
        for direction in ("h2d", "d2h"):
            for pinned in (False, True):
                rates = []
                for nbytes in TRANSFER_SIZES if not pinned else (size,):
                    transfer = transfer_call(direction, pinned, min(nbytes, size), device)
                    rates.append(transfer.bytes_moved["forward"] / _median_s(transfer, device, policy))
                result[transfer.ceiling] = max(rates)
    return result


# The minimal GPTModels of the host work's steps (case=tiny's architecture), at two depths: their ops take
# microseconds, and the host work grows with the layers (the block's own work around each).
HOST_WORK_MODEL = (
    "hf.hidden_size=32",
    "hf.num_attention_heads=2",
    "hf.num_key_value_heads=1",
    "hf.head_dim=16",
    "hf.intermediate_size=64",
    "hf.vocab_size=128",
)
HOST_WORK_DEPTHS = (1, 4)
HOST_WORK_STEPS = {"seq_len": 32, "micro_batch_size": 1, "global_batch_size": 4, "dtype": "fp32"}


def minimal_model_steps(flush_in_layers: bool = False) -> list[tuple[int, Any]]:
    """[(layers, StepMeasurement)]: the minimal GPTModel's real steps at each of HOST_WORK_DEPTHS, each
    run in a fresh process (Megatron is imported there, not here), one intra-op thread; with
    ``flush_in_layers`` the last-level cache flushed inside every layer's forward and backward
    (autotuner.validate.stage_trainer.flush_inside_layers)."""
    import tempfile

    from autotuner.predict.layout import Layout
    from autotuner.validate.steps import run_steps

    layout = Layout(**HOST_WORK_STEPS)
    measured = []
    for depth in HOST_WORK_DEPTHS:
        check_stop()
        overrides = [*HOST_WORK_MODEL, f"hf.num_hidden_layers={depth}", "device=cpu", "timing.threads=1"]
        with tempfile.TemporaryDirectory(prefix="autotuner-host-work-") as folder:
            measured.append(
                (
                    depth,
                    run_steps(
                        "tiny",
                        overrides,
                        layout,
                        Path(folder) / "steps.json",
                        repeats=9,
                        flush_in_layers=flush_in_layers,
                    ),
                )
            )
    return measured


def host_work(steps: list[tuple[int, Any]]) -> dict[str, float]:
    """A CPU training step's time outside its ops per micro-batch (module docstring), per phase: its part
    for a stage (``forward``, ``backward``) and per layer of it (``forward_per_layer``,
    ``backward_per_layer``), a line through the minimal model's ``steps`` (:func:`minimal_model_steps`)
    from each depth's median step's visits (autotuner.validate.in_step.host_work_s)."""
    from autotuner.validate.in_step import host_work_s

    per_depth = []
    for _, measured in steps:
        rank = measured.ranks[0]
        fb = rank.forward_backward_s[measured.timeline_step]
        per_depth.append(host_work_s(rank.timeline, fb, measured.layout.microbatches))
    (low, shallow), (high, deep) = zip((d for d, _ in steps), per_depth, strict=True)
    result = {}
    for phase, at_low, at_high in zip(PHASES, shallow, deep, strict=True):
        per_layer = max(at_high - at_low, 0.0) / (high - low)
        result[phase] = max(at_low - per_layer * low, 0.0)
        result[f"{phase}_per_layer"] = per_layer
    return result


def adam_in_step(steps: list[tuple[int, Any]], rates: Mapping[str, Any]) -> float:
    """Seconds an Adam step inside a training step takes beyond what ``rates`` (this calibration's
    back-to-back rates per parameter and per tensor, and the copy bandwidth for the gradients' zeroing)
    give, once a step (module docstring): the median, over the minimal model's timed steps at every depth
    (:func:`minimal_model_steps`), of each step's optimizer phase less those rates' share."""
    from autotuner.predict.layout import DTYPE_BYTES
    from autotuner.predict.timing import gradient_zeroing_seconds

    extra = []  # the minimal model's untouched embedding rows (~1,500 parameters, microseconds) stay in it
    for _, measured in steps:
        rank = measured.ranks[0]
        params = rank.parameter_bytes / DTYPE_BYTES[measured.layout.dtype]
        modelled = (
            rank.optimizer_tensors * rates[ADAM_PER_TENSOR]
            + params * rates["adam_seconds_per_parameter"]
            + gradient_zeroing_seconds(rates, params, rates["memory_bandwidth"])[0]  # as predicted
        )
        extra += [seconds - modelled for seconds in rank.optimizer_s[measured.warmup + 1 :]]
    return max(0.0, statistics.median(extra))


def adam_rates(
    device: torch.device,
    policy: SamplingPolicy,
    timer: DeviceTimer | None = None,
    agreement: RankAgreement | None = None,
) -> tuple[float, float, int]:
    """(seconds per parameter, seconds per tensor, parameters of the large set) of ``torch.optim.Adam.step``
    over fp32 weights with gradients: a step over the layers of ``ADAM_LAYERS`` (few large tensors) and
    one over ``ADAM_SMALL_TENSORS`` (many small ones), solved for the two costs (module docstring). Under
    torchrun with a barrier ``timer`` and an ``agreement``: every rank's steps at once."""
    large = _adam_layer_shapes(device)
    count, numel = ADAM_SMALL_TENSORS
    small = [(numel,)] * count
    (t_large, p_large), (t_small, p_small) = (
        _adam_step_seconds(shapes, device, policy, timer, agreement) for shapes in (large, small)
    )
    # t = tensors * per_tensor + parameters * per_parameter, for both sets
    n_large, n_small = len(large), len(small)
    per_parameter = (t_large * n_small - t_small * n_large) / (p_large * n_small - p_small * n_large)
    per_tensor = max(0.0, (t_small - p_small * per_parameter) / n_small)  # noise can push a tiny one below 0
    return (t_large - n_large * per_tensor) / p_large, per_tensor, p_large


def _adam_layer_shapes(device: torch.device) -> list[tuple[int, int]]:
    """The weight matrices of ``ADAM_LAYERS``' layers for ``device``."""
    h, f, layers = ADAM_LAYERS[device.type]
    return [(3 * h, h), (h, h), (2 * f, h), (h, f)] * layers


def adam_zero_state_seconds(
    device: torch.device, policy: SamplingPolicy, per_parameter: float, per_tensor: float
) -> float:
    """Seconds per parameter that ``torch.optim.Adam.step`` takes more where a parameter's gradient and
    moments are zero than :func:`adam_rates`' ``per_parameter`` and ``per_tensor`` give (module
    docstring): the layers of ``ADAM_LAYERS`` stepped with zero gradients, less what those rates give for
    them, per parameter (0 where nothing is left)."""
    large = _adam_layer_shapes(device)
    zero, count = _adam_step_seconds(large, device, policy, None, None, grad=0.0)
    return max(0.0, (zero - len(large) * per_tensor) / count - per_parameter)


def _adam_step_seconds(
    shapes: list[tuple[int, ...]],
    device: torch.device,
    policy: SamplingPolicy,
    timer: DeviceTimer | None,
    agreement: RankAgreement | None,
    grad: float = ADAM_GRAD,
) -> tuple[float, int]:
    """(median seconds of one ``torch.optim.Adam.step``, parameters it updated) over fp32 weights of
    ``shapes`` with gradients ``grad`` (the states are made by an untimed first step)."""
    params = [torch.zeros(shape, device=device, requires_grad=True) for shape in shapes]
    for param in params:
        param.grad = torch.full_like(param, grad)
    optimizer = torch.optim.Adam(params, lr=1e-6)
    optimizer.step()  # allocates exp_avg and exp_avg_sq: not part of a step in training
    measured = sample(timer or DeviceTimer(device), optimizer.step, policy, agreement=agreement)
    seconds = measured.median_ns * 1e-9
    if agreement is not None:
        seconds = agreement.max(seconds)[0]  # every rank's step at once: the slowest rank's
    return seconds, sum(p.numel() for p in params)


def memory_rates(device: torch.device, policy: SamplingPolicy) -> tuple[float, float, int]:
    """(copy bandwidth, zeroing bandwidth, the buffer's bytes) of a buffer far past the cache a core can
    keep (autotuner.measure.cache: not the size a VM reports, which made this 4 GiB on one): module
    docstring."""
    size = max(8 * shared_cache_bytes(device), 64 * 2**20)
    copy = copy_call(size, device)
    bandwidth = copy.bytes_moved["forward"] / _median_s(copy, device, policy)
    return bandwidth, zeroing_bandwidth(copy.inputs[0], device, policy), size


def zeroing_bandwidth(buffer: torch.Tensor, device: torch.device, policy: SamplingPolicy) -> float:
    """Bytes per second that ``buffer.zero_()`` clears (module docstring), as a training step zeroes its
    gradients (autotuner.predict.timing.gradient_zeroing_seconds); ``buffer`` far past the cache."""
    seconds = sample(DeviceTimer(device), buffer.zero_, policy).median_ns * 1e-9
    return buffer.numel() * buffer.element_size() / seconds


def grad_accumulation_seconds(device: torch.device, policy: SamplingPolicy, nbytes: int) -> dict[str, float]:
    """{gradient dtype: median seconds per parameter of ``main_grad.add_(grad)``}, the fp32 main gradient
    ``nbytes`` large (far beyond the last-level cache, as a model's gradients are)."""
    count = nbytes // 4
    main_grad = torch.zeros(count, device=device)
    rates = {}
    for name in MATMUL_SIZE[device.type]:  # the dtypes a model may train in here
        grad = torch.full((count,), 1e-3, device=device, dtype=DTYPES[name])
        add = functools.partial(main_grad.add_, grad)
        rates[name] = sample(DeviceTimer(device), add, policy).median_ns * 1e-9 / count
        del grad, add
    return rates


def _collective_call(kind: str, nbytes: int, world: int, device: torch.device) -> tuple[Any, int]:
    """The timed call of one collective of about ``nbytes`` (the full buffer, fp32, whole shards) and the
    buffer's exact bytes. The tensors are allocated once, outside the timed calls (but for send_recv's
    receive buffer, which Megatron makes for each exchange)."""
    dist = torch.distributed
    elements = max(world, nbytes // 4 // world * world)
    full = torch.ones(elements, dtype=torch.float32, device=device)
    shard = torch.ones(elements // world, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(full)), elements * 4
    # torch 2.13 renamed the one-tensor collectives (``*_single``); older torch has only the old names.
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: gather(full, shard)), elements * 4
    if kind == "send_recv":  # to the next rank, from the previous: a pipeline stage's batched exchange
        rank = dist.get_rank()

        def exchange() -> None:
            # a fresh receive buffer every call, as Megatron's p2p communication allocates one for every
            # exchange (``torch.empty(..., requires_grad=True)``): on a CPU, whose allocator keeps no
            # cache, that is memory to find and pages to fault in; one buffer reused call after call hid
            # it (two gloo processes on a 2-core CPU VM, medians of 130 exchanges: 64 KiB
            # 0.13 ms reused, 0.16-0.17 fresh; 1 MiB 0.61-0.62 and 0.79-0.88). On a GPU the caching
            # allocator hands back a block it holds.
            received = torch.empty(full.shape, dtype=full.dtype, device=device, requires_grad=True)
            ops = [
                dist.P2POp(dist.isend, full, (rank + 1) % world),
                dist.P2POp(dist.irecv, received, (rank - 1) % world),
            ]
            for request in dist.batch_isend_irecv(ops):
                request.wait()

        return exchange, elements * 4
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return (lambda: scatter(shard, full)), elements * 4


def calibrate_collectives(
    device: torch.device, policy: SamplingPolicy | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Measure the bus bandwidth of each collective between the processes of the default group (every
    rank must call this, with the same policy); returns (the calibration's link entries, notes).

    Each (collective, size) is sampled with the project's sampler (autotuner.measure.timer): every sample
    starts after a barrier, so no rank's time includes waiting for a late peer, and the sampler's
    decisions (calls per sample, when to stop) are taken by all ranks together (RankAgreement), so every
    rank calls the collective equally often and none is left waiting in it. The time of a size is the
    slowest rank's median (a collective ends when its last rank does). Bus bandwidth is
    ``bus_factor * bytes / time``; the file's ``<collective>_bandwidth`` is the largest size's (the
    plateau, what large messages get: a middle size can be faster on a CPU, whose caches hold it), and
    ``collective_points`` keeps every size's time (autotuner.predict.links interpolates between them).
    """
    dist = torch.distributed
    world, backend = dist.get_world_size(), str(dist.get_backend())
    policy = policy or SamplingPolicy(warmup=3, min_samples=5, budget_s=1.0, target_rel_ci=0.05)
    agreement = RankAgreement(device)
    timer = DeviceTimer(device, barrier=True)
    kinds = list(COLLECTIVES)
    notes = []
    if backend == "gloo" and not gloo_has_sequence_parallel_collectives():
        kinds = ["all_reduce", "send_recv"]
        notes.append(f"gloo in torch {torch.__version__} lacks all_gather_into_tensor/reduce_scatter_tensor")
    link = link_key(backend, world)
    result: dict[str, Any] = {"collective_points": {}}
    for kind in kinds:
        sizes, seconds = [], []
        for nbytes in COLLECTIVE_SIZES[device.type]:
            run, exact = _collective_call(kind, nbytes, world, device)
            measured = sample(timer, run, policy, agreement=agreement)
            sizes.append(exact)
            seconds.append(agreement.max(measured.median_ns * 1e-9)[0])
        bus = [bus_factor(kind, world) * n / t for n, t in zip(sizes, seconds, strict=True)]
        result[LINK_KEYS[kind]] = {link: bus[-1]}
        result["collective_points"][kind] = {link: {"bytes": sizes, "seconds": seconds}}
        if bus[-1] < (1 - PLATEAU_FRACTION) * max(bus) or bus[-2] < (1 - PLATEAU_FRACTION) * bus[-1]:
            notes.append(
                f"{kind}: bus bandwidth still changes at the largest sizes "
                f"({', '.join(f'{b / 1e9:.2f}' for b in bus)} GB/s): the plateau may lie beyond {sizes[-1]} B"
            )
    if device.type == "cpu":
        result[ADAM_TOGETHER] = {link: adam_rates(device, policy, timer, agreement)[0]}
    return result, notes


def _init_links(device: torch.device) -> None:
    """Start the default process group from torchrun's environment: NCCL between GPUs (one per process,
    by LOCAL_RANK), gloo between CPU processes."""
    # A rank that never arrives fails the others after this long (as autotuner.model.runtime does).
    timeout_s = float(os.environ.get("AUTOTUNER_DIST_TIMEOUT_S", 600))
    torch.distributed.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s)
    )


def _main_collectives(device: torch.device, out: Path, budget_s: float) -> int:
    """``collectives=true``: every rank measures; rank 0 merges into ``out`` (measuring the ceilings first
    when there is no file yet) and prints the bus bandwidths."""
    if int(os.environ.get("WORLD_SIZE", 1)) < 2:
        raise UserError(
            "collectives=true measures the links between processes: launch it with "
            "torchrun --nproc-per-node=N -m autotuner.calibrate collectives=true (N >= 2)"
        )
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    keep_freed_memory(device)  # the Adam step every rank times at once, as in calibrate()
    rank = int(os.environ.get("RANK", 0))
    # Rank 0 reads the file before anyone measures: a bad file fails every rank now, not after.
    existing: dict[str, Any] | None = None
    readable = True
    if rank == 0 and out.exists():
        try:
            existing = load(out)
        except UserError as exc:
            say_error("autotuner.calibrate", exc)
            readable = False
    if rank == 0 and readable and existing is None:
        # Before the process group exists: the sampler's RankAgreement would otherwise wait for the
        # other ranks to join each of rank 0's samples (they wait in the group's start meanwhile).
        print(f"no calibration at {out}: measuring the compute and memory ceilings first")
        existing = calibrate(device)
    dist = torch.distributed
    _init_links(device)
    try:
        if not RankAgreement(device).all(readable):
            return 2
        policy = SamplingPolicy(warmup=3, min_samples=5, budget_s=budget_s, target_rel_ci=0.05)
        links, notes = calibrate_collectives(device, policy)
        if rank == 0 and existing is not None:
            atomic_write_text(out, json.dumps(merge_links(existing, links), indent=2) + "\n")
            for kind in COLLECTIVES:
                for link, bandwidth in links.get(LINK_KEYS[kind], {}).items():
                    print(f"{kind:15} {link:8} {bandwidth / 1e9:10.3f} GB/s bus bandwidth")
            for link, rate in links.get(ADAM_TOGETHER, {}).items():
                print(f"Adam, together {link:8} {rate * 1e9:8.3f} ns per parameter on each rank")
            say_notes(*notes)
            print(f"written to {out}")
        dist.barrier()  # the others leave once the file is written
    finally:
        dist.destroy_process_group()
    return 0


def _main_links(
    device: torch.device, out: Path, budget_s: float, ranks_per_node: int | None, base_given: str | None
) -> int:
    """``links=true``: every rank measures its node's and its local index's groups (autotuner.measure.links);
    rank 0 fits them and writes the cluster file (autotuner.predict.cluster.measured_file)."""
    import platform
    from datetime import date

    from autotuner.measure.links import LEVEL_KINDS, measure_links
    from autotuner.predict.cluster import load as load_cluster
    from autotuner.predict.cluster import measured_file

    world = int(os.environ.get("WORLD_SIZE", 1))
    if world < 2:
        raise UserError(
            "links=true measures the links between processes: launch it with torchrun --nproc-per-node=N "
            "[--nnodes=M] -m autotuner.calibrate links=true (N*M >= 2)"
        )
    per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node:
        raise UserError(
            f"ranks_per_node={per_node} does not divide the job's {world} ranks: give a divisor of {world}"
        )
    base = load_cluster(base_given) if base_given else None
    nodes = world // per_node
    if per_node == 1 and base is None:
        raise UserError(
            f"{per_node} rank a node measures no link inside a node: give cluster=PRESET (e.g. dgx_h100) "
            "for it"
        )
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    _init_links(device)
    dist = torch.distributed
    try:
        kinds = LEVEL_KINDS
        notes = []
        if str(dist.get_backend()) == "gloo" and not gloo_has_sequence_parallel_collectives():
            kinds = ("all_reduce", "all_to_all", "send_recv")
            notes.append(
                f"gloo in torch {torch.__version__} lacks all_gather_into_tensor/reduce_scatter_tensor"
            )
        policy = SamplingPolicy(warmup=3, min_samples=5, budget_s=budget_s, target_rel_ci=0.05)
        measured = measure_links(device, per_node, COLLECTIVE_SIZES[device.type], policy, kinds)
        if dist.get_rank() == 0:
            where = {
                "host": platform.node(),
                "backend": str(dist.get_backend()),
                "date": date.today().isoformat(),
                "world": world,
                "device": device_name(device),
                "torch": torch.__version__,
            }
            try:
                data = measured_file(measured, per_node, nodes, where, base)
            except ValueError as exc:
                raise UserError(f"{exc}") from None
            atomic_write_text(out, json.dumps(data, indent=2) + "\n")
            for level, fits in data["measured"].items():
                for kind, fitted in fits.items():
                    print(
                        f"{level:10} {kind:15} over {fitted['ranks']:3} ranks: "
                        f"{fitted['bus_bandwidth'] / 1e9:10.3f} GB/s bus bandwidth, "
                        f"{fitted['latency'] * 1e6:8.1f} us latency (the fit within "
                        f"{fitted['worst_error']:.0%} of every size)"
                    )
            say_notes(*notes)
            print(f"written to {out}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


@dataclass(frozen=True)
class CalibrateSettings:
    device: str = setting("auto", "auto, cpu or cuda", "DEVICE")
    out: str | None = setting(
        None, "where to write the JSON (default runs/calibration/<device>.json)", "FILE"
    )
    collectives: bool = setting(
        False, "under torchrun: measure the links' collectives and merge them into the file", "BOOL"
    )
    links: bool = setting(
        False,
        "under torchrun: measure the links inside each node and between nodes, write a cluster file",
        "BOOL",
    )
    ranks_per_node: int | None = setting(
        None, "with links: the ranks a node holds (default torchrun's LOCAL_WORLD_SIZE)", "N"
    )
    cluster: str | None = setting(
        None, "with links: a preset or cluster file for the levels the job cannot measure", "NAME|FILE"
    )
    budget_s: float = setting(1.0, "sampling time per collective and size", "S")


COMMAND = Command(
    "autotuner-calibrate",
    "autotuner.calibrate",
    "Measure the device's ceilings (matmul FLOP/s, copy and zeroing bandwidth, caches, Adam, host links; "
    "under torchrun the collectives or a cluster's links) for the roofline and the predictor.",
    "",
    CalibrateSettings,
    least=0,
    most=0,
)


@ending_as_a_command("autotuner.calibrate")
@entry(COMMAND)
def main(argv: Sequence[str] | None = None) -> int:
    _, args, _ = parse(COMMAND, argv)
    try:
        device = resolve_device(args.device)
        if not 0 < args.budget_s <= 3600:  # a collective's sizes each take it: an hour is past any need
            raise UserError(
                f"budget_s={args.budget_s:g} must be above 0 and at most 3600: give e.g. budget_s=1"
            )
        if args.links:
            out = Path(args.out) if args.out else DEFAULT_DIR / "cluster.json"
            check_writable(out, f"out={out}")
            return _main_links(device, out, args.budget_s, args.ranks_per_node, args.cluster)
        if args.ranks_per_node is not None or args.cluster is not None:
            raise UserError("ranks_per_node and cluster go with links=true: add links=true, or drop them")
        out = Path(args.out) if args.out else default_path(device.type, device_name(device))
        check_writable(out, f"out={out}")  # before the minutes of measuring that it would lose
        if args.collectives:
            return _main_collectives(device, out, args.budget_s)
    except UserError as exc:
        say_error(COMMAND.name, exc)
        return 2
    result = calibrate(device)
    if device.type == "cpu":
        steps = minimal_model_steps()
        result[HOST_WORK] = host_work(steps)
        result[HOST_WORK_FLUSHED] = host_work(minimal_model_steps(flush_in_layers=True))
        result[ADAM_IN_STEP] = adam_in_step(steps, result)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")  # a run reading it sees all or nothing
    for dtype, flops in result["peak_flops"].items():
        print(f"matmul {dtype:5}  {flops / 1e12:10.4f} TFLOP/s")
    print(f"copy          {result['memory_bandwidth'] / 1e9:10.2f} GB/s")
    print(f"zeroing       {result[ZEROING_BANDWIDTH] / 1e9:10.2f} GB/s")
    print(
        f"caches        {human_bytes(result['warm_cache_bytes'])} a core's own, "
        f"{human_bytes(result['shared_cache_bytes'])} shared as kept "
        f"({human_bytes(result['shared_cache_bytes_reported'])} reported)"
    )
    print(f"Adam step     {result['adam_seconds_per_parameter'] * 1e9:10.3f} ns per parameter")
    print(f"Adam step     {result[ADAM_PER_TENSOR] * 1e6:10.3f} us per tensor")
    print(f"Adam step     {result[ADAM_ZERO_STATE] * 1e9:10.3f} ns more per parameter whose moments are zero")
    for dtype, rate in result[GRAD_ACCUMULATION].items():
        print(f"grad += {dtype:5} {rate * 1e12:10.3f} ps per parameter (into fp32)")
    for key, caches in ((HOST_WORK, ""), (HOST_WORK_FLUSHED, " (the caches flushed inside each layer)")):
        if key in result:
            work = {part: seconds * 1e3 for part, seconds in result[key].items()}
            print(
                f"host work     {work['forward']:10.3f} + {work['forward_per_layer']:.3f} per layer forward, "
                f"{work['backward']:.3f} + {work['backward_per_layer']:.3f} backward, ms per micro-batch"
                + caches
            )
    if ADAM_IN_STEP in result:
        print(f"Adam step     {result[ADAM_IN_STEP] * 1e6:10.3f} us more a step inside training steps")
    for key in ("h2d_pageable", "h2d_pinned", "d2h_pageable", "d2h_pinned"):
        if key in result:
            print(f"{key:13} {result[key] / 1e9:10.2f} GB/s")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
