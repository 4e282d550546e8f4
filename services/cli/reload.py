"""``kvtier reload``: make the ``kvtier serve`` of a data directory re-read its tokens,
quotas, log level and keyring (``services.server.reload``), as ``kill -HUP`` would, and
say what it did: the server records its process id and each reload's outcome in the data
directory (``services.serving.lifecycle``). Exit 0 when the reload was taken, 1 when the
server refused it (the line says why; the last good version stays in force) or no
outcome came within ``--timeout``, 2 when no server serves that directory.

    kvtier reload --data-dir /var/lib/kvtier
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from services.serving.lifecycle import PID_FILE, read_reload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", default="data", help="the server's data_dir "
                        "(default %(default)s)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for "
                        "the outcome (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir)
    try:
        pid = int((data_dir / PID_FILE).read_text())
        if not _serving(pid):
            raise ProcessLookupError(pid)
        before = read_reload(data_dir)
        os.kill(pid, signal.SIGHUP)
    except (OSError, ValueError):
        print(f"kvtier reload: no kvtier serve runs on data_dir {data_dir} (no live process "
              f"in {data_dir / PID_FILE}): start it, or pass its --data-dir", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        outcome = read_reload(data_dir)
        if outcome is not None and (before is None or outcome[0] > before[0]):
            verdict, _, line = outcome[1].partition(" ")
            print(f"kvtier reload: {line}", file=sys.stdout if verdict == "ok" else sys.stderr)
            return 0 if verdict == "ok" else 1
        time.sleep(0.05)
    print(f"kvtier reload: sent SIGHUP to pid {pid}, no outcome within {args.timeout:g} s: "
          "see the server's log and kvtier_config_reload_success", file=sys.stderr)
    return 1


def _serving(pid: int) -> bool:
    """Whether ``pid`` is a ``kvtier serve`` (where /proc says; a pid file left by a
    crash may name a process that reused the number, which SIGHUP could end)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # no /proc here: trust the pid file
    return b"serve" in command
