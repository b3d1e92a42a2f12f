"""Starts tests/python/ranks_job.py as one process, or as 2 ranks launched the way torchrun
launches them (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT), and reads each one's result."""

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "ranks_job.py")
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def result(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def one_process(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, JOB, *args], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    return result(out.stdout)


def two_processes(*args: str) -> list:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), STRATA_COLLECTIVE_TIMEOUT_S="60")
        procs.append(subprocess.Popen([sys.executable, JOB, *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for rank, proc in enumerate(procs):
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"rank {rank} did not finish in {TIMEOUT_S} s (a hang)")
        assert proc.returncode == 0, f"rank {rank}: {stderr[-3000:]}"
        outs.append(result(stdout))
    return outs
