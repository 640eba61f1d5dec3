"""Predict a training layout's step time and memory from measured op rows: ``python -m autotuner.predict``.

Modules, one job each: ``layout`` (the layout, its Megatron-Core checks, Source/Figure provenance),
``inputs`` (the model's sizes, the runs' rows), ``op_time`` (an op's time at the layout's point from
rows, the scaling rules), ``caches`` (which visits take warm rows and which flushed ones), ``timing``
(per-stage forward/backward time, host work, the step), ``schedule`` (the 1F1B and interleaved
schedules, simulated), ``memory`` (per-GPU memory beside Korthikanti et al.'s closed form),
``prediction`` (the record, its JSON and table), ``links`` (collective times from the calibrated link
bandwidth), ``cluster`` (a cluster's links: files, presets, the fit of measured ones), ``collectives``
(a collective's time from where its group lies on a cluster), ``overlap`` (Megatron's overlaps of
communication with compute, as pure rules), ``communication`` (those rules placed in the stages and the
schedule), ``megatron_formulas`` (Megatron-LM's FLOPs and parameter counts), ``layouts`` (the layouts
Megatron-Core accepts), ``plan`` (the profiling runs that would
measure what is missing), ``steps`` (real steps, timed, to check predictions; their model, data and
optimizer in ``stage_trainer``, their gradients in ``grad_buffers``, their measurement as data in
``step_measurement``), ``in_step`` (the ops' times inside those steps), ``validate`` (prediction
against steps), ``settings`` (the key=value command line it shares with autotuner.tune), ``__main__``
(the CLI).
"""

from autotuner.predict.layout import Figure, Layout, Source

__all__ = ["Figure", "Layout", "Source"]
