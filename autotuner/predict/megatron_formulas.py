"""Megatron-LM's own formulas, as its training loop computes them, to state a prediction in Megatron's terms.

* :func:`megatron_flops_per_step`: ``num_floating_point_operations`` of megatron/training/training.py as it
  stood when Megatron-LM published its H100 weak-scaling runs (commit f2e5db402c, 2024-07-15), the figure
  behind their per-GPU TFLOP/s: ``12 B s L h^2 ((1 + g/a + s/h) q/h + f/h k m + V/(2 L h))`` for a global
  batch of B sequences of s tokens, L layers of hidden h, a heads of which g key-value groups, q =
  heads x head_dim, an MLP of width f (m = 3/2 gated, else 1; k experts a token, 1 dense) and the padded
  vocabulary V. It counts the attention square whole (no causal halving: Megatron-LM halves it from
  2026) and three passes of every GEMM (forward, data and weight gradients).
* :func:`megatron_shard_parameters`: ``compute_weight_and_optimizer_memory``'s count of the most loaded
  model shard at the same commit: ``2 L h^2 ((1 + g/a) q/h + f/h E m + 2/h + 1/(L h))`` in the layers (E
  experts; the layer norms' 2/h as weights alone), ``h V`` a table, over pp and tp as Megatron divides them.
"""

from __future__ import annotations

import math

from autotuner.predict.inputs import ModelShape
from autotuner.predict.layout import Layout

# Megatron-LM's --make-vocab-size-divisible-by default: the vocabulary is padded to a multiple of it x tp.
VOCAB_DIVISOR = 128


def padded_vocab(vocab: int, tp: int) -> int:
    """Megatron-LM's padded vocabulary: the next multiple of 128 x tp."""
    step = VOCAB_DIVISOR * tp
    return math.ceil(vocab / step) * step


def _gated(model: ModelShape) -> float:
    return 1.5 if model.config.get("gated_linear_unit") else 1.0


def megatron_flops_per_step(model: ModelShape, layout: Layout) -> float:
    """FLOPs of one step of ``layout``'s global batch by Megatron-LM's formula (module docstring)."""
    batch, s, layers, h = layout.global_batch_size, layout.seq_len, model.num_layers, model.hidden
    query = model.kv_channels * model.heads / h
    groups = model.query_groups / model.heads
    topk = int(model.config.get("moe_router_topk") or 1) if model.experts else 1
    ffn = int(model.config.get("moe_ffn_hidden_size") or model.ffn) if model.experts else model.ffn
    vocab = padded_vocab(model.vocab, layout.tp)
    return (
        12
        * batch
        * s
        * layers
        * h
        * h
        * ((1 + groups + s / h) * query + ffn / h * topk * _gated(model) + vocab / (2 * layers * h))
    )


def megatron_shard_parameters(model: ModelShape, layout: Layout) -> float:
    """The parameters of the most loaded model shard by Megatron-LM's count (module docstring): the first
    pipeline stage's layers and embedding table (and the output layer's, untied at pp=1), over tp."""
    layers, h = model.num_layers, model.hidden
    query = model.kv_channels * model.heads / h
    groups = model.query_groups / model.heads
    experts = model.experts or 1
    in_layers = (
        2
        * layers
        * h
        * h
        * ((1 + groups) * query + model.ffn / h * experts * _gated(model) + 2 / h + 1 / (layers * h))
    )
    table = h * padded_vocab(model.vocab, layout.tp)
    shard = (in_layers / layout.pp + table) / layout.tp
    if not model.tie_embeddings and layout.pp == 1:
        shard += table / layout.tp
    return shard
