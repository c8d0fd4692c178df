"""Build crust-runc, the front end of crust's OCI runtime (frontend.c).

containerd's runc shim runs its runtime for every call on a container.
crust-runc becomes runc at once for the calls crust has nothing to do in,
does the `create` and `delete` of a container with a deferred volume with
the handler (PrepareBundle, runc, ContainerCreated; runc, ReleaseContainer),
and becomes the Python runtime (crust-oci-runtime) where the handler cannot
help: a pod pays for crust no interpreter's start, only one small
program's start per call.

    crust runtime-frontend --output /usr/local/bin/crust-runc [--runtime PATH] [--cc cc]

What runs the Python runtime is compiled in: by default this interpreter,
started as `python -I -S crust/oci_runtime/entry.py` (no site module: a
`create` starts sooner than through the installed crust-oci-runtime
script); with --runtime, that program, given the arguments as they are.
The build is skipped when the program at --output was built from the same
source, runtime and compiler (a stamp beside it says so); it is written
atomically.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("frontend.c")
CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong", "-fPIE",
          "-pie", "-Wl,-z,relro,-z,now")


class FrontendError(Exception):
    pass


ENTRY = Path(__file__).with_name("entry.py")


def _defines(runtime: Path | None) -> list[str]:
    """The compiler's -D for the program the front end hands crust's calls
    to: the given runtime, or this interpreter with the entry script."""
    program, entry = (runtime, None) if runtime is not None else (Path(sys.executable), ENTRY)
    defines = []
    for name, path in (("CRUST_PYTHON_RUNTIME", program), ("CRUST_PYTHON_ENTRY", entry)):
        if path is None:
            continue
        path = Path(os.path.abspath(path))
        if "\"" in str(path) or "\\" in str(path):
            raise FrontendError(f"the path {path} cannot be compiled in")
        defines.append(f"-D{name}=\"{path}\"")
    return defines


def _stamp(defines: list[str], cc: str) -> str:
    text = SOURCE.read_bytes() + b"\0" + "\0".join(defines).encode() + b"\0" + cc.encode() + b"\0" \
        + " ".join(CFLAGS).encode()
    return hashlib.sha256(text).hexdigest()


def build(output: Path, runtime: Path | None = None, cc: str = "cc") -> bool:
    """crust-runc at output, handing crust's calls to runtime (default: this
    interpreter with the entry script); False when the one there is already
    this build."""
    defines = _defines(runtime)
    compiler = shutil.which(cc)
    if compiler is None:
        raise FrontendError(f"no C compiler {cc!r}: apt-get install gcc libc6-dev")
    stamp_path = output.with_name(output.name + ".build")
    stamp = _stamp(defines, compiler)
    try:
        if stamp_path.read_text().strip() == stamp and os.access(output, os.X_OK):
            return False
    except OSError:
        pass
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *CFLAGS, *defines, "-o", temporary, str(SOURCE)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise FrontendError(f"{cc} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.chmod(temporary, 0o755)
        os.replace(temporary, output)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    stamp_path.write_text(stamp + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="crust runtime-frontend", description=__doc__.split("\n\n")[1])
    parser.add_argument("--output", type=Path, required=True, help="where crust-runc goes")
    parser.add_argument("--runtime", type=Path, help=f"the program it hands crust's calls to, as they are "
                                                     f"(default: {sys.executable} -I -S {ENTRY})")
    parser.add_argument("--cc", default="cc", help="the C compiler (default: cc)")
    args = parser.parse_args(argv)
    try:
        built = build(args.output, args.runtime, args.cc)
    except FrontendError as exc:
        print(f"crust runtime-frontend: {exc}", file=sys.stderr)
        return 1
    print(f"{args.output}: {'built' if built else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
