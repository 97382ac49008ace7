"""`jlight serve` (or a wrapper of it) as a subprocess on 127.0.0.1, for the end-to-end server tests, and an ASGI
app served in a thread of the test process (serve_in_thread)."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(cmd: list[str], port: int, log_path: str, start_timeout_s: float = 300):
    """Run `cmd` (a server listening on `port`) with its output in `log_path`; yields (url, proc) once
    /health answers 200, and kills the process at the end if it still runs."""
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + start_timeout_s
        while True:
            assert proc.poll() is None, f"server exited: {open(log_path).read()[-3000:]}"
            assert time.time() < deadline, f"server did not come up in {start_timeout_s} s"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        try:
            yield url, proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def serve_in_thread(app, start_timeout_s: float = 20):
    """Serve the ASGI `app` with uvicorn on a free port in a daemon thread; yields its URL, then stops it."""
    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + start_timeout_s
    while not srv.started:
        assert time.time() < deadline, "the app's server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{srv.config.port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
