"""What several kernel files share: the row-group walk and rank tile of the multi-LoRA kernels, Triton's dtypes.

The multi-LoRA kernels (kernels/lora_shrink.py, kernels/lora_expand.py, kernels/silu_mul.py with a delta) all walk the
row groups of kernels/lora_segments.py the same way and step through ranks in the same tiles, so both live here once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 16  # rank tile of the multi-LoRA kernels: the tensor-core minimum, and the granularity at which ranks are skipped
# The shared memory one program may take on the target (sm_90: 227 KB, opted in). A launch asking more fails on the
# device, though it compiles (kernels.compile_check checks each variant's against it).
SHARED_BYTES = 232_448
TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}  # a tensor's dtype in a kernel


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of non-negative ints, for launchers' grids: plain Python, where `triton.cdiv` is a constexpr function
    whose call from the host costs microseconds (kernels.bench.launch_overhead)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0, as `triton.next_power_of_2`), for launchers' block sizes: plain Python,
    as `cdiv`."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@triton.jit
def group_rows(start_ptr, group, HAS_START: tl.constexpr):
    """(first row, end row) of row group `group` (kernels/lora_segments.py): from `start` when the groups are segments,
    else the group is its own row."""
    if HAS_START:
        row_begin = tl.load(start_ptr + group)
        row_end = tl.load(start_ptr + group + 1)
    else:
        row_begin = group
        row_end = group + 1
    return row_begin, row_end
