"""The collector pause around CUDA graph captures (the captures themselves run in tests/e2e/test_gpu*.py)."""

import gc

import pytest

from kiln.runtime.worker.graph_capture import collector_paused


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_is_off_inside_and_as_it_was_after(enabled):
    (gc.enable if enabled else gc.disable)()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("a failed capture")
        assert gc.isenabled() == enabled
    finally:
        gc.enable()
