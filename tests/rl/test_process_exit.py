"""A finished run's ranks close their process group together before the interpreter exits."""

from __future__ import annotations

import subprocess

from _rl_helpers import ENV, PY, REPO, free_port

_CHILD = """
import os, sys
import torch.distributed as dist
from openrlhf.utils.process import exit_after_run
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
import atexit
atexit.register(lambda: print("group open at exit:", dist.is_initialized(), flush=True))
exit_after_run(int(sys.argv[1]))
"""


def _exit_with(rc: int) -> str:
    proc = subprocess.run([PY, "-c", _CHILD, str(rc), str(free_port())], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == rc, proc.stderr[-2000:]
    return proc.stdout


def test_a_successful_run_destroys_its_process_group_before_exit():
    # Exiting with a live gloo group let the interpreter tear down its worker threads, and one rank in a few
    # aborted ("terminate called without an active exception"): torchrun reported a finished run as failed.
    assert "group open at exit: False" in _exit_with(0)


def test_a_failed_run_leaves_the_group_alone():
    # After a failure the peers may be gone; a closing barrier could wait for them forever.
    assert "group open at exit: True" in _exit_with(3)
