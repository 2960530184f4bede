"""retopk_core: ReTopK training-free sparse attention and its baselines, free of gRPC.

Public entry points (see docs/core.md):
    retopk_core.retopk_config.ReTopKConfig          the paper's K, C, W, R, tau, T_r
    retopk_core.kv.PagedKV                   the paged key/value cache of a batch of sequences
    retopk_core.methods.registry.make_method every attention method by name
    retopk_core.models.load_model            the embedded SmolLM2-135M or a local checkpoint
Importing this package is cheap: submodules load torch / transformers when they are imported.
"""

from retopk_core.retopk_config import ReTopKConfig

__all__ = ["ReTopKConfig"]
