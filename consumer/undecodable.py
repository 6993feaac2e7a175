"""Record batches that cannot be decoded become one marker record each, at their offset, instead of an error.

aiokafka decodes a fetched partition's record batches while `getmany` hands out its records. A batch it
cannot decode (a codec it does not know or whose library is missing, bytes that fail their CRC, a
header it cannot parse) raises from `getmany` without naming the partition, and the next `getmany`
fetches the same offset again: the partition is blocked for good. The consumers made by
`consumer.kafka.make_consumer` decode each batch here first; one that fails is handed out as a single
record with no value and one header whose value is an `Undecodable` (not bytes, so no producer can forge
one), at the batch's first offset not yet consumed, and the fetch position moves past the whole batch. The worker dead-letters it
by offset and commits past it; readers of the results topic skip it with a warning.

A compressed batch is also sized before it is decoded: a producer can send a few kilobytes that decompress to
gigabytes (zstd turns 1 GiB of zeros into 32 KiB; a fetch brings a mebibyte of such batches), which aiokafka
would decompress whole, in memory, and the worker was killed for it, then again for the same record on its
redelivery. A batch that decompresses to more than the consumer's inflate limit is a marker too, and once a
fetched partition's batches have decompressed to that much, the rest is left to the next fetch.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import cramjam
from aiokafka.consumer import fetcher as _fetcher
from aiokafka.errors import CorruptRecordException, UnsupportedCodecError
from aiokafka.record.memory_records import MemoryRecords

_CODECS = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}
HEADER = "lorabatch-undecodable"
# Codecs whose output can be sized without holding it (decompressed into a buffer of the limit, which fails when
# the output is larger). Snappy is left out: its format cannot expand more than about 21-fold, so a fetch's worth of
# it stays tens of megabytes.
_SIZED = {1: cramjam.gzip, 3: cramjam.lz4, 4: cramjam.zstd}
_RECORDS_AT = 61  # a v2 batch's header, before its (compressed) records
# How much more a compressed batch may hold than a fetch brings: a producer's batch is at most its batch size
# uncompressed (librdkafka's batch.size is 1,000,000 bytes; lorabatch's own, kafka.max_message_bytes), and JSON jobs
# compress 3 to 10-fold, so 16x a fetch holds any batch of real jobs.
INFLATE_FACTOR = 16


@dataclass(frozen=True)
class Undecodable:
    """A record batch at offsets [first, end) of a partition that could not be decoded, and why."""

    first: int
    end: int  # one past the batch's last offset
    codec: str
    error: str
    hint: str

    def describe(self) -> str:
        span = f"offset {self.first}" if self.end - self.first <= 1 else f"offsets {self.first}..{self.end - 1}"
        return f"the record batch at {span} (compression {self.codec}) could not be decoded: {self.error}; {self.hint}"


class TooLarge(Exception):
    """A compressed batch that decompresses to more than the consumer's inflate limit."""


def _hint(e: Exception, codec: str) -> str:
    if isinstance(e, TooLarge):
        return ("no job is that large: produce these jobs again in batches that decompress to less (a smaller "
                "batch.size or linger), each job at most kafka.max_message_bytes")
    if isinstance(e, UnsupportedCodecError):
        return (f"produce these jobs again with compression.type none, gzip, snappy, lz4 or zstd "
                f"(this batch says {codec}), or install the codec library the worker lacks (`pip install cramjam`)")
    if isinstance(e, CorruptRecordException):
        return "the batch was damaged on the broker or on its way there; produce these jobs again"
    return (f"its bytes do not decompress as {codec}: produce these jobs again with a standard Kafka client; "
            f"the rest of the partition is served")


@dataclass
class _Record:
    """The one record standing for an undecodable batch, shaped as aiokafka's records are."""

    offset: int
    why: Undecodable
    timestamp: int = -1
    timestamp_type: int = 0
    key: None = None
    value: None = None
    checksum: None = None

    @property
    def headers(self) -> tuple:
        return ((HEADER, self.why),)


class _MarkerBatch:
    """Stands in for the undecodable batch: no producer, no control marker, one record."""

    producer_id = None
    is_control_batch = False
    is_transactional = False

    def __init__(self, record: _Record, next_offset: int):
        self.base_offset = record.offset
        self.next_offset = next_offset
        self._records = iter([record])

    def validate_crc(self) -> bool:
        return True

    def __iter__(self):
        return self._records

    def __next__(self):
        return next(self._records)


class _DecodedBatch:
    """A batch decoded in full already; everything but its records is the original's."""

    def __init__(self, batch, records: list):
        self._batch = batch
        self._records = iter(records)

    def __getattr__(self, name):
        return getattr(self._batch, name)

    def validate_crc(self) -> bool:
        return True  # checked before decoding

    def __iter__(self):
        return self._records

    def __next__(self):
        return next(self._records)


class KeptRecords:
    """aiokafka's MemoryRecords of one fetched partition, with the fetched bytes kept so that the guard can size each
    compressed batch before aiokafka decompresses it."""

    def __init__(self, data: bytes):
        self.data = data
        self._records = MemoryRecords(data)

    def has_next(self) -> bool:
        return self._records.has_next()

    def next_batch(self):
        return self._records.next_batch()

    def size_in_bytes(self) -> int:
        return self._records.size_in_bytes()


