"""The ops around the layers: embedding, the transformer block, final norm and output layer with loss."""

from __future__ import annotations

import torch

from autotuner.ops.instrument import instrumented_function
from autotuner.ops_test.base import BLOCK, EMBEDDING, HEAD, OpCall, OpContext, ShapePoint, register_op


@register_op("embedding", needs=EMBEDDING)
def embedding(ctx: OpContext, point: ShapePoint) -> OpCall:
    """Token embedding lookup (vocab-parallel) for [b, s] token ids, output [s, b, h]."""
    module = ctx.model.embedding
    ids, positions = ctx.token_ids(point), ctx.position_ids(point)
    table = module.word_embeddings.weight
    rows = point.seq_len * point.micro_batch_size * table.shape[1] * table.element_size()
    index_bytes = ids.numel() * ids.element_size()
    # A lookup reads only the rows it gathers, not the table; its backward writes a dense gradient of
    # the whole (local) table, as Megatron's VocabParallelEmbedding does.
    moved = {
        "forward": index_bytes + 2 * rows,
        "backward": index_bytes + rows + table.numel() * table.element_size(),
    }
    return OpCall(module, (ids, positions), module, bytes_moved=moved)


@register_op("transformer_block", aliases=("TransformerBlock",), needs=(BLOCK, EMBEDDING, HEAD))
def transformer_block(ctx: OpContext, point: ShapePoint) -> OpCall:
    """A TransformerBlock of ``transformer_block_layers`` layers plus the final norm (as in the last
    pipeline stage)."""
    block = ctx.model.decoder
    mask, rotary = ctx.causal_mask(point), ctx.rotary(point)
    return OpCall(
        lambda x: block(hidden_states=x, attention_mask=mask, rotary_pos_emb=rotary),
        (ctx.hidden(point),),
        block,
    )


@register_op("final_layernorm", needs=HEAD)
def final_layernorm(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The norm after the last layer."""
    norm = ctx.model.decoder.final_layernorm
    return OpCall(norm, (ctx.hidden(point),), norm)


@register_op("output_layer", aliases=("post_process",), needs=HEAD)
def output_layer(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The output projection to the vocabulary and the cross-entropy loss per token, [b, s]."""
    model = ctx.model
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None

    def head(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits, _ = model.output_layer(hidden, weight=weight)
        return model.compute_language_model_loss(labels, logits)

    return OpCall(
        instrumented_function(head, "output_layer"),
        (ctx.hidden(point), ctx.token_ids(point)),
        model.output_layer,
    )
