"""A real ``kiln serve`` subprocess for tests: started on a free loopback port, waited on until
``/health`` answers, its children found through /proc, stopped with SIGTERM (then SIGKILL)."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "test-key"
MODEL = "smol"
START_TIMEOUT_S = 300


def tiny_artifact(tokenizer_dir: Path, root: Path, max_seq_len: int = 512, **compile_options) -> Path:
    """A tiny random Llama in SmolLM2's vocabulary, with its tokenizer, compiled for the CPU (fp32, torch
    backend) under ``root``: a model ``kiln serve`` answers text with in milliseconds a token."""
    from kiln import compile as compile_model
    from tests.support.hf_models import make_tokenized_model

    source = make_tokenized_model("llama3", root / "src", tokenizer_dir, max_position_embeddings=max_seq_len)
    return compile_model(str(source), str(root / "tiny.kiln"), dtype="fp32", backend="torch", max_seq_len=max_seq_len,
                         **compile_options)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, artifact: Path, log_path: Path, *extra: str, api_key: str | None = API_KEY,
                 served_model_name: str | None = MODEL, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        args = [sys.executable, "-m", "kiln", "serve", str(artifact), "--port", str(self.port), "--device", "cpu",
                "--kv-cache-tokens", "8192", *extra]
        if served_model_name:
            args += ["--served-model-name", served_model_name]
        if api_key:
            args += ["--api-key", api_key]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"kiln serve did not become healthy in {timeout} s:\n{self.log()[-4000:]}")

    def __enter__(self) -> "ServerProcess":
        """The server once healthy (stopped if it never gets there); stopped on the way out."""
        try:
            return self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pids(self) -> list[int]:
        return children_of(self.proc.pid)

    def ipc_dir(self) -> Path:
        """The private socket directory, read from a child's command line (its JSON argument)."""
        for pid in self.child_pids():
            argv = [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
            return Path(json.loads(argv[-1])["ipc_dir"])
        raise RuntimeError("no child processes")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def environ_of(pid: int) -> dict[str, str]:
    """A live process's environment, from /proc."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # exited while we looked
            # The command name (2nd field) may hold spaces and parentheses: split after the last ')'.
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid == pid:
                found.append(int(entry.name))
    return found


def started_by(server_pid: int) -> list[int]:
    """Live kiln child processes of that server, found by the parent pid in their JSON argument: this
    finds them even after they were re-parented (orphans)."""
    marker = f'"parent_pid": {server_pid},'.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"kiln.server." in cmdline and marker in cmdline and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return not re.search(r"^State:\s+Z", status, re.M)  # a zombie has exited


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after waiting up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def metrics(server: ServerProcess) -> dict[str, float]:
    """Every sample of the server's /metrics by its name (labels included, as printed)."""
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text
    return {name: float(value) for name, value in re.findall(r"^(\S+) (\S+)$", text, re.M)}


def metric(server: ServerProcess, name: str) -> float:
    samples = metrics(server)
    assert name in samples, f"{name} not in /metrics"
    return samples[name]


def wait_metric(server: ServerProcess, name: str, predicate, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = metric(server, name)
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.1)