class _GuardedRecords:
    """A fetch response's MemoryRecords, each batch sized, decoded (and CRC-checked) before aiokafka walks it."""

    def __init__(self, records, owner: "_GuardedPartitionRecords", check_crcs: bool, inflate_limit: int):
        self._records = records
        self._data = getattr(records, "data", None)  # the fetched bytes (KeptRecords), to size compressed batches
        self._pos = 0  # where the next batch starts in them
        self._owner = owner
        self._check_crcs = check_crcs
        self._inflate_limit = inflate_limit
        self._inflated = 0  # bytes the compressed batches of this fetch decompressed to
        self._broken = False  # a batch header could not be read: nothing after it can be found

    def has_next(self) -> bool:
        # Past the inflate limit the rest waits for the next fetch, so one fetch never holds more than about twice it.
        return not self._broken and self._inflated < self._inflate_limit and self._records.has_next()

    def next_batch(self):
        start = self._owner.next_fetch_offset  # the first offset this fetch still owes
        try:
            batch = self._records.next_batch()
        except Exception as e:  # noqa: BLE001 - a header that cannot be read: step one offset past it
            self._broken = True
            return self._marker(start, start + 1, "unknown", e)
        here = self._pos
        if self._data is not None:  # MemoryRecords' own framing: the offset, then the batch's length after it
            self._pos = here + 12 + struct.unpack_from(">i", self._data, here + 8)[0]
        codec = _CODECS.get(batch.compression_type, f"codec {batch.compression_type}")
        try:
            if self._check_crcs and not batch.validate_crc():
                raise CorruptRecordException(f"invalid CRC at offset {batch.base_offset}")
            self._size(batch, here)
            return _DecodedBatch(batch, list(batch))
        except Exception as e:  # noqa: BLE001 - whatever decoding raises, it is this batch's fault
            return self._marker(max(batch.base_offset, start), max(batch.next_offset, start + 1), codec, e, batch)

    def _size(self, batch, here: int) -> None:
        """Count what a compressed v2 batch decompresses to; TooLarge past the inflate limit (nothing is held)."""
        codec = _SIZED.get(batch.compression_type)
        if codec is None or self._data is None or getattr(batch, "magic", 2) < 2:
            return
        payload = memoryview(self._data)[here + _RECORDS_AT:self._pos]
        # Anonymous memory is zeroed by the kernel page by page as it is written: sizing a 200 KB batch takes 0.3 ms
        # here, where a bytearray of the limit (zeroed whole first) took 12 ms.
        with mmap.mmap(-1, self._inflate_limit + 1) as out:
            try:
                size = codec.decompress_into(payload, out)
            except cramjam.DecompressionError as e:
                if "failed to write whole buffer" not in str(e):
                    raise  # not a matter of size: aiokafka's decoder names what is wrong
                size = self._inflate_limit + 1
        if size > self._inflate_limit:  # nothing of it is held: it does not count toward this fetch's limit
            raise TooLarge(f"it decompresses to more than {self._inflate_limit} bytes from {len(payload)}, over the "
                           f"workers' limit ({INFLATE_FACTOR} times the largest fetch)")
        self._inflated += size

    @staticmethod
    def _marker(first: int, end: int, codec: str, e: Exception, batch=None) -> _MarkerBatch:
        why = Undecodable(first, end, codec, (str(e) or type(e).__name__)[:500], _hint(e, codec))
        stamp = getattr(batch, "first_timestamp", -1) if batch is not None else -1
        return _MarkerBatch(_Record(first, why, timestamp=stamp if isinstance(stamp, int) else -1), end)


class _GuardedPartitionRecords(_fetcher.PartitionRecords):
    def __init__(self, tp, records, aborted_transactions, fetch_offset, key_deserializer, value_deserializer,
                 check_crcs, isolation_level):
        if isinstance(value_deserializer, KeepValue):  # only lorabatch's consumers: others keep aiokafka's behaviour
            records = _GuardedRecords(records, self, check_crcs, value_deserializer.inflate_limit)
        super().__init__(tp, records, aborted_transactions, fetch_offset, key_deserializer, value_deserializer,
                         check_crcs, isolation_level)


class KeepValue:
    """The value deserializer of lorabatch's consumers: the bytes as they are. It also marks the consumer whose
    batches `_GuardedPartitionRecords` decodes, and carries the most a compressed batch may decompress to."""

    def __init__(self, max_partition_fetch_bytes: int):
        self.inflate_limit = INFLATE_FACTOR * max_partition_fetch_bytes

    def __call__(self, value):
        return value


def install() -> None:
    """Make aiokafka's fetcher build guarded partition records over kept bytes (for consumers whose value
    deserializer is a `KeepValue`; any other consumer in the process is unchanged). Idempotent."""
    if _fetcher.PartitionRecords is not _GuardedPartitionRecords:
        _fetcher.PartitionRecords = _GuardedPartitionRecords
    if _fetcher.MemoryRecords is not KeptRecords:
        _fetcher.MemoryRecords = KeptRecords


def undecodable(message) -> Undecodable | None:
    """The undecodable batch a fetched message stands for, or None for an ordinary message."""
    for name, value in message.headers or ():
        if name == HEADER and isinstance(value, Undecodable):
            return value
    return None
