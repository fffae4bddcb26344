"""The start-up clock: phases timed where they run, a process's own start read from /proc, and the
report the server serves (JSON offsets from the server's start, the summary line, the metric lines)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

from kiln.runtime.startup import Phase, StartupReport, StartupTimer, process_phases, process_started_at
from kiln.server import ipc


def test_a_phase_is_timed_logged_and_kept_in_order(caplog):
    timer = StartupTimer("scheduler")
    with caplog.at_level(logging.INFO, logger="kiln.startup"):
        with timer.phase("weights_load"):
            time.sleep(0.01)
        timer.add("kernel_warmup", 100.0, 2.5)
    assert [p.name for p in timer.phases] == ["weights_load", "kernel_warmup"]
    assert timer.phases[0].seconds >= 0.01 and timer.phases[0].process == "scheduler"
    assert timer.seconds("kernel_warmup") == 2.5 and timer.seconds("graph_capture") == 0.0
    assert "start-up: scheduler weights_load" in caplog.text and "kernel_warmup 2.50 s" in caplog.text


def test_a_phase_that_raises_is_not_recorded(caplog):
    timer = StartupTimer("engine")
    with caplog.at_level(logging.INFO, logger="kiln.startup"), pytest.raises(ValueError), timer.phase("artifact_read"):
        raise ValueError("bad artifact")
    assert timer.phases == [] and caplog.text == ""  # the error is the news: `kiln serve` prints it alone


def test_phases_cross_processes_as_plain_lists():
    timer = StartupTimer("detokenizer")
    timer.add("tokenizer", 10.0, 0.25)
    assert [Phase.from_wire(item) for item in timer.to_wire()] == timer.phases


def test_process_start_is_read_from_proc():
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "from kiln.runtime.startup import process_started_at as s; "
                          "print(repr(s()))"], capture_output=True, text=True, check=True).stdout
    after = time.time()
    # /proc counts in clock ticks (10 ms): the child's start lies between our two readings, give or take one.
    assert before - 0.02 <= float(out) <= after
    assert process_started_at() <= time.time()


def test_a_childs_first_phases_are_spawn_then_imports():
    spawned_at = process_started_at() - 0.5  # as if the parent's Popen came half a second before
    timer = process_phases("scheduler", time.time(), spawned_at)
    spawn, imports = timer.phases
    assert (spawn.name, imports.name) == ("spawn", "imports")
    assert spawn.start == spawned_at and spawn.seconds >= 0.5 and imports.start == spawn.end
    assert [p.name for p in process_phases("http", time.time()).phases] == ["imports"]  # no spawn when not given


def test_the_report_lays_phases_out_from_the_servers_start():
    phases = (Phase("tokenizer", "http", 101.0, 0.5), Phase("imports", "scheduler", 100.2, 1.0),
              Phase("weights_load", "scheduler", 101.2, 0.3))
    report = StartupReport(origin=100.0, ready_at=102.0, phases=phases)
    assert report.to_json() == {"seconds": 2.0, "phases": [
        {"name": "imports", "process": "scheduler", "start": 0.2, "seconds": 1.0},
        {"name": "tokenizer", "process": "http", "start": 1.0, "seconds": 0.5},
        {"name": "weights_load", "process": "scheduler", "start": 1.2, "seconds": 0.3}]}
    assert report.summary() == ("ready in 2.00 s: scheduler/imports 1.00@0.20, http/tokenizer 0.50@1.00, "
                                "scheduler/weights_load 0.30@1.20")
    lines = report.metric_lines()
    assert lines[1] == "# TYPE kiln_startup_seconds gauge"
    assert 'kiln_startup_seconds{phase="weights_load",process="scheduler"} 0.3' in lines
    assert lines[-1] == 'kiln_startup_seconds{phase="ready",process="http"} 2.0'
    # Sent to the other API servers (--api-server-count) as plain data, read back the same.
    assert StartupReport.from_wire(ipc.unpack(ipc.pack(["ready", report.to_wire()]))[1]) == report
