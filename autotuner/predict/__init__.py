"""Predict a training layout's step time and memory from measured op rows: ``python -m autotuner.predict``.

Modules, one job each: ``layout`` (the layout, its Megatron-Core checks, Source/Figure provenance),
``inputs`` (the model's sizes, the runs' rows), ``timing`` (per-stage forward/backward time from rows,
the scaling rules, the 1F1B step), ``memory`` (per-GPU memory beside Korthikanti et al.'s closed form),
``prediction`` (the record, its JSON and table), ``links`` (collective times from the calibrated link
bandwidth), ``layouts`` (the layouts Megatron-Core accepts), ``plan`` (the profiling runs that would
measure what is missing), ``steps`` (real steps, to check predictions), ``__main__`` (the CLI).
"""

from autotuner.predict.layout import Figure, Layout, Source

__all__ = ["Figure", "Layout", "Source"]
