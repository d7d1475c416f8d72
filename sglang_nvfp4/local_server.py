"""Start and stop a real ``sglang.launch_server`` on 127.0.0.1 (CPU or GPU) and talk to it.

Used by the CPU server tests, the soak test, the README's main job and the bench scripts, which
also start SGLang's offline benchmarks with this module's environment and process-group handling
(:func:`sglang_process`, :func:`start_process_group`, :func:`stop_process_group`). On a CPU-only
machine it runs SGLang's CPU engine (``--device cpu``, ``SGLANG_USE_CPU_ENGINE=1``) and, when
``sgl_kernel`` is not installed, puts the pure-torch stand-in of :mod:`sglang_nvfp4.cpu_compat` on the
server's path.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from . import cpu_compat


# Server ports come from below Linux's ephemeral range (32768-60999 by default). A port the kernel hands out
# for bind(("", 0)) is handed out again to the next such bind: with --tp-size 2 on the CPU, the server's own
# gloo sockets took the HTTP port before the server bound it ("address already in use", seen once in `make test`).
_SERVER_PORTS = range(20000, 32000)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, outside the ephemeral range (see ``_SERVER_PORTS``)."""
    rng = random.Random()
    for _ in range(100):
        port = rng.choice(_SERVER_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_SERVER_PORTS.start}-{_SERVER_PORTS.stop - 1} on 127.0.0.1")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_tp_env(tp: int, env: dict) -> dict:
    """Environment for SGLang 0.5.23's CPU engine at ``--tp-size tp`` on an ordinary (non-AMX) host:

    * ``SGLANG_CPU_OMP_THREADS_BIND``: without it SGLang allows at most one rank per NUMA node; the
      visible cores are split evenly between the ranks instead.
    * ``OMP_NUM_THREADS``: each rank's share of the cores. SGLang pins a rank's threads to its cores only with
      the AMX / arm64 kernels; elsewhere every rank started one OpenMP thread per visible core, and two ranks
      of two threads on two cores spun on each other (``tests/test_server_tp_cpu.py``'s five requests: 25 s,
      against 4 s with one thread per rank).
    * ``SGLANG_NCCL_SO_PATH`` set to a path that does not exist: with a CUDA build of torch SGLang
      loads NCCL for the CPU group and then fails on ``torch.cuda.device("cpu")``; a library that
      cannot be loaded disables that communicator, and the ranks all-reduce through gloo.

    Values already in ``env`` are kept."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise ValueError(f"--tp-size {tp} on CPU needs at least {tp} cores, {len(cores)} visible")
    share = len(cores) // tp
    groups = [cores[i * share:(i + 1) * share] for i in range(tp)]
    bind = "|".join(",".join(map(str, g)) for g in groups)
    return {"SGLANG_CPU_OMP_THREADS_BIND": env.get("SGLANG_CPU_OMP_THREADS_BIND", bind),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", str(share)),
            "SGLANG_NCCL_SO_PATH": env.get("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl-disabled-for-cpu-tp.so")}


def sglang_process(args, env: dict | None = None) -> tuple[list, dict]:
    """Command line and environment for a process that runs SGLang on this host: a server, or one of
    SGLang's offline benchmarks. Without CUDA that is SGLang's CPU engine (``--device cpu``,
    ``SGLANG_USE_CPU_ENGINE=1``, the :mod:`~sglang_nvfp4.cpu_compat` stand-in on ``PYTHONPATH`` when
    ``sgl_kernel`` is missing, :func:`cpu_tp_env` at ``--tp-size`` > 1); with CUDA both pass unchanged.
    ``env`` defaults to this process's environment; neither argument is modified."""
    args, env = list(args), dict(os.environ if env is None else env)
    if cuda_available():
        return args, env
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    if cpu_compat.needs_stand_in():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [cpu_compat.stand_in_path(), env.get("PYTHONPATH")]))
    flag = next((f for f in ("--tp-size", "--tensor-parallel-size") if f in args), None)  # both SGLang spellings
    tp = int(args[args.index(flag) + 1]) if flag else 1
    if tp > 1:
        env.update(cpu_tp_env(tp, env))
    return [*args, "--device", "cpu"], env


