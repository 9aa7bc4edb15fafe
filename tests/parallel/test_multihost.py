"""Two processes on 127.0.0.1 serve one engine (`jaxpage.distributed`): 4 virtual CPU
devices each, tensor parallel over all 8 with gloo collectives. The oracle is one device in
one process serving the same workload (tp_worker.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from test_tensor_parallel import run_worker

HERE = os.path.dirname(os.path.abspath(__file__))


def start_pair(path: str, mode: str) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [subprocess.Popen([sys.executable, os.path.join(HERE, "mh_worker.py"), str(pid),
                              str(port), path, mode],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for pid in (0, 1)]


def model_path() -> str:
    proc = subprocess.run([sys.executable, os.path.join(HERE, "tp_worker.py"), "model_dir",
                           "llama8"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_processes_give_one_device_tokens():
    single = run_worker("tokens", "llama8", "cpp", "")["1"]
    procs = start_pair(model_path(), "workload")
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    result = json.loads(outs[0][0].strip().splitlines()[-1])
    assert result["tokens"] == single["tokens"]
    assert (result["preemptions"], result["hits"]) == (single["preemptions"], single["hits"])


@pytest.mark.slow  # ~32 s, most of it the survivor's 20 s deadline
def test_a_dead_process_makes_the_other_fail_clearly():
    """Killing process 1 mid-run makes process 0 exit with an error naming what it waited
    for, within its call deadline (20 s here), instead of hanging."""
    procs = start_pair(model_path(), "loop")
    try:
        leader, follower = procs
        for _ in range(100):  # gloo prints its connections there first
            line = leader.stdout.readline()  # blocks until the first request is served
            if line.strip() == "generating" or not line:
                break
        if line.strip() != "generating":
            leader.kill()
            raise AssertionError(leader.stderr.read()[-3000:])
        follower.kill()
        start = time.monotonic()
        leader.wait(timeout=120)
        waited = time.monotonic() - start
        err = leader.stderr.read()
    finally:
        for p in procs:
            p.kill()
    assert leader.returncode != 0
    assert waited < 90
    assert "stopped answering" in err or "heartbeat" in err.lower(), err[-3000:]
