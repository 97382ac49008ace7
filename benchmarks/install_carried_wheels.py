"""Install wheels carried to an offline machine, and check that their requirements are met.

    python3 benchmarks/install_carried_wheels.py WHEEL_DIR TARGET   (then: export PYTHONPATH=TARGET)

1. pip-installs WHEEL_DIR/*.whl into TARGET (--target, no index, no dependencies).
2. Checks every requirement of the wheels in TARGET (extras and markers that do not apply
   skipped) against what Python sees with TARGET first on the path, which is what
   PYTHONPATH=TARGET gives: TARGET's copies shadow the image's.
3. For each requirement not met, installs WHEEL_DIR/fallback/<name>-*.whl if there is one
   (e.g. a newer typing-extensions than the image's) and checks again. Fallback wheels are
   installed only when needed, because anything in TARGET shadows the image's own copy.
Exits 1 naming what is still missing or too old.
"""
from __future__ import annotations

import glob
import importlib
import importlib.metadata as md
import os
import re
import subprocess
import sys

from packaging.requirements import Requirement


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_install(wheels: list[str], target: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", target, *wheels], check=True)


def unmet_requirements(target: str) -> list[tuple[str, str, str]]:
    """(name, requirement, version found) for each requirement of TARGET's packages not met."""
    if target not in sys.path:
        sys.path.insert(0, target)
    importlib.invalidate_caches()
    found = {}
    for dist in md.distributions():  # in path order: TARGET's copy first
        found.setdefault(_norm(dist.metadata["Name"]), dist.version)
    unmet = []
    for dist in md.distributions(path=[target]):
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = found.get(_norm(req.name))
            if have is None or not req.specifier.contains(have, prereleases=True):
                unmet.append((_norm(req.name), f"{req} (for {dist.metadata['Name']})", have or "not installed"))
    return unmet


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    wheel_dir, target = argv
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    if not wheels:
        print(f"install_carried_wheels: no wheels in {wheel_dir}", file=sys.stderr)
        return 1
    pip_install(wheels, target)
    installed = [os.path.basename(w).split("-")[0] for w in wheels]
    tried: set[str] = set()
    while True:  # a fallback can itself need another one
        unmet = unmet_requirements(target)
        if not unmet:
            print(f"installed {len(installed)} wheels into {target}: {', '.join(installed)}; all requirements met")
            return 0
        fallbacks = []
        for name, _req, _have in unmet:
            fallbacks += [w for w in glob.glob(os.path.join(wheel_dir, "fallback", "*.whl"))
                          if _norm(os.path.basename(w).split("-")[0]) == name and w not in tried | set(fallbacks)]
        if not fallbacks:
            break
        tried.update(fallbacks)
        print("requirements not met by the image: " + "; ".join(f"{r}: found {h}" for _, r, h in unmet))
        print("installing fallback wheels: " + ", ".join(os.path.basename(w) for w in fallbacks))
        pip_install(fallbacks, target)
        installed += [os.path.basename(w).split("-")[0] for w in fallbacks]
    print("install_carried_wheels: requirements still not met: " + "; ".join(f"{r}: found {h}" for _, r, h in unmet),
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
