"""Event log: an append-only file of received KV event batches, resets and resyncs, and its reader.

File format: the 8-byte magic ``KVRLOG1\\n``, then records, each a header of two
big-endian uint32 (body length, CRC-32 of the body) followed by the body, a msgpack
:class:`LogRecord`. A crash mid-write leaves a torn last record (short, or failing its
CRC); the reader detects and skips it, and a writer reopening the file cuts it off before
appending. A bad record anywhere else is corruption and raises :class:`EventLogError`.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Final, Literal

import msgspec

from events.errors import EventsError
from events.identity import WorkerId
from events.schema import KVEventBatch, decode_batch
from events.subscriber import ReceivedBatch

__all__ = [
    "LOG_MAGIC",
    "EventLogError",
    "EventLogWriter",
    "EventRecorder",
    "LogRecord",
    "RecordKind",
    "last_batch_seqs",
    "read_log",
]

_log = logging.getLogger(__name__)

LOG_MAGIC: Final = b"KVRLOG1\n"
_HEADER: Final = struct.Struct(">II")

RecordKind = Literal["batch", "reset", "resync"]


class EventLogError(EventsError, ValueError):
    """A file is not an event log, or a record before its end is corrupt."""


class LogRecord(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One entry of the event log.

    Attributes:
        recv_ts: Wall-clock time in seconds when the subscriber received it.
        worker_id: The worker it concerns.
        kind: ``"batch"`` (a delivered batch), ``"reset"`` (publisher restart) or
            ``"resync"`` (batches lost for good).
        seq: The batch's seq, or the seq that revealed the reset; ``None`` for a resync.
        payload: The raw msgpack batch as received (``b""`` unless ``kind == "batch"``).
        replayed: Whether the batch came through replay.
        reason: Why a resync was needed (``""`` otherwise).
    """

    recv_ts: float
    worker_id: WorkerId
    kind: RecordKind
    seq: int | None
    payload: bytes = b""
    replayed: bool = False
    reason: str = ""

    def decode(self) -> KVEventBatch:
        """The batch in :attr:`payload`.

        Raises:
            EventDecodeError: The payload is not a valid batch.
        """
        return decode_batch(self.payload)

    @classmethod
    def of_batch(cls, received: ReceivedBatch) -> LogRecord:
        """The ``"batch"`` record of a batch the subscriber delivered."""
        return cls(
            received.recv_ts,
            received.worker_id,
            "batch",
            received.seq,
            received.payload,
            received.replayed,
        )


_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(LogRecord)


def _scan(stream: BinaryIO, path: Path) -> Iterator[tuple[int, LogRecord]]:
    """Yield ``(end offset, record)`` for every intact record; stop at a torn tail."""
    magic = stream.read(len(LOG_MAGIC))
    if magic != LOG_MAGIC:
        raise EventLogError(f"{path} is not a kvroute event log (starts with {magic[:8]!r})")
    size = os.fstat(stream.fileno()).st_size
    offset = len(LOG_MAGIC)
    while offset < size:
        header = stream.read(_HEADER.size)
        length, crc = _HEADER.unpack(header) if len(header) == _HEADER.size else (size, 0)
        end = offset + _HEADER.size + length
        body = stream.read(length) if end <= size else b""
        intact = end <= size and zlib.crc32(body) == crc
        if end > size or (end == size and not intact):
            _log.warning(
                "%s: skipped a torn last record at byte %d (%d bytes)", path, offset, size - offset
            )
            return
        if not intact:
            raise EventLogError(
                f"{path}: corrupt record at byte {offset} (CRC mismatch) before the end of "
                "the log; only a torn last record can be skipped"
            )
        try:
            record = _decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise EventLogError(f"{path}: undecodable record at byte {offset}: {exc}") from exc
        offset = end
        yield offset, record


def read_log(path: str | os.PathLike[str]) -> Iterator[LogRecord]:
    """Yield the records of an event log in the order they were written.

    A torn last record is logged and skipped, so a log still being written (or left by a
    crash) reads cleanly up to its last intact record.

    Raises:
        EventLogError: The file is not an event log, or a record before the last is corrupt.
        OSError: The file cannot be read.
    """
    log_path = Path(path)
    with log_path.open("rb") as stream:
        for _, record in _scan(stream, log_path):
            yield record


def last_batch_seqs(path: str | os.PathLike[str]) -> dict[WorkerId, int]:
    """The seq of each worker's last batch in an event log so far (empty while the file is
    missing or holds no record): how far a recorder that is still writing has got.

    Raises:
        EventLogError: The file is not an event log, or a record before the last is corrupt.
    """
    log_path = Path(path)
    last: dict[WorkerId, int] = {}
    if log_path.exists() and log_path.stat().st_size > len(LOG_MAGIC):
        for record in read_log(log_path):
            if record.kind == "batch" and record.seq is not None:
                last[record.worker_id] = record.seq
    return last


class EventLogWriter:
    """Appends records to an event log; creates the file or continues an existing one.

    Records are buffered; :meth:`flush` hands them to the OS and :meth:`close` also
    fsyncs. Reopening a log whose last record is torn cuts that record off first.

    Args:
        path: The log file.

    Raises:
        EventLogError: The file exists and is not an event log, or is corrupt.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.num_records = 0
        """Records written by this writer."""
        end = 0
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open("rb") as stream:
                end = len(LOG_MAGIC)
                for record_end, _ in _scan(stream, self.path):
                    end = record_end
        self._file = self.path.open("r+b" if end else "wb")
        if end:
            self._file.truncate(end)
            self._file.seek(end)
        else:
            self._file.write(LOG_MAGIC)
            self._file.flush()

    def write(self, record: LogRecord) -> None:
        """Append one record."""
        body = _encoder.encode(record)
        self._file.write(_HEADER.pack(len(body), zlib.crc32(body)))
        self._file.write(body)
        self.num_records += 1

    def flush(self) -> None:
        """Hand buffered records to the OS (readers then see them)."""
        self._file.flush()

    def close(self) -> None:
        """Flush, fsync and close (idempotent)."""
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def __enter__(self) -> EventLogWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class EventRecorder:
    """An :class:`~events.subscriber.EventSink` that appends everything it is told to a log.

    Batches arrive after gap recovery, so the log holds each worker's batches in seq order,
    with resets and resyncs where they happened.
    """

    def __init__(self, writer: EventLogWriter) -> None:
        self.writer = writer

    async def on_batch(self, received: ReceivedBatch) -> None:
        self.writer.write(LogRecord.of_batch(received))

    async def on_reset(self, worker_id: WorkerId, seq: int) -> None:
        self.writer.write(LogRecord(time.time(), worker_id, "reset", seq))

    async def on_resync_needed(self, worker_id: WorkerId, reason: str) -> None:
        self.writer.write(LogRecord(time.time(), worker_id, "resync", None, reason=reason))
