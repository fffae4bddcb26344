"""The server's count of samples in flight, shared by its API server processes: one process's
admissions count against another's ceiling, and concurrent admissions from several processes never
pass it (real processes on one file)."""

from __future__ import annotations

import multiprocessing

from kiln.server.in_flight import SamplesInFlight


def test_one_api_server_counts_alone():
    count = SamplesInFlight()
    assert count.reserve(3, ceiling=4) and not count.reserve(2, ceiling=4) and count.total() == 3
    count.release(3)
    assert count.reserve(4, ceiling=4) and count.reserve(100, ceiling=None) and count.total() == 104


def test_api_servers_share_one_ceiling(tmp_path):
    path = str(tmp_path / "in_flight")
    SamplesInFlight.create(path, 2)
    first, second = SamplesInFlight(path, 0, 2), SamplesInFlight(path, 1, 2)
    assert first.reserve(3, ceiling=5)
    assert not second.reserve(3, ceiling=5) and second.reserve(2, ceiling=5)
    assert first.total() == second.total() == 5
    first.release(3)
    assert second.reserve(3, ceiling=5) and second.total() == 5


def _admit_many(path: str, slot: int, attempts: int, ceiling: int, admitted) -> None:
    count = SamplesInFlight(path, slot, 4)
    admitted[slot] = sum(count.reserve(1, ceiling) for _ in range(attempts))


def test_concurrent_admissions_from_four_processes_stop_exactly_at_the_ceiling(tmp_path):
    path = str(tmp_path / "in_flight")
    SamplesInFlight.create(path, 4)
    admitted = multiprocessing.Array("i", 4)
    workers = [multiprocessing.Process(target=_admit_many, args=(path, slot, 2000, 5000, admitted))
               for slot in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert sum(admitted) == 5000 == SamplesInFlight(path, 0, 4).total()
