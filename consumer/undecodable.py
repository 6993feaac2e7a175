"""Record batches that cannot be decoded become one marker record each, at their offset, instead of an error.

aiokafka decodes a fetched partition's record batches while `getmany` hands out its records. A batch it
cannot decode (a codec it does not know or whose library is missing, bytes that fail their CRC, a
header it cannot parse) raises from `getmany` without naming the partition, and the next `getmany`
fetches the same offset again: the partition is blocked for good. The consumers made by
`consumer.kafka.make_consumer` decode each batch here first; one that fails is handed out as a single
record with no value and one header whose value is an `Undecodable` (not bytes, so no producer can forge
one), at the batch's first offset not yet consumed, and the fetch position moves past the whole batch. The worker dead-letters it
by offset and commits past it; readers of the results topic skip it with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiokafka.consumer import fetcher as _fetcher
from aiokafka.errors import CorruptRecordException, UnsupportedCodecError

_CODECS = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}
HEADER = "lorabatch-undecodable"


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


def _hint(e: Exception, codec: str) -> str:
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


class _GuardedRecords:
    """A fetch response's MemoryRecords, each batch decoded (and CRC-checked) before aiokafka walks it."""

    def __init__(self, records, owner: "_GuardedPartitionRecords", check_crcs: bool):
        self._records = records
        self._owner = owner
        self._check_crcs = check_crcs
        self._broken = False  # a batch header could not be read: nothing after it can be found

    def has_next(self) -> bool:
        return not self._broken and self._records.has_next()

    def next_batch(self):
        start = self._owner.next_fetch_offset  # the first offset this fetch still owes
        try:
            batch = self._records.next_batch()
        except Exception as e:  # noqa: BLE001 - a header that cannot be read: step one offset past it
            self._broken = True
            return self._marker(start, start + 1, "unknown", e)
        codec = _CODECS.get(batch.compression_type, f"codec {batch.compression_type}")
        try:
            if self._check_crcs and not batch.validate_crc():
                raise CorruptRecordException(f"invalid CRC at offset {batch.base_offset}")
            return _DecodedBatch(batch, list(batch))
        except Exception as e:  # noqa: BLE001 - whatever decoding raises, it is this batch's fault
            return self._marker(max(batch.base_offset, start), max(batch.next_offset, start + 1), codec, e, batch)

    @staticmethod
    def _marker(first: int, end: int, codec: str, e: Exception, batch=None) -> _MarkerBatch:
        why = Undecodable(first, end, codec, (str(e) or type(e).__name__)[:500], _hint(e, codec))
        stamp = getattr(batch, "first_timestamp", -1) if batch is not None else -1
        return _MarkerBatch(_Record(first, why, timestamp=stamp if isinstance(stamp, int) else -1), end)


class _GuardedPartitionRecords(_fetcher.PartitionRecords):
    def __init__(self, tp, records, aborted_transactions, fetch_offset, key_deserializer, value_deserializer,
                 check_crcs, isolation_level):
        if value_deserializer is keep_value:  # only lorabatch's consumers: others keep aiokafka's behaviour
            records = _GuardedRecords(records, self, check_crcs)
        super().__init__(tp, records, aborted_transactions, fetch_offset, key_deserializer, value_deserializer,
                         check_crcs, isolation_level)


def keep_value(value):
    """The value deserializer of lorabatch's consumers: the bytes as they are. It also marks the consumer
    whose batches `_GuardedPartitionRecords` decodes."""
    return value


def install() -> None:
    """Make aiokafka's fetcher build guarded partition records (for consumers whose value deserializer is
    `keep_value`; any other consumer in the process is unchanged). Idempotent."""
    if _fetcher.PartitionRecords is not _GuardedPartitionRecords:
        _fetcher.PartitionRecords = _GuardedPartitionRecords


def undecodable(message) -> Undecodable | None:
    """The undecodable batch a fetched message stands for, or None for an ordinary message."""
    for name, value in message.headers or ():
        if name == HEADER and isinstance(value, Undecodable):
            return value
    return None
