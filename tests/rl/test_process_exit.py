"""A finished run's ranks close their process groups (the default one and the weight-sync ones) together and then
exit without the interpreter's C++ teardown: groups still held at interpreter shutdown had their worker threads torn
down unjoined, and one process in a few aborted after its work was done ("terminate called without an active
exception"). The exit still finishes what a normal one would: threads, atexit handlers, buffered output."""

from __future__ import annotations

import subprocess

import pytest

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


_UNFLUSHED = """
import sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from openrlhf.utils.process import exit_after_run
pool = ThreadPoolExecutor(1)  # an idle worker waits on its queue until threading's exit callback stops it
pool.submit(time.sleep, 0).result()
def late_write():
    time.sleep(0.5)
    open(sys.argv[1], "w").write("written")
threading.Thread(target=late_write).start()
sys.stdout.write("buffered, not flushed")
exit_after_run(0)
"""


def test_the_exit_keeps_what_a_normal_exit_would(tmp_path):
    # The exit skips the interpreter's teardown, not the run's own shutdown: a thread still writing finishes, an
    # executor's idle worker is stopped rather than waited for (vLLM leaves one), buffered output reaches the pipe.
    target = tmp_path / "late.txt"
    proc = subprocess.run([PY, "-c", _UNFLUSHED, str(target)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "buffered, not flushed" and target.read_text() == "written"


def test_a_failed_run_leaves_the_group_alone():
    # After a failure the peers may be gone; a closing barrier could wait for them forever.
    assert "group open at exit: True" in _exit_with(3)


_SYNC_MEMBER = """
import sys, torch
from jetrl_precision.weight_sync import init_sync_group
rank, port = int(sys.argv[1]), int(sys.argv[2])
group = init_sync_group("127.0.0.1", port, rank, 2, "gloo", timeout_s=60)
t = torch.full((1000,), float(rank))
group.broadcast(t, 0)
print("received", t[0].item(), flush=True)
"""


def test_weight_sync_groups_are_closed_at_exit():
    # Two processes join a standalone weight-sync group (as a trainer and a remote engine do) and simply exit:
    # both end with status 0, the broadcast having arrived. Before the atexit close, 5 of 30 such pairs aborted.
    port = str(free_port())
    peer = subprocess.Popen([PY, "-c", _SYNC_MEMBER, "1", port], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    host = subprocess.run([PY, "-c", _SYNC_MEMBER, "0", port], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    out, err = peer.communicate(timeout=120)
    assert host.returncode == 0, host.stderr[-2000:]
    assert peer.returncode == 0 and "received 0.0" in out, err[-2000:]


def test_a_closed_weight_sync_group_says_so():
    import torch

    from jetrl_precision import weight_sync as ws

    group = ws.init_sync_group("127.0.0.1", free_port(), 0, 1, "gloo", timeout_s=30)
    assert group in ws._LIVE_GROUPS  # closed at exit unless closed before
    t = torch.ones(3)
    group.broadcast(t, 0)
    group.close()
    with pytest.raises(ws.WeightSyncError, match="rank 0 of 1.* is closed"):
        group.broadcast(t, 0)
