"""Paged adapter memory (engine/adapter_pages.py, engine.lora.LoraState.write): pages handed out never overlap, an
adapter takes exactly its rank over its targets, freed chunks serve any page size, and what `write` puts in the pool
reads back through the kernels' page tables as the adapter's own A and B, on the CPU and, where there is one, on CUDA
(where a load is one DMA into staging and a scatter of rows)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.adapter_pages import PageAllocator, copy_runs
from engine.adapters import LoraAdapter
from engine.backend import KernelBackend
from engine.lora import LoraState
from engine.model import LORA_TARGETS, ModelConfig
from engine.rope import RopeConfig
from kernels.lora_segments import unpack_stacks

SIZES = (40, 25, 100)  # page sizes in elements: lcm 200


def _cfg() -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                       head_dim=8, rope=RopeConfig(theta=10000.0), rms_norm_eps=1e-5, max_position_embeddings=64,
                       tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False)  # fmt: skip


def test_allocator_pages_never_overlap_and_free_chunks_serve_any_size():
    """Random alloc/free of mixed sizes: live pages are disjoint, inside the pool, each on its size's grid in its chunk;
    a refused alloc takes nothing; after freeing everything, the whole pool is one size's again."""
    alloc = PageAllocator(200 * 64, SIZES)
    assert alloc.capacity == 200 * 64 and alloc.chunk % 200 == 0
    rng = random.Random(3)
    live: list[tuple[int, list[int]]] = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            size, offs = live.pop(rng.randrange(len(live)))
            alloc.free(size, offs)
            continue
        size = rng.choice(SIZES)
        before = (dict(alloc.nfree), alloc.free_chunks)
        got = alloc.alloc([(size, rng.randint(1, 30))])
        if got is None:
            assert (dict(alloc.nfree), alloc.free_chunks) == before, "a refused alloc took pages"
            continue
        live.append((size, got[0]))
        spans = sorted((o, o + s) for s, offs in live for o in offs)
        assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:])), "pages overlap"
        assert spans[0][0] >= 0 and spans[-1][1] <= alloc.capacity
        assert all((o % alloc.chunk) % s == 0 for s, offs in live for o in offs)
    for size, offs in live:
        alloc.free(size, offs)
    assert alloc.used_elems() == 0 and alloc.free_chunks == alloc.num_chunks
    assert alloc.alloc([(100, alloc.capacity // 100)]) is not None  # every chunk back, for the largest size alone


def test_fits_and_trial_agree_with_alloc():
    """`fits` says yes exactly when `alloc` succeeds; a Trial of frees predicts what fits after them; could_fit refuses
    what even the empty pool cannot hold."""
    alloc = PageAllocator(200 * 48, SIZES)
    assert alloc.num_chunks == 48
    held = alloc.alloc([(40, 5 * 46)])[0]  # 46 of the 48 chunks, 5 pages of 40 each
    assert alloc.fits({100: 4}) and not alloc.fits({100: 5}) and alloc.alloc([(100, 5)]) is None
    trial = alloc.trial()
    trial.free(40, held[:10])  # two whole chunks free again
    trial.free(40, held[10:14])  # a chunk not emptied: nothing for another size
    assert trial.fits({100: 8}) and not trial.fits({100: 9})
    alloc.free(40, held[:14])
    assert alloc.alloc([(100, 8)]) is not None and alloc.alloc([(25, 9)]) is None and alloc.alloc([(40, 4)]) is not None
    assert not alloc.could_fit([(100, 2 * 48 + 1)]) and alloc.could_fit([(25, 8 * 48)])


def test_copy_runs_merge_consecutive_pages_only():
    """Consecutive destination pages of consecutive host pages are one copy; anything else starts a new one."""
    class Host:
        rank, page_elems = 3, (10, 4)

        @staticmethod
        def module_start(i):
            return (0, 30)[i]

    runs = copy_runs(Host, [[100, 110, 120], [7, 50, 54]])
    assert runs == [(0, 100, 30), (30, 7, 4), (34, 50, 8)]


def _adapter(cfg: ModelConfig, rank: int, targets: tuple[str, ...], seed: int) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    shapes = cfg.projection_shapes()
    weights = {(l, m): (torch.randn(rank, shapes[m][0], generator=gen), torch.randn(shapes[m][1], rank, generator=gen))
               for l in range(cfg.num_layers) for m in targets if (l, m) != (1, targets[0])}  # layer 1 skips one module  # fmt: skip
    return LoraAdapter(sha256=f"{seed:064x}", rank=rank, alpha=2.0 * rank, use_rslora=False, scaling=2.0, target_modules=targets,
                       weights=weights)  # fmt: skip


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_write_reads_back_through_the_page_tables(device):
    """Adapters of different ranks and target sets written into one pool (the second over pages freed by the first)
    read back, through every projection's view, as their own A and B at their rank, zeros elsewhere; the pool holds
    exactly their pages."""
    cfg = _cfg()
    dev = torch.device(device)
    state = LoraState(max_loras=4, max_lora_rank=16, device=dev, dtype=torch.float32, backend=KernelBackend("torch"), cfg=cfg,
                      gpu_bytes=4 << 20)  # fmt: skip
    from engine.lora import slice_widths

    state.widths = slice_widths(cfg)
    ads = [_adapter(cfg, 5, ("q_proj", "v_proj"), 1), _adapter(cfg, 16, ("k_proj", "gate_proj", "down_proj"), 2),
           _adapter(cfg, 1, ("o_proj",), 3)]  # fmt: skip
    placed = []
    for slot, ad in enumerate(ads):
        host = state.host_copy(ad)
        assert host.nbytes == ad.rank * sum(state.page_elems[LORA_TARGETS.index(m)] for m in ad.target_modules) * 4
        pages = state.allocator.alloc(state.page_need(host))
        state.write(slot, host, pages)
        placed.append((host, pages))
    if dev.type == "cuda":
        state.wait_ready(range(3))
        torch.cuda.synchronize()
    assert state.allocator.used_elems() * 4 == sum(h.nbytes for h, _ in placed)
    for (layer, fused), w in ((k, state.projection(*k)) for k in [(l, f) for l in range(cfg.num_layers) for f in state.widths]):
        a, b = unpack_stacks(w)  # [slots, S, R, in], [slots, R, out]
        col = 0
        from engine.model import FUSED_PROJECTIONS

        for s, module in enumerate(FUSED_PROJECTIONS[fused]):
            width = w.slices[s]
            for slot, ad in enumerate(ads):
                want_a = torch.zeros(16, w.in_features)
                want_b = torch.zeros(16, width)
                if (layer, module) in ad.weights:
                    want_a[: ad.rank] = ad.weights[(layer, module)][0]
                    want_b[: ad.rank] = ad.weights[(layer, module)][1].t()
                assert torch.equal(a[slot, s].cpu(), want_a), (layer, module, slot)
                assert torch.equal(b[slot, :, col : col + width].cpu(), want_b), (layer, module, slot)
                assert int(w.rank[slot, s]) == (ad.rank if module in ad.target_modules else 0)
            col += width
    # free the rank-16 adapter's pages and write a fourth adapter over them: the others read as before
    host2, pages2 = placed[1]
    for (size, _), offs in zip(state.page_need(host2), pages2):
        state.allocator.free(size, offs)
    ad4 = _adapter(cfg, 16, ("gate_proj", "up_proj"), 4)
    host4 = state.host_copy(ad4)
    state.write(1, host4, state.allocator.alloc(state.page_need(host4)))
    if dev.type == "cuda":
        state.wait_ready([1])
        torch.cuda.synchronize()
    a, b = unpack_stacks(state.projection(2, "qkv_proj"))
    assert torch.equal(a[0, 0, :5].cpu(), ads[0].weights[(2, "q_proj")][0]) and not a[1].any()
    a, b = unpack_stacks(state.projection(2, "gate_up_proj"))
    assert torch.equal(a[1, 1, :16].cpu(), ad4.weights[(2, "up_proj")][0])
