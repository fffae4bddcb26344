"""NVLink multicast stays off in every process kiln starts (it can take shared GPUs out of service).

NCCL's NVLS (``NCCL_NVLS_ENABLE``) and torch's symmetric-memory multicast
(``TORCH_SYMM_MEM_DISABLE_MULTICAST``) are read from the environment when a communicator is made.
``keep_multicast_off`` sets both in this process's environment where they are absent, before any
communicator exists; the processes kiln starts inherit them (``subprocess`` and multiprocessing's
spawn both pass the environment on). A value already set is kept: the machines kiln runs on set
these two themselves, and kiln never turns multicast on.

Called where kiln's processes begin or make communicators: ``kiln``'s command line, ``serve``, a
``WorkerGroup`` (its ranks), a ``KVLink`` (the disaggregation handoff).
"""

from __future__ import annotations

import os

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def keep_multicast_off() -> None:
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
