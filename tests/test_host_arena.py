"""L2's host arena (engine.host_arena): extents handed out first fit, given back when their tensor is collected, merged
with free neighbours, never two live ones overlapping, from many threads at once."""

import gc
import multiprocessing as mp
import os
import random
import threading
from types import SimpleNamespace

import pytest
import torch

from engine.host_arena import ALIGN, SHM_DIR, HostArena, attach, reap


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


def _write_marks(name: str, nbytes: int, start: int, n: int) -> None:  # in a spawned process: what a reader does
    block = attach(name, nbytes).view(torch.float32)
    block[start : start + n] = torch.arange(n, dtype=torch.float32)


def test_a_shared_arena_is_written_in_place_by_another_process_and_unlinked_when_collected():
    """With shared=True the block is a /dev/shm segment: a spawned process attaches by name and writes an extent at its
    offset, which this process's tensor then holds; the segment is unlinked when the arena goes, and its extents stay
    readable until they go too."""
    arena = HostArena(16 * ALIGN, torch.float32, shared=True)
    assert arena.name is not None and os.path.exists(os.path.join(SHM_DIR, arena.name))
    first = arena.alloc(5)  # held: the next extent starts past it, as readers' extents do
    t = arena.alloc(100)
    start = arena.offset_of(t)
    assert start == ALIGN // 4 and arena.offset_of(torch.zeros(3)) is None
    proc = mp.get_context("spawn").Process(target=_write_marks, args=(arena.name, arena.nbytes, start, 100))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0 and torch.equal(t, torch.arange(100, dtype=torch.float32))
    path = os.path.join(SHM_DIR, arena.name)
    del arena
    gc.collect()
    assert not os.path.exists(path) and torch.equal(t, torch.arange(100, dtype=torch.float32))
    del first


def test_a_shared_arena_that_dev_shm_cannot_hold_is_a_private_block(monkeypatch, caplog):
    """A container's small /dev/shm would fault at the first write past its room: the arena checks the free space and
    falls back to a block of its own (readers then send their pages over pipes), saying how to give it room."""
    real = os.statvfs

    class Small:
        def __init__(self, st):
            self.f_bavail, self.f_frsize = 10, st.f_frsize

    monkeypatch.setattr("engine.host_arena.os.statvfs", lambda p: Small(real(p)))
    arena = HostArena(1 << 20, torch.float32, shared=True)
    assert arena.name is None and arena.alloc(1000) is not None
    assert "--shm-size" in caplog.text


class _Ended:
    """A process as `reap` sees it: joined, then its exit code (None while it runs) and pid."""

    def __init__(self, pid: int, exitcode: int | None):
        self.pid, self.exitcode, self.joined = pid, exitcode, []

    def join(self, timeout=None) -> None:
        self.joined.append(timeout)


OTHERS = ["lorabatch-l2-424-cccc", "lorabatch-l2-4243-bbbb", "other"]  # other processes' segments, another file


@pytest.mark.parametrize("exitcode, left", [
    (-9, OTHERS),  # killed: its two segments go
    (0, OTHERS),  # ended: the same (one that ended well unlinked its own already)
    (None, sorted(OTHERS + ["lorabatch-l2-4242-aaaa", "lorabatch-l2-4242-dddd"])),  # still running (stuck in a driver
    # call): nothing is taken from under it
])
def test_reap_unlinks_the_segments_an_ended_process_left(tmp_path, monkeypatch, exitcode, left):
    """A killed engine process cannot unlink its L2 arena, and the resource tracker it shares with the worker does so only
    when the worker exits: reaping it unlinks the segments named with its pid, and no one else's."""
    monkeypatch.setattr("engine.host_arena.SHM_DIR", str(tmp_path))
    unregistered = []
    monkeypatch.setattr("engine.host_arena.resource_tracker.unregister", lambda name, kind: unregistered.append(name))
    for name in ("lorabatch-l2-4242-aaaa", "lorabatch-l2-4242-dddd", "lorabatch-l2-4243-bbbb", "lorabatch-l2-424-cccc",
                 "other"):
        (tmp_path / name).write_bytes(b"x")
    proc = _Ended(4242, exitcode)
    reap(proc, timeout=5)
    assert proc.joined == [5]
    assert sorted(os.listdir(tmp_path)) == left
    assert unregistered == ([] if exitcode is None else ["/lorabatch-l2-4242-aaaa", "/lorabatch-l2-4242-dddd"])


def test_reap_without_a_shared_memory_folder_does_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr("engine.host_arena.SHM_DIR", str(tmp_path / "missing"))
    reap(SimpleNamespace(pid=1, exitcode=-9, join=lambda timeout=None: None))


_NEIGHBOUR = r"""
import os, sys, torch
import engine.host_arena as host_arena
host_arena.SHM_DIR = sys.argv[1]
arena = host_arena.HostArena(768 << 10, torch.uint8, shared=True)  # fits the 1 MiB tmpfs when made
try:  # another process (a second worker's arena, a neighbour's file) takes the room the arena has not touched yet
    with open(os.path.join(sys.argv[1], "neighbour"), "wb") as f:
        f.write(b"x" * (512 << 10))
    print("neighbour wrote", flush=True)
except OSError as e:
    print("neighbour refused:", e.strerror, flush=True)
arena._block.fill_(7)  # every page of the arena, as reader processes and L2 copies write them
print("arena written", arena.name is not None, int(arena._block.sum()) == 7 * arena.nbytes, flush=True)
"""


def test_a_shared_arena_holds_its_room_in_dev_shm_against_a_later_neighbour(tmp_path):
    """The arena's room in /dev/shm is taken when the engine starts, not at each page's first write: a file made there
    later (another worker's arena on the host, a neighbour's file) cannot take it, so a write to the arena never faults.
    Measured in a 1 MiB tmpfs (a user namespace's own mount): the arena of 768 KiB checked the free space and made a
    sparse file; a neighbour then wrote 512 KiB, and the arena's first write past the 512 KiB left died of SIGBUS (exit
    -7) — a reader process would die at each read, the engine process at its first L2 copy."""
    mount = tmp_path / "shm"
    mount.mkdir()
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("no user namespaces here to mount a small tmpfs in")
    script = f"mount -t tmpfs -o size=1m tmpfs {mount} && exec {sys.executable} -c \"$0\" {mount}"
    run = subprocess.run(["unshare", "-rm", "sh", "-c", script, _NEIGHBOUR], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    assert "neighbour refused: No space left on device" in run.stdout, run.stdout
    assert "arena written True True" in run.stdout, run.stdout


def test_a_shared_arena_whose_room_is_taken_between_check_and_reservation_is_a_private_block(monkeypatch, caplog):
    """The free space checked, then taken by another process before the arena reserves it: ENOSPC at the reservation is
    the same fallback (a block of its own, the log saying how to give /dev/shm room), and no segment is left behind."""
    before = set(os.listdir(SHM_DIR))

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("engine.host_arena.os.posix_fallocate", full)
    arena = HostArena(1 << 20, torch.float32, shared=True)
    assert arena.name is None and arena.alloc(1000) is not None
    assert "No space left on device" in caplog.text and "--shm-size" in caplog.text
    assert not {n for n in set(os.listdir(SHM_DIR)) - before if n.startswith("lorabatch-l2-")}
