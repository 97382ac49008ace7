"""Run a test script in a fresh Python process with N simulated CPU devices (JAX fixes the device
count when it starts, so a test that needs a mesh cannot get one in the pytest process).

The script prints one line "RESULT" + json; run_script returns that JSON.
"""
import json
import os
import subprocess
import sys


def run_script(code: str, num_devices: int, timeout: int = 600):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])
