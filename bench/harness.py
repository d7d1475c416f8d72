"""What the bench scripts share (``bench_e2e.py`` with its ``e2e_*.py`` steps, ``bench_tp.py``).

* :func:`log`: time-stamped progress lines on stdout.
* :class:`BenchRun`: one run of a script under ``--out``: its time budget (``--budget-s``, so that the
  script ends inside one 10-minute device call), its results dict (written whole after every finished
  run, so that a run cut short still leaves its numbers), and the SGLang processes it starts.
  SGLang servers are :class:`~sglang_nvfp4.local_server.LocalServer`; the benchmark children (SGLang's
  ``one_batch`` and ``offline_throughput``) get the same environment and shutdown from
  :mod:`sglang_nvfp4.local_server`. Every one leads a process group of its own, listed in
  ``child_pgids.txt`` under ``--out``: ``gpu_setup.sh``'s ``kill_leftovers`` ends those groups should
  the script be killed outright.
* :func:`exit_on_sigterm`, :func:`file_tail`, :func:`add_int_options`: small pieces of the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from sglang_nvfp4.local_server import LocalServer, sglang_process, start_process_group, stop_process_group

# SGLang server flags of bench_e2e's server step and of bench_tp's default --server-args.
COMMON_SERVER_ARGS = ["--page-size", "128", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.6"]
PGID_FILE = "child_pgids.txt"  # read by kill_leftovers in gpu_setup.sh


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def file_tail(path: str, chars: int = 2500) -> str:
    """The last ``chars`` characters of a log file; empty if it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def exit_on_sigterm() -> None:
    """Turn SIGTERM (the device scripts' ``timeout``) into ``SystemExit``, so that the scripts' ``finally``
    blocks still stop their children and save the results."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def add_int_options(parser, **defaults: int) -> None:
    """One ``--name`` option of type int per keyword (underscores become dashes), with its default: for
    the runs of plain sizes and counts in the scripts' command lines."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)


class BenchRun:
    """One run of a bench script: the output folder, the time budget, the results and the child processes.

    ``results`` opens with the date, the command line, the budget and the ``NVFP4_SPARSE_*`` environment (which the
    servers inherit: a run with ``NVFP4_SPARSE_PREDECODE=off`` says so); :meth:`save` writes it whole to
    ``results_name`` under ``out_dir`` (atomically), and the scripts call it after every finished run."""

    def __init__(self, out_dir: str, results_name: str, budget_s: float):
        self.deadline = time.monotonic() + budget_s
        self.budget_s = budget_s
        self.out_dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.results_path = self.path(results_name)
        self.results: dict = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv, "budget_s": budget_s,
                              "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NVFP4_SPARSE_")}}
        self._children: list[subprocess.Popen] = []

    def path(self, name: str) -> str:
        return os.path.join(self.out_dir, name)

    def save(self) -> None:
        tmp = self.results_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=1, default=float)
        os.replace(tmp, self.results_path)

    # ---- time budget ----
    def left(self) -> float:
        """Seconds of the budget left (negative once it is spent)."""
        return self.deadline - time.monotonic()

    def spent(self) -> float:
        return self.budget_s - self.left()

    def capped(self, seconds: float, *, reserve: float = 0.0, floor: float = 0.0) -> float:
        """A timeout for one piece of work: ``seconds``, cut to what is left of the budget less ``reserve``
        (time kept for what follows), and at least ``floor``."""
        return max(floor, min(seconds, self.left() - reserve))

    def skip_reason(self, label: str, needed: float) -> str | None:
        """None while at least ``needed`` seconds of the budget are left. Otherwise the work called
        ``label`` is not started: that is logged, and the reason to record is returned."""
        left = self.left()
        if left >= needed:
            return None
        log(f"{label}: skipped, {left:.0f} s of the budget left")
        return f"time budget: {left:.0f} s left (< {needed:.0f} s)"

    # ---- processes ----
    def server(self, model_path: str, attention_backend: str, **kwargs) -> LocalServer:
        """A :class:`LocalServer` whose process group goes to ``child_pgids.txt`` when it starts (it stops
        itself: use it as a context manager or call its ``stop``)."""
        return LocalServer(model_path, attention_backend, pgid_file=self.path(PGID_FILE), **kwargs)

    def start_child(self, cmd: list, log_path: str) -> subprocess.Popen:
        """Start ``cmd``, a process that runs SGLang, with :func:`sglang_process`'s environment (the CPU
        engine where there is no GPU), its command line and then its output in ``log_path``."""
        cmd, env = sglang_process(cmd)
        with open(log_path, "ab") as f:
            f.write(("$ " + " ".join(cmd) + "\n").encode())
            f.flush()
            process = start_process_group(cmd, env, f, self.path(PGID_FILE))
        self._children.append(process)
        return process

    def stop_child(self, process: subprocess.Popen, grace: float = 10.0) -> int:
        """Stop a child of :meth:`start_child` and what is left of its process group, SIGKILL after
        ``grace`` s; returns its exit code."""
        if process in self._children:
            self._children.remove(process)
        return stop_process_group(process, grace)

    def stop_children(self, grace: float = 5.0) -> None:
        """Stop every child still running (the script is ending, or was told to)."""
        for process in list(self._children):
            self.stop_child(process, grace)
