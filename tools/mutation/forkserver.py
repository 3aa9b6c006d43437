"""A pytest fork server for mutation runs: torch and megatron-core imported once.

Mutation testing runs the tests once per mutant, and importing torch and megatron-core
takes seconds each time. The server imports them (and pytest) once and forks a child per
request; the child imports this repository's code fresh from disk (the mutant), runs
pytest and exits with pytest's exit code. Nothing of this repository is imported before
the fork, and the child compiles the sources without any bytecode cache, so each run sees
the file as it is now.

    python tools/mutation/forkserver.py SOCKET &          # the server
    python tools/mutation/forkserver.py SOCKET -- ARGS    # a client: pytest ARGS in a child

A client exits with the child's exit code (its output goes to the client's stdout).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time


def _preload() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)  # forked children must not inherit a busy thread pool
    import megatron.core  # noqa: F401
    import pytest  # noqa: F401
    from megatron.core import distributed, full_cuda_graph, optimizer, pipeline_parallel  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    from megatron.core.transformer import cuda_graphs  # noqa: F401


def _child(request: dict, output: int) -> int:
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.chdir(request["cwd"])
    sys.path.insert(0, request["cwd"])
    # Child processes the tests start (a SIGTERM test, torchrun) import the mutant too.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [request["cwd"], os.environ.get("PYTHONPATH")])
    )
    sys.dont_write_bytecode = True
    sys.pycache_prefix = tempfile.mkdtemp(prefix="mutant-pycache-")  # never a stale .pyc
    import pytest

    return int(pytest.main(request["args"]))


CHILD_TIMEOUT_S = 240.0
"""A child still running then (a mutant that loops) is killed: exit code 124."""


def _wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return 124
        time.sleep(0.05)


def serve(path: str) -> None:
    _preload()
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    print(f"forkserver ready on {path}", flush=True)
    while True:
        connection, _ = server.accept()
        with connection:
            request = json.loads(connection.makefile().readline())
            with tempfile.TemporaryFile() as output:
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        code = _child(request, output.fileno())
                    finally:
                        os._exit(code)
                code = _wait(pid, CHILD_TIMEOUT_S)
                output.seek(0)
                connection.sendall(json.dumps({"code": code}).encode() + b"\n")
                connection.sendall(output.read())


def request(path: str, args: list[str]) -> int:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    client.sendall(json.dumps({"cwd": os.getcwd(), "args": args}).encode() + b"\n")
    reader = client.makefile("rb")
    code = json.loads(reader.readline())["code"]
    sys.stdout.buffer.write(reader.read())
    return code


if __name__ == "__main__":
    if "--" in sys.argv:
        split = sys.argv.index("--")
        sys.exit(request(sys.argv[1], sys.argv[split + 1 :]))
    serve(sys.argv[1])
