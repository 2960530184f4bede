"""Address of a key/value row in the PagedKV block pool, shared by every kernel.

Pool (N_blocks, H_kv, P, d) contiguous: position i of sequence b, KV head g is row
    (block_table[b, i // P] * H_kv + g) * P + i % P
of the pool viewed as (N_blocks * H_kv * P, d) (see retopk_core/kv.py). Rows are int64 (the table's dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pool_rows(table_ptr, stride_tb, b, g, pos, mask, H_KV, P):
    """Pool rows of positions ``pos`` (any int block) of sequence b, KV head g; 0 where ~mask."""
    pos = tl.where(mask, pos, 0)
    blk = tl.load(table_ptr + b * stride_tb + pos // P, mask=mask, other=0)
    return tl.where(mask, (blk * H_KV + g) * P + pos % P, 0)
