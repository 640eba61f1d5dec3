"""Run by tests/test_parallel.py, once with TP=1 (one process) and once under torchrun with TP=2.

Builds case=tiny at the given TP size, runs the forward of each op on the same full-size inputs and
saves every rank-0 output (column-parallel outputs gathered along their last dimension) to OUT.
Usage: python tests/tp_reference.py OUT TP
"""

from __future__ import annotations

import sys

import torch

from autotuner.config import compose_config
from autotuner.ops_test.base import ShapePoint
from autotuner.runner.spec import open_session, resolve_spec

OPS = ["linear_qkv", "self_attention", "mlp", "transformer_layer"]
GATHERED = {"linear_qkv"}  # column-parallel: each rank holds a slice of the last dimension


def main(out: str, tp: int) -> None:
    spec = resolve_spec(
        compose_config(
            ["case=tiny", "device=cpu", f"tf.tensor_model_parallel_size={tp}", f"ops=[{','.join(OPS)}]"]
        )
    )
    _, ctx = open_session(spec)
    point = ShapePoint(16, 2)
    outputs = {}
    for test in spec.ops:
        call = test.build(ctx, point)
        with torch.no_grad():
            result = call.fn(*call.inputs)
        tensor = result[0] if isinstance(result, tuple) else result
        if test.name in GATHERED and tp > 1:
            parts = [torch.empty_like(tensor) for _ in range(tp)]
            torch.distributed.all_gather(parts, tensor.contiguous())
            tensor = torch.cat(parts, dim=-1)
        outputs[test.name] = tensor.detach().clone()
    if torch.distributed.get_rank() == 0:
        torch.save(outputs, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
