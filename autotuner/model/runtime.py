"""The process around the ops: device and dtype, torch.distributed and Megatron's parallel state, seeds,
and the environment record that makes a run reproducible."""

from __future__ import annotations

import functools
import os
import platform
import socket
import sys
import warnings
from datetime import timedelta
from importlib import metadata
from typing import Any

import torch

from autotuner.errors import UserError
from autotuner.model.host_heap import host_heap

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA where there is a GPU, else CPU; asking for CUDA without one is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but torch sees no CUDA device: use device=cpu or device=auto")
    if device not in ("cpu", "cuda"):
        raise UserError(f"unknown device {device!r}: use auto, cpu or cuda")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """``auto`` is bf16 on a GPU and fp32 on a CPU (CPU bf16 matrix products are ~250x slower)."""
    if dtype == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}: use auto, fp32, bf16 or fp16")
    return dtype


def quiet_megatron_import() -> None:
    """Import Megatron-Core once, and silence the warnings it raises about optional packages we do not
    use (Transformer Engine, Apex) and about config defaults it deprecates, for the whole process."""
    for pattern in (".*Transformer Engine.*", ".*[Aa]pex.*", ".*scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern)
    # torch's renaming of the collectives Megatron calls under sequence and expert parallelism
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings("ignore", message=f".*{name}` is deprecated.*", category=FutureWarning)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        import megatron.core  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401


def process_rank() -> tuple[int, int]:
    """(rank, world size) of this process, from the environment its launcher set (torchrun sets RANK and
    WORLD_SIZE; (0, 1) alone). Read once per run, into the RunSpec (autotuner.runner.spec.resolve_spec): code
    that has a spec reads ``spec.rank``/``spec.world``; this is for code that runs before there is one."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_parallel(
    device: torch.device,
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
    pipeline_parallel: int = 1,
    virtual_pipeline: int | None = None,
) -> tuple[int, int]:
    """Start torch.distributed (from torchrun's environment, or a one-process group) and Megatron's
    parallel state. Returns (rank, world_size). Idempotent.

    The processes form the tensor-parallel groups (attention and dense MLP) and, for the experts, groups
    of ``expert_tensor_parallel`` (ETP, default: the TP size, as in Megatron) times ``expert_parallel``
    (EP) ranks over the same processes: each of TP and ETP x EP must divide the world (Megatron makes the
    rest data-parallel). autotuner.runner.spec.resolve_spec settles ETP and checks these before anything
    starts; the check here covers callers without a spec. ``pipeline_parallel`` stages (PP), each of
    ``virtual_pipeline`` model chunks for the interleaved schedule, are for autotuner.validate.steps,
    which runs Megatron's pipeline schedules: TP x PP must divide the world."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from autotuner.model import emulation

    if dist.is_initialized() and dist.get_backend() == emulation.BACKEND:
        emulation.stop()  # an emulated rank's session before this one's (a sweep's earlier job)
    if not dist.is_initialized():
        # Where CUDA exists, CPU tensors' collectives go to gloo and CUDA tensors' to NCCL, so a CPU run on
        # a GPU machine (and a CPU run after a CUDA one in the same process) finds a backend for its tensors.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if "WORLD_SIZE" in os.environ:
            if device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            # A rank that never arrives, or dies inside a collective, fails the others after this long
            # (AUTOTUNER_DIST_TIMEOUT_S, default 10 minutes) instead of torch's 30 minutes.
            timeout_s = float(os.environ.get("AUTOTUNER_DIST_TIMEOUT_S", 600))
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", world_size=1, rank=0
            )
    world = dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel):
        raise UserError(
            f"tensor_model_parallel_size={tensor_parallel} x pipeline_model_parallel_size={pipeline_parallel}"
            f" does not divide the {world} processes: launch as many processes as TP x PP "
            "(torchrun --nproc-per-node=N)"
        )
    check_expert_parallel(world, expert_parallel, expert_tensor_parallel or tensor_parallel)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            virtual_pipeline_model_parallel_size=virtual_pipeline,
            expert_model_parallel_size=expert_parallel,
            expert_tensor_parallel_size=expert_tensor_parallel,
        )
    return dist.get_rank(), world


