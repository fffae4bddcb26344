"""Kernel binaries in the artifact (``kernels/triton-<version>-<arch>/``): the selection for this
machine with one log line when none match, Triton's cache manager reading shipped binaries (their
group files written elsewhere) before the user's cache, and the write-back of what was compiled or
read from the user's cache.
The GPU side (a second start compiles nothing) is tests/e2e/test_gpu_kernel_cache.py."""

from __future__ import annotations

import json
import logging
import shutil
import threading

import pytest
import triton
from triton.runtime.cache import triton_key

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.kernel_cache import KernelCache, KernelKey, hash_triton_early, select_binaries
from tests.support.hf_models import make_hf_model

MACHINE = KernelKey(triton.__version__, "sm_90")  # the machine the tests pretend to be


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kernel_cache")
    source = make_hf_model("llama3", tmp / "src")
    return compile_model(source, tmp / "m.kiln", CompileOptions(dtype="fp32", max_batch_tokens=32,
                                                                max_batch_size=4, max_seq_len=64))


@pytest.fixture
def artifact(compiled, tmp_path):
    copy = tmp_path / "m.kiln"
    shutil.copytree(compiled, copy)
    return copy


def ship(artifact, key: KernelKey, cache_key: str = "KEY0") -> None:
    """A cache entry as Triton writes one, its group naming members by where they were written."""
    entry = artifact / "kernels" / key.dir_name / cache_key
    entry.mkdir(parents=True)
    (entry / "k.cubin").write_bytes(b"\x7fELF")
    (entry / "k.json").write_text("{}")
    written_at = f"/home/someone/.triton/cache/{cache_key}"
    (entry / "__grp__k.json").write_text(json.dumps({"child_paths": {
        "k.cubin": f"{written_at}/k.cubin", "k.json": f"{written_at}/k.json"}}))


@pytest.mark.parametrize("shipped, reason", [
    (KernelKey("3.5.0", "sm_90"), f"triton-3.5.0-sm_90: triton 3.5.0 != {triton.__version__}"),
    (KernelKey(triton.__version__, "sm_100"), "sm_100 != sm_90"),
])
def test_binaries_of_another_triton_or_gpu_fall_back_to_jit_with_one_line(artifact, caplog, shipped, reason):
    ship(artifact, shipped)
    path, why = select_binaries(artifact, MACHINE)
    assert path is None and why == f"{shipped.dir_name}: {reason}" or why == reason
    assert reason in why
    with caplog.at_level(logging.INFO, logger="kiln.kernel_cache"):
        cache = KernelCache(artifact, MACHINE)
    assert cache.shipped is None
    assert [r.getMessage() for r in caplog.records] == [f"Triton kernels: JIT, {why}"]  # one line, saying why


def test_an_artifact_without_binaries_says_so(artifact):
    assert select_binaries(artifact, MACHINE) == (
        None, f"the artifact holds no Triton kernel binaries (for triton-{triton.__version__}-sm_90)")


def test_matching_binaries_are_read_first_wherever_they_were_written(artifact, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "user-cache"))
    ship(artifact, KernelKey("3.5.0", "sm_90"))
    ship(artifact, MACHINE)
    cache = KernelCache(artifact, MACHINE)
    assert cache.shipped == artifact / "kernels" / MACHINE.dir_name
    manager = cache.manager_class("KEY0")
    here = cache.shipped / "KEY0"
    assert manager.get_group("k.json") == {"k.cubin": str(here / "k.cubin"), "k.json": str(here / "k.json")}
    assert manager.get_file("k.cubin") == str(here / "k.cubin")
    assert cache.manager_class("OTHER").get_file("k.cubin") is None  # not shipped, not in the user's cache
    assert cache.save() is None  # nothing compiled here


def test_what_triton_compiles_is_saved_into_the_artifact(artifact, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "user-cache"))
    cache = KernelCache(artifact, MACHINE)
    manager = cache.manager_class("NEWKEY")  # what triton.compile does on a miss
    cubin = manager.put(b"binary", "k.cubin")
    manager.put_group("k.json", {"k.cubin": cubin})
    saved = cache.save()
    assert saved == artifact / "kernels" / MACHINE.dir_name
    assert sorted(p.name for p in (saved / "NEWKEY").iterdir()) == ["__grp__k.json", "k.cubin"]
    # The next start on this machine reads them from the artifact.
    again = KernelCache(artifact, MACHINE)
    assert again.manager_class("NEWKEY").get_group("k.json") == {"k.cubin": str(saved / "NEWKEY" / "k.cubin")}


def test_kernels_read_from_the_users_cache_are_saved_into_the_artifact(artifact, tmp_path, monkeypatch):
    # An earlier process on this machine compiled the kernel (``kiln compile --warm`` after other
    # starts): this one reads it from the user's cache, and the artifact still gets it.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "user-cache"))
    earlier = KernelCache(artifact, MACHINE).manager_class("OLDKEY")
    earlier.put_group("k.json", {"k.cubin": earlier.put(b"binary", "k.cubin")})
    cache = KernelCache(artifact, MACHINE)
    manager = cache.manager_class("OLDKEY")
    assert manager.get_group("k.json") is not None and manager.get_file("k.cubin") is not None
    saved = cache.save()
    assert sorted(p.name for p in (saved / "OLDKEY").iterdir()) == ["__grp__k.json", "k.cubin"]
    assert KernelCache(artifact, MACHINE).shipped == saved


def test_a_read_only_artifact_keeps_new_binaries_in_the_users_cache(artifact, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "user-cache"))
    cache = KernelCache(artifact, MACHINE)
    cache.manager_class("NEWKEY").put(b"binary", "k.cubin")
    # Where the binaries would go cannot be made a directory (as on a read-only file system; a
    # permission bit would not stop root).
    (artifact / "kernels" / MACHINE.dir_name).write_text("")
    with caplog.at_level(logging.INFO, logger="kiln.kernel_cache"):
        assert cache.save() is None
    assert "stay in the user's cache" in caplog.text
    assert (tmp_path / "user-cache" / "NEWKEY" / "k.cubin").is_file()


def test_triton_files_are_hashed_on_a_thread():
    """``hash_triton_early`` leaves Triton's own-files hash (every kernel cache key's start) computed,
    so the first kernel lookup of the warm-up finds it cached."""
    triton_key.cache_clear()
    hash_triton_early()
    for thread in threading.enumerate():
        if thread.name == "kiln-triton-key":
            thread.join()
    assert triton_key.cache_info().currsize == 1
