"""The recorder: what a training run calls, with which shapes, how often.

Three taps, installed by :func:`capture` and removed when it ends (also on error):

* every ``nn.Module`` call, through torch's *global* module hooks. A pre-hook keeps the stack of running
  modules (so a function call knows the module it runs in); the post-hook records the call. The record
  is taken in the post-hook because only it receives keyword arguments: Megatron calls its layers as
  ``layer(hidden_states=x, ...)``, which a global pre-hook would see as no arguments at all.
* a configured set of ``torch.nn.functional`` (or ``torch``) functions and ``torch.Tensor`` methods,
  replaced by wrappers at run time. Only attribute look-ups see the wrapper: code that did
  ``from torch.nn.functional import silu`` before capturing keeps the original, and ``a @ b`` does not go
  through ``Tensor.matmul``.
* a global optimizer step post-hook that counts steps, for the step window.

Gotchas:
* A wrapped function called inside another wrapped call (``F.softmax`` calls ``Tensor.softmax``) is part
  of the outer call and is not recorded again; a thread-local flag also keeps the recorder's own tensor
  inspection from recording itself.
* Only the first optimizer that steps counts steps (a second one, a GAN's discriminator say, would count
  every step twice).
* ``torch.compile`` runs the code it wraps eagerly while the recorder is installed
  (:func:`_compile_eagerly`), so a compiled model's calls are recorded as the eager model's, under the
  same names (the ``OptimizedModule`` wrapper is passed over), and the capture's settings say so; the
  captured steps run at eager speed, and the run compiles once the window has passed.
* Once the window has passed, the taps are removed at once, so the rest of the run pays nothing.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections.abc import Hashable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from autotuner.capture import schema
from autotuner.capture.values import base_class, encode, module_attrs, qualified_name, signature

DEFAULT_FUNCTIONS = (
    "linear",
    "scaled_dot_product_attention",
    "layer_norm",
    "rms_norm",
    "silu",
    "gelu",
    "softmax",
    "dropout",
    "embedding",
    "cross_entropy",
)
DEFAULT_METHODS = ("matmul", "softmax")
_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)
_COMPILE_WITH_HOOKS = r"Using `torch.compile\(module\)` when there are global hooks"
# What the capture's settings say of a torch.compile'd model recorded (see _compile_eagerly).
EAGER_NOTE = "ran eagerly while capturing: the calls are those its compiled graphs compute"


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.busy = False  # inside a recorded call or the recorder itself
        self.stack: list[_ModuleInfo] = []


class _ModuleInfo:
    """What is recorded about a module instance, computed at its first call (from each caller, for a
    module no root holds)."""

    __slots__ = ("ident", "path", "callee", "base", "attrs", "children")

    def __init__(self, module: nn.Module, path: str, held: bool) -> None:
        self.ident = id(module)  # compared only while the module runs (so is alive): never a reused id
        self.path = path
        self.callee = qualified_name(type(module))
        self.base = base_class(type(module))
        self.attrs = module_attrs(module)
        # The names of a free module's children, which no root's index holds either.
        self.children = {} if held else {id(m): name for name, m in module.named_children()}


class _Record:
    __slots__ = ("kind", "callee", "base", "path", "args", "kwargs", "attrs", "training", "grad", "count")

    def __init__(self, kind: str, callee: str, path: str, args: Any, kwargs: Any, grad: bool) -> None:
        self.kind, self.callee, self.path, self.grad = kind, callee, path, grad
        self.args = [encode(a) for a in args]
        self.kwargs = {str(k): encode(v) for k, v in kwargs.items()}
        self.base: str | None = None
        self.attrs: dict[str, Any] = {}
        self.training: bool | None = None
        self.count = 0


class Recorder:
    """Records calls while installed and inside the step window; :meth:`to_json` gives the capture."""

    def __init__(
        self,
        steps: tuple[int, int] | None = None,
        functions: Sequence[str] = DEFAULT_FUNCTIONS,
        methods: Sequence[str] = DEFAULT_METHODS,
    ) -> None:
        if steps is not None and not (0 <= steps[0] < steps[1]):
            raise ValueError(f"steps must be (start, stop) with 0 <= start < stop, got {steps}")
        self.steps = None if steps is None else (int(steps[0]), int(steps[1]))
        self.functions, self.methods = tuple(functions), tuple(methods)
        self.steps_seen = 0
        self.active = steps is None or steps[0] == 0
        self._state = _ThreadState()
        self._records: dict[Hashable, _Record] = {}
        self._infos: weakref.WeakKeyDictionary[nn.Module, _ModuleInfo] = weakref.WeakKeyDictionary()
        self._paths: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._free: weakref.WeakKeyDictionary[nn.Module, dict[str, _ModuleInfo]] = weakref.WeakKeyDictionary()
        self._patched: list[tuple[Any, str, Any, bool]] = []
        self._hooks: list[Any] = []
        self._step_hook: Any = None
        self._optimizer: weakref.ref[Any] | None = None
        self._eager: Any = None  # undoes _compile_eagerly
        self._filter: Any = None  # the warnings filter install adds
        self.compiled_seen = False  # a torch.compile'd module ran (eagerly) while recording

    # --- installing ------------------------------------------------------------------------------
    def install(self) -> None:
        """Wrap the functions and methods and register the hooks. Unknown names raise ValueError."""
        targets = resolve_targets(self.functions, self.methods)
        try:
            for owner, name, callee, kind in targets:
                original = getattr(owner, name)
                self._patched.append((owner, name, original, name in vars(owner)))
                setattr(owner, name, self._wrap(original, kind, callee))
            modules = nn.modules.module
            self._hooks.append(modules.register_module_forward_pre_hook(self._pre_hook))
            self._hooks.append(
                modules.register_module_forward_hook(self._post_hook, with_kwargs=True, always_call=True)
            )
            self._step_hook = register_optimizer_step_post_hook(self._on_step)
            self._eager = _compile_eagerly()
            # torch warns that global hooks fire an extra time for torch.compile's wrapper: ours pass it over
            warnings.filterwarnings("ignore", message=_COMPILE_WITH_HOOKS)
            self._filter = warnings.filters[0]
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self, keep_step_hook: bool = False) -> None:
        """Restore every original and remove the hooks. Safe to call twice."""
        while self._patched:
            owner, name, original, owned = self._patched.pop()
            if owned:
                setattr(owner, name, original)
            else:  # the attribute came from a base class (Tensor methods live on TensorBase): unshadow it
                delattr(owner, name)
        while self._hooks:
            self._hooks.pop().remove()
        if self._eager is not None:
            self._eager()
            self._eager = None
        if self._filter in warnings.filters:
            warnings.filters.remove(self._filter)
        if not keep_step_hook and self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    # --- the taps --------------------------------------------------------------------------------
    def _wrap(self, original: Any, kind: str, callee: str) -> Any:
        state = self._state

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.active or state.busy or _is_compiling():
                return original(*args, **kwargs)
            state.busy = True  # until the original returns: calls it makes are part of this one
            try:
                stack = state.stack
                self._record(kind, callee, stack[-1].path if stack else "", args, kwargs)
                return original(*args, **kwargs)
            finally:
                state.busy = False

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__name__ = getattr(original, "__name__", "wrapper")
        wrapper.__doc__ = getattr(original, "__doc__", None)
        return wrapper

    def _record(
        self,
        kind: str,
        callee: str,
        path: str,
        args: Any,
        kwargs: Any,
        info: _ModuleInfo | None = None,
        training: bool | None = None,
    ) -> None:
        grad = torch.is_grad_enabled()
        key = (callee, path, grad, training, signature(args), signature(kwargs))
        record = self._records.get(key)
        if record is None:
            record = _Record(kind, callee, path, args, kwargs, grad)
            if info is not None:
                record.base, record.attrs, record.training = info.base, info.attrs, training
            self._records[key] = record
        record.count += 1

    def _info(self, module: nn.Module) -> _ModuleInfo:
        """The module's name and attributes: its place in a root, or else the place it is called from.

        A module called while no module runs is a root (the model): it and every module it holds get
        one name each, their place in it. A module no root holds is *free*, and may be one instance
        that many callers share: transformers 5.25 makes ``apply_rotary_pos_emb`` a single global
        ``nn.Module`` that every attention layer calls. A free module is named after its caller, each
        time (``<caller>.<attribute>`` for a child of a free caller, ``<caller>.~<Class>`` otherwise),
        so that its calls from two layers stay two records rather than one at the first caller's name.
        """
        info = self._infos.get(module)
        if info is not None:
            return info
        state = self._state
        busy, state.busy = state.busy, True  # reading attributes must not record anything
        try:
            caller = state.stack[-1] if state.stack else None
            if caller is None:
                for name, sub in module.named_modules():
                    self._paths.setdefault(sub, name)
            path = self._paths.get(module)
            if path is not None:
                info = self._infos[module] = _ModuleInfo(module, path, held=True)
            else:
                assert caller is not None  # a root was just indexed
                name = caller.children.get(id(module)) or f"~{type(module).__name__}"
                path = f"{caller.path}.{name}".lstrip(".")
                by_caller = self._free.setdefault(module, {})
                info = by_caller.get(path)
                if info is None:
                    info = by_caller[path] = _ModuleInfo(module, path, held=False)
        finally:
            state.busy = busy
        return info

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        if _compiled_wrapper(module):
            self.compiled_seen = True
        else:
            self._state.stack.append(self._info(module))

    def _post_hook(self, module: nn.Module, args: Any, *rest: Any) -> None:
        # With with_kwargs the hook gets (kwargs, output); after an exception in forward torch calls it
        # without kwargs, (output,) only: the stack is unwound, nothing is recorded.
        if _compiled_wrapper(module):
            return
        state = self._state
        stack = state.stack
        info: _ModuleInfo | None = None
        # Frames above this module's are forwards that never returned (KeyboardInterrupt skips this hook).
        while stack:
            frame = stack.pop()
            if frame.ident == id(module):
                info = frame
                break
        if info is None or len(rest) != 2 or not self.active or state.busy or _is_compiling():
            return
        state.busy = True
        try:
            self._record("module", info.callee, info.path, args, rest[0], info, module.training)
        finally:
            state.busy = False

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._optimizer is None:
            self._optimizer = weakref.ref(optimizer)
        elif self._optimizer() is not optimizer:
            return
        self.steps_seen += 1
        if self.steps is not None:
            self.active = self.steps[0] <= self.steps_seen < self.steps[1]
            if self.steps_seen >= self.steps[1]:
                # Window passed: drop the overhead now. The step hook stays until the end (torch is
                # iterating over the step hooks while this one runs; removing it here would break that).
                self.uninstall(keep_step_hook=True)

    # --- the result ------------------------------------------------------------------------------
    @property
    def steps_captured(self) -> int:
        if self.steps is None:
            return self.steps_seen
        return max(0, min(self.steps_seen, self.steps[1]) - self.steps[0])

    def records(self) -> list[schema.CallRecord]:
        """The distinct calls so far, most frequent first."""
        found = [
            schema.CallRecord(
                kind=r.kind,
                callee=r.callee,
                path=r.path,
                args=r.args,
                kwargs=r.kwargs,
                count=r.count,
                grad_enabled=r.grad,
                base=r.base,
                attrs=r.attrs,
                training=r.training,
            )
            for r in list(self._records.values())
            if r.count > 0
        ]
        return sorted(found, key=lambda c: -c.count)

    def to_json(self, status: str = "complete", error: str | None = None) -> dict[str, Any]:
        from autotuner.model.runtime import environment

        calls = self.records()
        on_cuda = any("cuda" in a.get("tensor", {}).get("device", "") for c in calls for a in c.args)
        return {
            "format": schema.FORMAT,
            "version": schema.VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": list(sys.argv),
            "environment": environment(torch.device("cuda" if on_cuda else "cpu")),
            "settings": {
                "steps": list(self.steps) if self.steps else None,
                "functions": list(self.functions),
                "methods": list(self.methods),
                **({"torch_compile": EAGER_NOTE} if self.compiled_seen else {}),
            },
            "steps": {"seen": self.steps_seen, "captured": self.steps_captured},
            "status": status,
            "error": error,
            "calls": [c.to_json() for c in calls],
        }

    def write(self, out: str | Path, status: str = "complete", error: str | None = None) -> None:
        schema.dump(self.to_json(status, error), out)


def _compiled_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns (an ``OptimizedModule``): its
    call is its ``_orig_mod``'s, which is recorded (named as without the wrapper), not the wrapper's."""
    kind = type(module)
    return kind.__name__ == "OptimizedModule" and kind.__module__.startswith("torch._dynamo")


