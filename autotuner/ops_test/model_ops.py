"""The GPTModel's own parts, in forward order: the embedding, the transformer block, one whole layer (the
container of autotuner.ops_test.layer_ops), the final norm and the output layer with the loss.

Their paths are the GPTModel's attributes; the layer's is ``""`` in each TransformerLayer, which sit at
``decoder.layers`` (autotuner.ops_test.places). Registered here in forward order, they are model order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotuner.ops_test.base import BLOCK, EMBEDDING, HEAD, LAYER, OpCall, OpContext, ShapePoint, register_op

if TYPE_CHECKING:
    import torch


@register_op("embedding", needs=EMBEDDING, where="embedding")
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


@register_op(
    "transformer_block", aliases=("TransformerBlock",), needs=(BLOCK, EMBEDDING, HEAD), where="decoder"
)
def transformer_block(ctx: OpContext, point: ShapePoint) -> OpCall:
    """A TransformerBlock of ``transformer_block_layers`` layers plus the final norm (as in the last
    pipeline stage)."""
    from autotuner.ops_test.layer_ops import attention_fields  # registered after the ops here

    block = ctx.model.decoder
    mask, rotary = ctx.causal_mask(point), ctx.rotary(point)
    return OpCall(
        lambda x: block(hidden_states=x, attention_mask=mask, rotary_pos_emb=rotary),
        (ctx.hidden(point),),
        block,
        row_fields=attention_fields(ctx, point),
    )


@register_op("transformer_layer", aliases=("TransformerLayer",), needs=LAYER, where="")
def transformer_layer(ctx: OpContext, point: ShapePoint) -> OpCall:
    """One whole TransformerLayer: attention block and MLP block with their residuals."""
    from autotuner.ops_test.layer_ops import attention_fields  # registered after the ops here

    layer = ctx.layer
    mask, rotary = ctx.causal_mask(point), ctx.rotary(point)
    return OpCall(
        lambda x: layer(x, attention_mask=mask, rotary_pos_emb=rotary),
        (ctx.hidden(point),),
        layer,
        row_fields=attention_fields(ctx, point),
    )


@register_op("final_layernorm", needs=HEAD, where="decoder.final_layernorm")
def final_layernorm(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The norm after the last layer."""
    norm = ctx.model.decoder.final_layernorm
    return OpCall(norm, (ctx.hidden(point),), norm)


@register_op("output_layer", aliases=("post_process",), needs=HEAD, where="output_layer")
def output_layer(ctx: OpContext, point: ShapePoint) -> OpCall:
    """The output projection to the vocabulary and the cross-entropy loss per token, [b, s]."""
    from autotuner.ops.instrument import instrumented_function

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