def end_model_parallel() -> None:
    """Megatron's parallel state gone with the process groups it made (each a gloo group with its own
    threads, which Megatron's own teardown leaves registered: a process that starts and ends many
    sessions, a dry run's for each case, would gather thousands of threads). The world group stays."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)


def check_expert_parallel(world: int, expert_parallel: int, expert_tensor_parallel: int) -> None:
    """UserError (one line) unless ``world`` processes can hold EP x ETP expert ranks."""
    if expert_parallel < 1 or expert_tensor_parallel < 1:
        raise UserError(
            f"expert_model_parallel_size={expert_parallel} and expert_tensor_parallel_size="
            f"{expert_tensor_parallel} must be at least 1: fix tf.expert_model_parallel_size"
        )
    ranks = expert_parallel * expert_tensor_parallel
    if world % ranks:
        raise UserError(
            f"expert_model_parallel_size={expert_parallel} x expert_tensor_parallel_size="
            f"{expert_tensor_parallel} needs a multiple of {ranks} processes, this job has {world}: "
            f"launch with torchrun --nproc-per-node={ranks}"
        )


@functools.cache
def gloo_has_sequence_parallel_collectives() -> bool:
    """Whether this torch's gloo backend runs the collectives sequence parallelism uses (Megatron's
    ``reduce_scatter_tensor`` and ``all_gather_into_tensor``, the backend's ``_reduce_scatter_base`` and
    ``_allgather_base``). Probed on a private one-process gloo group, not the run's (which does not
    exist yet when the config is checked): exact for the installed torch where a version table would
    have to guess, and the default group is left untouched. Older torch raised "does not support"."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return False
    try:
        group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
        source, out = torch.ones(2), torch.empty(2)
        group._reduce_scatter_base(out, source).wait()
        group._allgather_base(out, source).wait()
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def seed_everything(seed: int, device: torch.device) -> None:
    """Seed the CPU generator and, on a GPU, Megatron's model-parallel CUDA RNG tracker.

    On a GPU the tracker is the graph-safe one where torch supports it: its states are generators that a
    CUDA graph can register (:func:`graph_rng_generators`), so an op that forks the tracker (attention
    dropout) can be captured (autotuner.measure.graphs); the other tracker sets the generator's seed
    inside the op, which a capture refuses. Both draw the same numbers for the same seed.
    """
    torch.manual_seed(seed)
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        graph_safe = hasattr(torch.cuda.CUDAGraph, "register_generator_state") and hasattr(
            torch.Generator, "graphsafe_set_state"
        )
        # force_reset: a CPU run earlier in this process may have installed the no-op tracker (cpu_bridges)
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, use_cudagraphable_rng=graph_safe, force_reset_rng=True
        )


def graph_rng_generators() -> list[torch.Generator]:
    """The generators a CUDA graph must register besides the default one: the graph-safe model-parallel
    tracker's states, when Megatron is loaded and its tracker is the graph-safe one (else none)."""
    if "megatron.core" not in sys.modules:  # a functional-only run never imports Megatron
        return []
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    if not getattr(tracker, "use_cudagraphable_rng", False):
        return []
    return [s for s in tracker.get_states().values() if isinstance(s, torch.Generator)]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def source_revision() -> str | None:
    """The git revision of the autotuner source this process runs (``git describe --always --dirty``:
    the commit, with ``-dirty`` when the tree has uncommitted changes), None outside a git checkout (an
    installed wheel: its version says it). What a row measured means can change between revisions (a
    meter's rule), so a run records which one measured it."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    revision = done.stdout.strip()
    return revision if done.returncode == 0 and revision else None


def environment(device: torch.device, tools: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """What a reader needs to reproduce a run: versions, device, threads, host and command line.

    ``tools``: the programs the run started, by name, as (absolute path, version line); each gives the
    fields ``<name>_path`` and ``<name>_version`` (the nsys launcher: ``nsys_path``, ``nsys_version``).
    """
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "command": [sys.executable, *sys.argv],
        "autotuner": _version("autotuner"),
        "autotuner_revision": source_revision(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "megatron_core": _version("megatron-core"),
        "transformers": _version("transformers"),
        "hydra_core": _version("hydra-core"),
        "transformer_engine": _version("transformer-engine") or _version("transformer_engine"),
        "nvtx": _version("nvtx"),
        "device_type": device.type,
        "num_threads": torch.get_num_threads(),
        "host_heap": host_heap(),
    }
    info["device_name"] = device_name(device)
    if device.type == "cuda":
        info["device_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    for name, (path, version) in (tools or {}).items():
        info[f"{name}_path"], info[f"{name}_version"] = path, version
    return info


def device_name(device: torch.device) -> str:
    """The device's model name (a GPU's, or the CPU's from /proc/cpuinfo). A bare ``cuda`` is this rank's
    GPU (``LOCAL_RANK``): before the session sets the device it would otherwise be GPU 0."""
    if device.type == "cuda":
        index = device.index if device.index is not None else int(os.environ.get("LOCAL_RANK", 0))
        return torch.cuda.get_device_name(index)
    return _cpu_name()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"
