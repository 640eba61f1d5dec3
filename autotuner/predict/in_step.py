"""The ops' times inside the real training step, by module hooks: where a step-time error sits.

The predictor sums op rows, each timed alone; autotuner.predict.steps runs the whole step. When the two
disagree, the step's own per-op times say which op or which cost between ops is missing. ``ModuleClock``
hooks each model chunk of a rank (Megatron's GPTModel) while its training steps run:

* a module's forward: from its forward pre-hook to its forward hook;
* its backward: from the moment the gradient of its output arrives (a tensor hook on the output) to the
  moment the gradient of its input is complete (a tensor hook on the input: autograd calls it once, after
  every use of the input inside the module, the residual branch too, has added its part). What the
  module's backward does to its parameters in between is inside: the weight gradients and, in a step,
  their accumulation into the kept fp32 gradients (Megatron's DDP hook), which an op row does not hold;
* the stage's forward per micro-batch: the chunk's forward, the loss included on the last stage.

The modules: the embedding (forward only: its input, token ids, has no gradient to mark its backward's
end), every decoder layer (``transformer_layer``), the final norm, and the output layer with the loss
after it, as the op row ``output_layer`` times them (its forward ends when GPTModel's
``compute_language_model_loss`` returns, its backward starts when the per-token loss's gradient arrives).
A mark is ``time.perf_counter`` on a CPU and a recorded CUDA event on a GPU, so a GPU's span is device
time between the two points of its stream, read after the step's synchronize; the host cost of a hook is
a few microseconds, below the noise of the millisecond ops it times.

Only a step without activation recompute is timed: a recomputed forward fires the forward hooks a second
time inside the backward. A step with it records nothing (the validation says so).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from typing import Any

# What a rank reports, in this order (a fixed list, so that ranks can exchange it as numbers): the
# median seconds per visit over the timed steps, NaN where the rank has no such module or phase.
IN_STEP_KEYS = (
    "embedding.forward",
    "transformer_layer.forward",
    "transformer_layer.backward",
    "final_layernorm.forward",
    "final_layernorm.backward",
    "output_layer.forward",
    "output_layer.backward",
    "stage.forward",
)


class ModuleClock:
    """Hooks on one rank's model chunks; ``recording`` on for the timed steps only; :meth:`collect` after
    each timed step's synchronize; :meth:`medians` at the end."""

    def __init__(self, chunks: list[Any], device: Any) -> None:
        import torch

        self._torch = torch
        self._cuda = device.type == "cuda"
        self.recording = False
        self._open: list[tuple[str, Any, Any]] = []  # (key, start mark, end mark) not yet read
        self._spans: dict[str, list[float]] = defaultdict(list)
        for chunk in chunks:
            model = getattr(chunk, "module", chunk)  # past a DDP-style wrapper
            if getattr(model, "pre_process", False):
                self._hook(model.embedding, "embedding", backward=False)
            for layer in model.decoder.layers:
                self._hook(layer, "transformer_layer")
            if getattr(model, "post_process", False):
                if getattr(model.decoder, "final_layernorm", None) is not None:
                    self._hook(model.decoder.final_layernorm, "final_layernorm")
                self._hook_head(model)
            self._hook(model, "stage", backward=False)

    def _mark(self) -> Any:
        if self._cuda:
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _span(self, key: str, start: Any) -> None:
        self._open.append((key, start, self._mark()))

    def _hook(self, module: Any, name: str, backward: bool = True) -> None:
        torch = self._torch
        started: dict[str, Any] = {}  # this module's open forward, then its open backward

        def before(_module: Any, args: tuple, kwargs: dict) -> None:
            if not self.recording:
                return
            started["forward"] = self._mark()
            if not backward:
                return
            given = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
            if torch.is_tensor(given) and given.requires_grad:
                given.register_hook(lambda _grad: self._end_backward(name, started))

        def after(_module: Any, _args: tuple, _kwargs: dict, output: Any) -> None:
            if not self.recording or "forward" not in started:
                return
            self._span(f"{name}.forward", started.pop("forward"))
            out = output[0] if isinstance(output, tuple) else output
            if backward and torch.is_tensor(out) and out.requires_grad:
                out.register_hook(lambda _grad: started.__setitem__("backward", self._mark()))

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True)

    def _hook_head(self, model: Any) -> None:
        """The output layer and the loss after it, as one op (the row ``output_layer``)."""
        torch = self._torch
        started: dict[str, Any] = {}
        loss_of = model.compute_language_model_loss  # bound method; GPTModel calls it by attribute

        def before(_module: Any, args: tuple, kwargs: dict) -> None:
            if not self.recording:
                return
            started["forward"] = self._mark()
            given = args[0] if args else kwargs.get("input_")
            if torch.is_tensor(given) and given.requires_grad:
                given.register_hook(lambda _grad: self._end_backward("output_layer", started))

        def loss(*args: Any, **kwargs: Any) -> Any:
            per_token = loss_of(*args, **kwargs)
            if self.recording and "forward" in started:
                self._span("output_layer.forward", started.pop("forward"))
                if torch.is_tensor(per_token) and per_token.requires_grad:
                    per_token.register_hook(lambda _grad: started.__setitem__("backward", self._mark()))
            return per_token

        model.output_layer.register_forward_pre_hook(before, with_kwargs=True)
        model.compute_language_model_loss = loss

    def _end_backward(self, name: str, started: dict[str, Any]) -> None:
        if "backward" in started:
            self._span(f"{name}.backward", started.pop("backward"))

    def collect(self) -> None:
        """Read the spans marked since the last call (on a GPU: after the device was synchronized)."""
        for key, start, end in self._open:
            self._spans[key].append(start.elapsed_time(end) / 1e3 if self._cuda else end - start)
        self._open.clear()

    def medians(self) -> tuple[float, ...]:
        """Per IN_STEP_KEYS, the median seconds per visit (NaN where nothing was timed)."""
        return tuple(
            statistics.median(self._spans[key]) if self._spans.get(key) else math.nan for key in IN_STEP_KEYS
        )
