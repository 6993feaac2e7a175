"""L2's host arena (engine.host_arena): extents handed out first fit, given back when their tensor is collected, merged
with free neighbours, never two live ones overlapping, from many threads at once."""

import gc
import random
import threading

import torch

from engine.host_arena import ALIGN, HostArena


def _span(t: torch.Tensor, base: int, elem: int) -> tuple[int, int]:
    start = (t.data_ptr() - base) // elem
    return start, start + t.numel()


def test_extents_are_disjoint_and_come_back_merged_when_collected():
    arena = HostArena(64 * ALIGN, torch.float32)
    base, elem = arena._block.data_ptr(), 4
    per = ALIGN // elem  # elements per alignment unit
    a, b, c = arena.alloc(per * 10), arena.alloc(3), arena.alloc(per * 20)
    assert [_span(t, base, elem)[0] for t in (a, b, c)] == [0, 10 * per, 11 * per]  # first fit, aligned
    assert arena.alloc(per * 40) is None and arena.misses == 1  # 33 units free, 40 asked
    a.fill_(1.0)
    del b
    gc.collect()
    d = arena.alloc(per)  # b's unit, the lowest free one
    assert _span(d, base, elem)[0] == 10 * per and torch.equal(a, torch.ones(per * 10))
    del a, c, d
    gc.collect()
    assert arena.free_elems() == arena.capacity and arena.used == 0
    whole = arena.alloc(arena.capacity)  # merged back into one extent
    assert whole is not None and whole.numel() == arena.capacity


def test_views_of_an_extent_keep_nothing_alive_and_slices_read_its_memory():
    """What holds the extent is the tensor alloc returned (an L2 copy's data); the copies read slices of it."""
    arena = HostArena(8 * ALIGN, torch.bfloat16)
    t = arena.alloc(100)
    t.copy_(torch.arange(100, dtype=torch.bfloat16))
    assert torch.equal(t[10:20], torch.arange(10, 20, dtype=torch.bfloat16))
    del t
    gc.collect()
    assert arena.free_elems() == arena.capacity and arena.used == 0


def test_many_threads_allocating_and_letting_go_never_overlap():
    """8 threads allocate random sizes, write their own marks, check them, and drop them at random: live extents never
    overlap (each thread's marks survive the others' writes) and at the end everything is free again."""
    arena = HostArena(2048 * ALIGN, torch.float32)
    errors = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        held = []
        for i in range(300):
            t = arena.alloc(rng.randint(1, 4000))
            if t is not None:
                t.fill_(float(seed * 1000 + i))
                held.append((t, float(seed * 1000 + i)))
            if held and rng.random() < 0.5:
                t, mark = held.pop(rng.randrange(len(held)))
                if not bool((t == mark).all()):
                    errors.append((seed, mark))
        for t, mark in held:
            if not bool((t == mark).all()):
                errors.append((seed, mark))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    gc.collect()
    assert not errors, errors[:5]
    assert arena.free_elems() == arena.capacity and arena.used == 0
