"""A jobs-topic record's size as the worker measures it against kafka.max_message_bytes: its key, value and headers,
each in bytes as the broker carries them (a producer that is not lorabatch's may put anything in its headers)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from consumer.intake import message_bytes


@pytest.mark.parametrize(("headers", "size"), [
    (None, 0),
    ((), 0),
    ((("k", None),), 1),  # a header with no value (Kafka allows it)
    ((("", b""),) * 1000, 0),
    ((("trace", b"\x00" * 10),), 15),
    ((("\U0001f600" * 1000, b""),), 4000),  # 4 bytes a character in UTF-8: it counted 1,000
    ((("é", "é".encode()),), 4),
])
def test_headers_count_their_bytes(headers, size):
    """Header keys count in UTF-8 bytes: counted in characters, a header key of 250,000 emoji (a megabyte on the wire)
    counted 250,000, so a record over the limit by that much was run instead of dead-lettered as message_too_large."""
    m = SimpleNamespace(value=b"v" * 10, key=b"kk", headers=headers)
    assert message_bytes(m) == 12 + size
