"""decode_linear's launch configs fit an sm_90 program's shared memory at every row count it takes (kernels.compile_check
compiles them and reads the real figure; this checks the config's own account, for every shape and row count)."""

import pytest
import torch

from kernels.decode_linear import MAX_ROWS, _TUNED, _config, shared_bytes
from kernels.utils import SHARED_BYTES

SHAPES = sorted({*_TUNED, (2048, 2048), (3072, 2048), (2048, 8192), (16384, 2048), (6144, 4096), (28672, 4096)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_row_count_fits_shared_memory(dtype):
    elem = torch.empty(0, dtype=dtype).element_size()
    for n, k in SHAPES:
        for m in range(1, MAX_ROWS + 1):
            block_n, block_k, _, stages = _config(m, n, k, elem)
            assert stages >= 1 and shared_bytes(m, block_n, block_k, stages, elem) <= SHARED_BYTES, (m, n, k, dtype, stages)


def test_the_tuned_config_keeps_its_stages_where_they_fit():
    """32 rows in bf16 (where it was swept) keep the tuned 5 stages; 64 rows, whose x tile is twice as tall, get 4."""
    assert _config(32, 4096, 4096, 2) == _TUNED[(4096, 4096)][0]
    assert _config(64, 4096, 4096, 2)[3] == 4 and _config(64, 4096, 14336, 2)[3] == 4
