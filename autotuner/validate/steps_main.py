"""The process that measures a layout's real training steps (``python -m autotuner.validate.steps_main``,
under torchrun where the layout has several ranks) and writes them as JSON: the command line of
:mod:`autotuner.validate.steps`, which autotuner-validate and autotuner-calibrate start."""

from __future__ import annotations

import json
import os
import sys

from autotuner.errors import UserError, say_error
from autotuner.results.atomic import atomic_write_text
from autotuner.validate.steps import measure_steps, parse_args, steps_command

USAGE = (
    "usage: python -m autotuner.validate.steps_main layout.seq_len=N out=FILE.json [case=tiny] [layout.tp=N] "
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
