"""The predictor, a model: pure functions from measured op rows, a layout and a calibration to a
training step's time and memory per GPU (``python -m autotuner.predict``). It runs nothing it predicts;
autotuner.validate runs the real steps to check it, and this package never imports that one.

Modules, one job each: ``layout`` (the layout, its Megatron-Core checks, Source/Figure provenance),
``inputs`` (the model's sizes, the runs' rows), ``op_time`` (an op's time at the layout's point),
``caches`` (which visits take warm rows and which flushed ones), ``timing`` (per-stage time, the step),
``schedule`` (the 1F1B and interleaved schedules, simulated), ``memory`` (per-GPU memory),
``prediction`` (the Prediction, its JSON and table), ``links`` (collectives from the calibrated link
bandwidth), ``cluster`` and ``collectives`` (a cluster's links and a collective's time on it),
``overlap`` and ``communication`` (Megatron's overlaps of communication with compute, and where they
fall), ``megatron_formulas`` (Megatron-LM's FLOPs and parameter counts), ``layouts`` (the layouts
Megatron-Core accepts), ``plan`` (the profiling runs that would measure what is missing), ``__main__``
(the command).
"""

from autotuner.predict.layout import Figure, Layout, Source

__all__ = ["Figure", "Layout", "Source"]