def start_process_group(args: list, env: dict, log_file, pgid_file: str | None = None) -> subprocess.Popen:
    """Start ``args`` with stdout and stderr in the open binary ``log_file``, in a session of its own: its
    process group then holds SGLang's scheduler and detokenizer processes too, and
    :func:`stop_process_group` ends them all. The group id is appended to ``pgid_file`` (one a line) if
    given, so that a supervisor can end the group should this process be killed outright."""
    process = subprocess.Popen(args, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    if pgid_file is not None:
        with open(pgid_file, "a") as f:
            f.write(f"{process.pid}\n")
    return process


def stop_process_group(process: subprocess.Popen, timeout: float = 60.0, *, leader_first: bool = False) -> int:
    """SIGTERM the process group that ``process`` leads (``leader_first``: the leader alone, which then stops
    its own children), wait up to ``timeout`` s, SIGKILL the group if the leader lingers; then SIGKILL whatever
    of the group outlived its leader (SGLang's scheduler or detokenizer processes holding memory). Returns the
    leader's exit code. A second call only returns it: by then the group id may belong to someone else.

    An SGLang server stops cleanly (exit code 0) on a SIGTERM to itself alone; a SIGTERM to its whole group
    reaches the scheduler too, whose death makes the server SIGKILL its own process tree (exit code -9)."""
    if getattr(process, "group_stopped", False):
        return process.returncode
    if process.poll() is None:
        if leader_first:
            process.send_signal(signal.SIGTERM)
        else:
            _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
    _signal_group(process.pid, signal.SIGKILL)
    process.group_stopped = True
    return process.returncode


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


class LocalServer:
    """``with LocalServer(model, "nvfp4_sparse") as srv: srv.generate("hi")``."""

    def __init__(self, model_path: str, attention_backend: str, *, extra_args=(), log_path: str | None = None,
                 startup_timeout: float = 600.0, env: dict | None = None, pgid_file: str | None = None):
        """``pgid_file``: append the server's process group id to this file when it starts (see
        :func:`start_process_group`)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or os.path.join(model_path, f"server-{attention_backend}-{self.port}.log")
        self.args, self.env = sglang_process(
            [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", "127.0.0.1",
             "--port", str(self.port), "--attention-backend", attention_backend, *extra_args], env)
        self.startup_timeout, self.pgid_file = startup_timeout, pgid_file
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "LocalServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        with open(self.log_path, "wb") as log_file:
            self.process = start_process_group(self.args, self.env, log_file, self.pgid_file)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode} during start-up:\n{self.log_tail()}")
            try:
                self.get("/health_generate", timeout=60)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"server not ready after {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """Stop the server (SIGTERM to it alone, then its process group: :func:`stop_process_group`);
        returns the exit code, 0 for a clean stop."""
        if self.process is None:
            return None
        return stop_process_group(self.process, timeout, leader_first=True)

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-chars:]

    def get(self, path: str, timeout: float = 30.0):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body.strip().startswith((b"{", b"[")) else body.decode()

    def post(self, path: str, payload: dict, timeout: float = 600.0):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body.strip().startswith((b"{", b"[")) else body.decode()

    def flush_cache(self, wait_s: float = 60.0) -> None:
        """Empties the radix cache. SGLang refuses a flush (HTTP 400) while a request is still being retired,
        which can be just after its response arrived; ``wait_s`` lets the scheduler wait that long for idle."""
        self.post(f"/flush_cache?timeout={wait_s}", {}, timeout=wait_s + 30.0)

    def generate(self, text: str, max_new_tokens: int = 8, **extra) -> dict:
        """Greedy generation; returns SGLang's JSON (``text``, ``meta_info``)."""
        payload = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
        payload.update(extra)
        return self.post("/generate", payload)
