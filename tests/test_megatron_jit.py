"""Megatron's jit_fuser applied at first call (autotuner.megatron_jit), in a fresh process each: the import
of Megatron no longer sets up torch.compile, and a fused function still runs compiled, with the values of
Megatron's own unfused formula."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys
import autotuner
import torch
from megatron.core.fusions import fused_bias_gelu
from megatron.core.transformer.transformer_layer import TransformerLayer
assert "torch._dynamo" not in sys.modules, "Megatron's import set up torch.compile"
bias, y = torch.randn(8), torch.randn(4, 8)
fused = fused_bias_gelu.bias_gelu(bias, y)
assert "torch._dynamo" in sys.modules, "the fused function did not run compiled"
x = bias + y
unfused = x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
torch.testing.assert_close(fused, unfused)
print("ok")
"""


@pytest.mark.slow
def test_megatron_s_fused_functions_are_compiled_at_their_first_call_not_at_import():
    probe = [sys.executable, "-c", PROBE]
    done = subprocess.run(probe, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
