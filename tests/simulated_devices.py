"""Run a test script in a fresh Python process with N simulated CPU devices (JAX fixes the device
count when it starts, so a test that needs a mesh cannot get one in the pytest process).

The script prints one line "RESULT" + json; run_script returns that JSON. simulated_env(N) is the
environment of such a process, for tests that start their own.
"""
import json
import os
import subprocess
import sys


def simulated_env(num_devices: int | None) -> dict:
    """os.environ for a child JAX process on the CPU with num_devices simulated devices (None: JAX's own
    count). The XLA_FLAGS of this process (conftest.py's compile flags, a user's) are kept; only a device
    count among them is replaced."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if num_devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={num_devices}")
    return dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")


def run_script(code: str, num_devices: int, timeout: int = 600):
    env = simulated_env(num_devices)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])
