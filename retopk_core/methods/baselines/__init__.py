"""Baseline sparse-attention methods compared with ReTopK, one file each, all following
``retopk_core.methods.base.AttentionMethod``; build them by name with ``registry.make_method``
("streaming_llm", "quest", "sparq", "loki", "tokenselect"). Every one takes the token budget as
``top_k`` so callers can switch methods at a shared budget."""
