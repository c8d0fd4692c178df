#!/usr/bin/env python3
"""Write specs/mountinfo.schema.json from crust.contract.mountinfo.MountInfo.

    python tools/gen_schema.py           # write
    python tools/gen_schema.py --check   # exit 1 when stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TARGET = ROOT / "specs" / "mountinfo.schema.json"


def render() -> str:
    from crust.contract.mountinfo import json_schema

    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != text:
            print("specs/mountinfo.schema.json is stale (run: python tools/gen_schema.py)")
            return 1
        print("specs/mountinfo.schema.json is up to date")
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