def _compile_eagerly() -> Any:
    """Have ``torch.compile`` run the code it wraps eagerly (its ``force_eager`` stance) until the
    returned call undoes it. Dynamo would trace into the global module hooks, which run inside every
    module call it traces, and fail on the recorder's state ("already tracked for mutation"), so that
    nothing was recorded; eagerly, the calls are recorded as the model makes them without compiling."""
    if hasattr(torch.compiler, "set_stance"):  # torch 2.6 and later
        torch.compiler.set_stance("force_eager")
        return lambda: torch.compiler.set_stance("default")
    from torch._dynamo import config

    before, config.disable = config.disable, True  # torch.compile calls from now on: no-ops
    return lambda: setattr(config, "disable", before)


def resolve_targets(functions: Sequence[str], methods: Sequence[str]) -> list[tuple[Any, str, str, str]]:
    """(owner, attribute, qualified name, kind) of each function and method to wrap; ValueError names
    one that does not exist."""
    targets = [(*_function_owner(name), "function") for name in functions]
    targets += [(torch.Tensor, name, f"torch.Tensor.{name}", "method") for name in methods]
    for owner, name, callee, _ in targets:
        if not callable(getattr(owner, name, None)):
            raise ValueError(f"cannot capture {callee}: torch has no such function or method")
    return targets


def _function_owner(name: str) -> tuple[Any, str, str]:
    """``linear`` -> torch.nn.functional.linear; ``torch.bmm`` -> torch.bmm (only the torch namespace)."""
    if "." not in name:
        return torch.nn.functional, name, f"torch.nn.functional.{name}"
    owner_name, _, attr = name.rpartition(".")
    owners = {"torch": torch, "torch.nn.functional": torch.nn.functional, "F": torch.nn.functional}
    if owner_name not in owners:
        raise ValueError(f"cannot capture {name!r}: give a torch.nn.functional name or torch.<name>")
    owner = owners[owner_name]
    return owner, attr, f"{owner.__name__}.{attr}"
