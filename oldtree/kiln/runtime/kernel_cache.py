"""Triton kernel binaries shipped in the artifact, so that a start on a fresh machine compiles none.

An artifact may hold ``kernels/triton-<version>-<arch>/`` (``triton-3.6.0-sm_90``): a Triton file
cache (one directory per cache key, as ``triton.runtime.cache.FileCacheManager`` writes them: the
cubins, their metadata and group files, and the launcher stubs) for that Triton version and GPU
architecture. On a GPU the engine core calls ``install`` before anything launches a kernel: when
the artifact's binaries match this machine, Triton's cache manager (``triton.knobs.cache.manager_class``)
becomes one that reads them first and the user's Triton cache second, so the warm-up finds every
kernel compiled; when they do not, Triton compiles them (JIT) as usual, and ONE log line says why
(``triton 3.5.0 != 3.6.0``, ``sm_90 != sm_100``, or that the artifact holds none).

Either way, what Triton compiles in this process goes to the user's Triton cache (``TRITON_CACHE_DIR``,
by default ``~/.triton/cache``), and ``KernelCache.save`` (after start-up) copies it, and whatever this
process read from that cache rather than from the artifact (kernels an earlier process on this machine
compiled), into the artifact's directory for this machine when the artifact is writable, so the first
start on a GPU warms the artifact for the next and for fresh machines (``kiln compile --warm`` does that
at compile time). A read-only artifact
keeps them in the user's cache, which the next start on this machine reads too.

Triton's full cache key holds more than version and architecture (hashes of its own files, the
backend's options, cache-relevant environment variables): a kernel whose key differs in those
misses alone and is compiled, while the others still load.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from kiln.artifact_format import KERNELS_DIR

log = logging.getLogger("kiln.kernel_cache")

PREFIX = "triton-"
GROUP_PREFIX = "__grp__"


@dataclass(frozen=True, order=True)
class KernelKey:
    """What the shipped binaries are valid for: the Triton version and the GPU architecture."""

    triton_version: str
    arch: str  # "sm_90"

    @property
    def dir_name(self) -> str:
        return f"{PREFIX}{self.triton_version}-{self.arch}"

    @classmethod
    def from_dir_name(cls, name: str) -> "KernelKey | None":
        if not name.startswith(PREFIX) or "-" not in name[len(PREFIX):]:
            return None
        version, arch = name[len(PREFIX):].rsplit("-", 1)
        return cls(version, arch)

    def mismatch(self, machine: "KernelKey") -> str:
        """Why binaries of this key do not serve ``machine`` ("" when they do)."""
        reasons = []
        if self.triton_version != machine.triton_version:
            reasons.append(f"triton {self.triton_version} != {machine.triton_version}")
        if self.arch != machine.arch:
            reasons.append(f"{self.arch} != {machine.arch}")
        return ", ".join(reasons)


def machine_key(device_index: int = 0) -> KernelKey:
    """This machine's key: the installed Triton and the CUDA device's architecture."""
    import torch
    import triton

    major, minor = torch.cuda.get_device_capability(device_index)
    return KernelKey(triton.__version__, f"sm_{major}{minor}")


def select_binaries(artifact: Path, machine: KernelKey) -> tuple[Path | None, str]:
    """The artifact's binaries for ``machine`` (None if none match) and, when none do, why."""
    root = artifact / KERNELS_DIR
    shipped = sorted((key, path) for path in root.glob(f"{PREFIX}*") if path.is_dir()
                     and (key := KernelKey.from_dir_name(path.name)) is not None) if root.is_dir() else []
    for key, path in shipped:
        if key == machine:
            return path, ""
    if not shipped:
        return None, f"the artifact holds no Triton kernel binaries (for {machine.dir_name})"
    return None, "; ".join(f"{key.dir_name}: {key.mismatch(machine)}" for key, _ in shipped)


