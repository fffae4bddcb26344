"""Samples in flight, counted over all of the server's API server processes.

``--max-queued-requests`` is the server's limit: a submission is admitted only if the samples in
flight in every API server together (``kiln serve --api-server-count N``) stay within the engines'
``max_running`` plus the limit. With one API server the count is a plain int. With several it lives
in a small file of the server's ipc directory, mapped into each of them: one int64 slot per API
server, written only by its owner, and the check-and-add of an admission runs under an exclusive
``flock`` of that file, so two API servers admitting at the same moment cannot both take the last
place. Each lock is held for a few memory reads and one write (microseconds).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from typing import Iterator

SLOT_BYTES = 8


class SamplesInFlight:
    def __init__(self, path: str | None = None, slot: int = 0, slots: int = 1) -> None:
        """``path``: the shared file (``create``), None for a server of one API server."""
        self.slot = slot
        self._fd: int | None = None
        if path is None:
            self._counts: list[int] | memoryview = [0]
            self.slot = 0
        else:
            self._fd = os.open(path, os.O_RDWR)
            self._counts = memoryview(mmap.mmap(self._fd, slots * SLOT_BYTES)).cast("q")

    @staticmethod
    def create(path: str, slots: int) -> None:
        """Writes the zeroed file that ``slots`` API servers will share."""
        with open(path, "wb") as file:
            file.write(bytes(slots * SLOT_BYTES))

    def total(self) -> int:
        with self._locked():
            return sum(self._counts)

    def reserve(self, samples: int, ceiling: int | None) -> bool:
        """Counts ``samples`` more in flight unless the server's total would pass ``ceiling`` (None: no
        ceiling); says whether it did."""
        with self._locked():
            if ceiling is not None and sum(self._counts) + samples > ceiling:
                return False
            self._counts[self.slot] += samples
        return True

    def release(self, samples: int) -> None:
        with self._locked():
            self._counts[self.slot] -= samples

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self._fd is None:
            yield
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
