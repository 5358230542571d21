"""What the FLOPs convention (``stats.py``) counts of a transformers model, read from its modules
and config."""

from __future__ import annotations

from torch import nn

from .families import unwrap


def flops_parameters(model: nn.Module, located) -> tuple[int, int, int, int, int]:
    """``(N, trainable N, layers, heads, head_dim)`` of the convention. N: every unit's parameters but
    the input-embedding tables'; a table tied to the head is the head's, counted once. Routed experts
    count by the share a token is computed with (``num_experts_per_tok`` of the module's
    ``num_experts``): N is the parameters a token activates."""
    config = getattr(unwrap(model), "config", None)
    text = getattr(config, "get_text_config", lambda: config)()
    top_k = getattr(text, "num_experts_per_tok", None)
    seen: set[int] = set()
    matmul = trainable = 0
    for u, module in enumerate(located.modules):
        if u in located.embedding_units:
            continue
        for sub in module.modules():
            experts = getattr(sub, "num_experts", None) if type(sub).__name__.endswith("Experts") else None
            for p in sub.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                n = p.numel()
                if experts and top_k and p.shape[0] == experts:
                    n = n // experts * top_k
                matmul += n
                trainable += n if p.requires_grad else 0
    layers = getattr(text, "num_hidden_layers", 0) or 0
    heads = getattr(text, "num_attention_heads", 0) or 0
    head_dim = getattr(text, "head_dim", None) or ((getattr(text, "hidden_size", 0) or 0) // max(heads, 1))
    return matmul, trainable, layers, heads, head_dim
