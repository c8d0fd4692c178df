#!/usr/bin/env python3
"""Regenerate the Python stubs in crust/api from the protos in specs/.

    python tools/gen_stubs.py            # write crust/api/*_pb2*.py
    python tools/gen_stubs.py --check    # exit 1 if crust/api is stale

protoc writes absolute imports (`import csi_pb2`); they are rewritten to
package-relative ones so the stubs live inside the crust package.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
API = ROOT / "crust" / "api"
# Every proto in specs/: a new one gets its stubs without touching this list.
PROTOS = sorted(p.name for p in SPECS.glob("*.proto"))
HEADER = '"""Generated from specs/ by tools/gen_stubs.py; do not edit."""\n'


def generate(out: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    argv = [
        "protoc",
        f"-I{SPECS}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(SPECS / p) for p in PROTOS],
    ]
    if protoc.main(argv) != 0:
        raise SystemExit("protoc failed")
    local = {Path(p).stem for p in PROTOS}
    pattern = re.compile(r"^import (\w+)_pb2 as (\w+)$", re.M)
    for path in out.glob("*_pb2*.py*"):
        text = path.read_text()
        text = pattern.sub(
            lambda m: f"from . import {m.group(1)}_pb2 as {m.group(2)}" if m.group(1) in local else m.group(0),
            text,
        )
        text = re.sub(r"^from (\w+)_pb2 import", lambda m: f"from .{m.group(1)}_pb2 import" if m.group(1) in local else m.group(0), text, flags=re.M)
        path.write_text(text)
    (out / "__init__.py").write_text(HEADER)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args()
    if not args.check:
        API.mkdir(exist_ok=True)
        for old in API.glob("*_pb2*.py*"):
            old.unlink()
        generate(API)
        print(f"wrote {len(list(API.glob('*_pb2*.py*')))} files to {API.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = sorted(p.name for p in Path(tmp).iterdir())
        current = sorted(p.name for p in API.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
        stale = sorted(set(fresh) ^ set(current))
        stale += [n for n in set(fresh) & set(current) if not filecmp.cmp(Path(tmp) / n, API / n, shallow=False)]
        if stale:
            print("stale stubs in crust/api (run: python tools/gen_stubs.py): " + ", ".join(sorted(stale)))
            return 1
    print("crust/api is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
