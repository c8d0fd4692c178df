"""The guest's agent in the image (crust.kata.image.build builds with it):
which files the agent needs and their byte-compiled forms.

The interpreter is Debian's python3.11; the standard library modules are
only those the agent imports, measured by importing it under that
interpreter and reading sys.modules, so the set follows the agent's
imports without a list to keep. crust's modules and the protobuf runtime
(the builder's own, the one exception to "only Debian packages", see
crust.kata.image.build) go under PYTHON_PATH. Everything is byte-compiled by the
guest's interpreter into unchecked-hash .pyc files: no source times, so
the archive stays reproducible, and nothing compiles at boot.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from crust.sys.run import CommandError

# The guest's agent: Debian's interpreter (by its full path: another
# python3.11 may come first on PATH), its standard library's directory, and
# the Debian packages that ship both (installed if missing).
PYTHON = "/usr/bin/python3.11"
PYTHON_STDLIB = "/usr/lib/python3.11"
PYTHON_PACKAGES = ("python3.11-minimal", "libpython3.11-stdlib")
# What /init runs (python3.11 -m crust.guest): the package whose __main__ is
# run, the modules whose imports are measured (runpy: what -m runs it with;
# concurrent.futures.thread: asyncio's default executor, imported at its
# first to_thread; what __main__ imports, which is not imported to measure
# it, as that would run the agent), and the modules kept out (an import of
# them fails as if absent): ssl, which asyncio does without and which would
# bring libssl.
PYTHON_MAIN = "crust.guest"
PYTHON_IMPORTS = ("runpy", "concurrent.futures.thread", "crust.guest.deferred", "crust.guest.agent",
                  "crust.guest.service")
PYTHON_BLOCKED = ("ssl",)
# crust's modules and the protobuf runtime, in the image (the agent's PYTHONPATH).
PYTHON_PATH = "/usr/lib/crust/python"
# Run by PYTHON -I -S: argv[1] the path (":"), then the blocked modules, the
# imports and the main package (","); prints the file of every module loaded.
_PYTHON_LISTING = r"""
import sys
sys.path[:0] = sys.argv[1].split(":")
for name in filter(None, sys.argv[2].split(",")):
    sys.modules[name] = None
for name in sys.argv[3].split(","):
    __import__(name)
files = {getattr(m, "__file__", None) for m in list(sys.modules.values()) if m is not None}
files.add(sys.modules[sys.argv[4]].__file__.rpartition("/")[0] + "/__main__.py")
print("\n".join(sorted(f for f in files if f)))
"""
# Run by PYTHON -I -S in a directory holding the image's Python files at
# their guest paths: each .py named (its guest path) compiled into its
# __pycache__, the guest path in its code objects.
_PYTHON_COMPILE = """
import importlib.util, py_compile, sys
for guest in sys.argv[1:]:
    py_compile.compile("." + guest, cfile="." + importlib.util.cache_from_source(guest), dfile=guest,
                       doraise=True, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
"""


def _python(args: list[str], cwd: Path | None = None, timeout: float = 300) -> str:
    """PYTHON -I -S with args; stdout; CommandError with stderr on failure."""
    argv = [PYTHON, "-I", "-S", *args]
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise CommandError(argv, None, f"no answer within {timeout:.0f}s", timed_out=True) from None
    if done.returncode != 0:
        raise CommandError(argv, done.returncode, done.stderr or done.stdout)
    return done.stdout


def agent_files() -> tuple[list[str], list[tuple[str, str]], str]:
    """(standard library paths, (source, guest path) of crust's and the
    protobuf runtime's files, protobuf's version) of what the agent imports:
    every module PYTHON loads importing PYTHON_IMPORTS, crust from this
    checkout (or installation) and google.protobuf from where this
    interpreter finds it, each alone on the path."""
    import google.protobuf

    import crust
    crust_root = Path(crust.__file__).resolve().parent.parent
    protobuf_root = Path(google.protobuf.__file__).resolve().parent.parent.parent
    with tempfile.TemporaryDirectory(prefix="crust-python-") as tmp:
        # Only the google package on the path, not what sits beside it.
        (Path(tmp) / "google").symlink_to(protobuf_root / "google")
        out = _python(["-c", _PYTHON_LISTING, f"{tmp}:{crust_root}", ",".join(PYTHON_BLOCKED),
                       ",".join(PYTHON_IMPORTS), PYTHON_MAIN], timeout=120)
        stdlib, own = [], []
        roots = ((f"{crust_root}/crust/", crust_root), (f"{tmp}/google/", Path(tmp)))
        for path in out.split():
            for prefix, root in roots:
                if path.startswith(prefix):
                    rel = Path(path).relative_to(root)
                    source = crust_root / rel if root == crust_root else protobuf_root / rel
                    own.append((str(source), f"{PYTHON_PATH}/{rel}"))
                    break
            else:
                if not path.startswith(PYTHON_STDLIB + "/"):
                    raise LookupError(f"the guest agent imports {path}, neither Debian's {PYTHON_STDLIB}, "
                                      f"crust's nor the protobuf runtime's")
                stdlib.append(path)
    return stdlib, own, google.protobuf.__version__


def compiled(sources: list[str], contents: dict[str, bytes]) -> list[tuple[str, bytes]]:
    """(archive path, bytes) of the .pyc of each source (a guest path;
    contents: the image's files by path), compiled by the guest's own
    interpreter at the guest's paths."""
    if not sources:
        return []
    with tempfile.TemporaryDirectory(prefix="crust-pyc-") as tmp:
        for guest in sources:
            path = Path(tmp + guest)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(contents[guest.lstrip("/")])
        _python(["-c", _PYTHON_COMPILE, *sorted(sources)], cwd=Path(tmp))
        return [(str(pyc.relative_to(tmp)), pyc.read_bytes()) for pyc in sorted(Path(tmp).rglob("*.pyc"))]
