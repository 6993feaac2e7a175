"""The pipeline bench's wait on its client process (consumer.bench.pipeline `_from_client`): a client that fails says
why, one that dies says nothing and is noticed, one that is silent past the limit is given up on. None of these may
leave the bench waiting forever (the client connects to the broker before it says it is ready)."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from consumer.bench.pipeline import _from_client

CTX = multiprocessing.get_context("fork")


def _dies(conn) -> None:
    raise SystemExit(3)


def _fails(conn) -> None:
    conn.send(("failed", "KafkaConnectionError: cannot reach 127.0.0.1:1"))


def _silent(conn) -> None:
    time.sleep(30)


def _answers(conn) -> None:
    conn.send(("ready",))
    conn.send(("done", 1.5, 0))


def _start(target):
    ours, theirs = CTX.Pipe()
    proc = CTX.Process(target=target, args=(theirs,), daemon=True)
    proc.start()
    theirs.close()
    return ours, proc


@pytest.mark.parametrize("target,match", [(_dies, "ended \\(exit code 3\\) without a word"), (_fails, "failed: KafkaConnectionError"),
                                          (_silent, "said nothing within 1 s")])  # fmt: skip
def test_a_client_that_cannot_answer_ends_the_wait(target, match):
    conn, proc = _start(target)
    try:
        with pytest.raises(RuntimeError, match=match):
            _from_client(conn, proc, 1.0)
    finally:
        proc.kill()
        proc.join()


def test_a_client_that_answers_is_read_in_order():
    conn, proc = _start(_answers)
    assert _from_client(conn, proc, 10) == []
    assert _from_client(conn, proc, 10) == [1.5, 0]
    proc.join()