class KernelCache:
    """The artifact's kernel binaries for this machine, installed as Triton's cache manager."""

    def __init__(self, artifact: Path, machine: KernelKey) -> None:
        self.artifact = artifact
        self.machine = machine
        self.shipped, reason = select_binaries(artifact, machine)
        if self.shipped is None:
            log.info("Triton kernels: JIT, %s", reason)
        else:
            log.info("Triton kernels: from %s", self.shipped)
        # The cache keys this process compiled or read from the user's cache: what the artifact lacks.
        self.unshipped: set[str] = set()
        self.manager_class = _manager_class(self.shipped, self.unshipped)

    def install(self) -> None:
        """Makes Triton read the shipped binaries first (for this whole process)."""
        import triton

        triton.knobs.cache.manager_class = self.manager_class

    def save(self) -> Path | None:
        """Copies what this process compiled or read from the user's Triton cache into the artifact's
        directory for this machine; the directory, or None when nothing was missing there or the
        artifact is not writable (the binaries stay in the user's Triton cache then)."""
        if not self.unshipped:
            return None
        target = self.artifact / KERNELS_DIR / self.machine.dir_name
        try:
            target.mkdir(parents=True, exist_ok=True)
            for key in sorted(self.unshipped):
                _copy_entry(Path(_user_cache_dir()) / key, target / key)
        except OSError as exc:
            log.info("Triton kernels: %d not in the artifact stay in the user's cache (%s): %s",
                     len(self.unshipped), _user_cache_dir(), exc)
            return None
        log.info("Triton kernels: %d saved into %s", len(self.unshipped), target)
        self.unshipped.clear()
        return target


def hash_triton_early() -> None:
    """Starts computing, on a thread, the hash of Triton's own files that every kernel lookup's cache
    key begins with (``triton.runtime.cache.triton_key``: its 400 MB libtriton among them, ~0.3 s,
    once a process), which the warm-up's first kernel would otherwise wait for. The engine core calls
    this first thing on a GPU, so the hash runs beside the CUDA context's creation and the weights'
    load (file reads and sha256 release the GIL). The result is cached by Triton; were the warm-up
    to ask before the thread is done, it would hash again itself, as without this. (On an H100 the
    warm-up took 0.66-0.77 s with this and 0.78-0.79 without, on two hosts: within their noise.)"""
    from triton.runtime.cache import triton_key

    threading.Thread(target=triton_key, name="kiln-triton-key", daemon=True).start()


def _user_cache_dir() -> str:
    import triton

    return triton.knobs.cache.dir


def _copy_entry(source: Path, target: Path) -> None:
    """One cache key's directory, copied whole and renamed into place (readers never see half of
    one; a key already there is the same content, since keys address it)."""
    if target.exists() or not source.is_dir():
        return
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        for file in source.iterdir():
            if file.is_file() and file.name != "lock":
                shutil.copy2(file, staging / file.name)
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not target.exists():
            raise


def _manager_class(shipped: Path | None, unshipped: set[str]) -> type:
    """A ``FileCacheManager`` (the user's Triton cache, where writes go) that looks in ``shipped``
    first and records in ``unshipped`` the keys it writes or finds in the user's cache only."""
    from triton.runtime.cache import FileCacheManager

    class ArtifactCacheManager(FileCacheManager):
        def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
            super().__init__(key, override, dump)
            self._shipped = shipped / key if shipped is not None and not (override or dump) else None
            self._records = not (override or dump)

        def get_file(self, filename: str) -> str | None:
            if self._shipped is not None and (self._shipped / filename).is_file():
                return str(self._shipped / filename)
            return self._recorded(super().get_file(filename))

        def get_group(self, filename: str) -> dict[str, str] | None:
            # A group file names its members by absolute path where they were written: shipped ones
            # are found by name in the shipped directory instead.
            group = self._shipped / f"{GROUP_PREFIX}{filename}" if self._shipped is not None else None
            if group is not None and group.is_file():
                members = json.loads(group.read_text()).get("child_paths") or {}
                found = {name: str(self._shipped / Path(path).name) for name, path in members.items()
                         if (self._shipped / Path(path).name).is_file()}
                if len(found) == len(members):
                    return found
            return self._recorded(super().get_group(filename))

        def put(self, data, filename: str, binary: bool = True) -> str:
            return self._recorded(super().put(data, filename, binary))

        def _recorded(self, found):
            # What the user's cache gave or took (None: a miss) is a key the artifact lacks.
            if found is not None and self._records:
                unshipped.add(self.key)
            return found

    return ArtifactCacheManager


def open_kernel_cache(artifact: Path, device_index: int) -> KernelCache:
    """The kernel cache for serving ``artifact`` on CUDA device ``device_index``, installed."""
    cache = KernelCache(artifact, machine_key(device_index))
    cache.install()
    return cache
