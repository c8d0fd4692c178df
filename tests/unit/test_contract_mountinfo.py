"""specs/mountinfo.schema.json is generated from the pydantic model; it must
not drift from it, and the model must keep Kata's keys readable."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from crust.contract.mountinfo import MountInfo, digest, json_schema, kata_name

ROOT = Path(__file__).resolve().parents[2]


def test_published_schema_matches_the_model():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_schema.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_detects_a_stale_file(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gen_schema
    finally:
        sys.path.pop(0)
    stale = tmp_path / "mountinfo.schema.json"
    stale.write_text(gen_schema.render().replace('"device"', '"dev1ce"', 1))
    monkeypatch.setattr(gen_schema, "TARGET", stale)
    monkeypatch.setattr(sys, "argv", ["gen_schema.py", "--check"])
    assert gen_schema.main() == 1


def test_kata_keys_come_first_with_katas_names():
    info = MountInfo(device="/dev/loop3", fstype="xfs", metadata={"fsGroup": "2000"}, options=["noatime"],
                     target_path="/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pv/mount")
    data = json.loads(info.to_json())
    assert list(data)[:5] == ["volume-type", "device", "fstype", "metadata", "options"]
    assert data["volume-type"] == "block" and data["metadata"] == {"fsGroup": "2000"}
    mirror = json.loads(info.kata_json())
    assert list(mirror)[:5] == list(data)[:5] and mirror["volume-type"] == "directvol"
    assert {k: v for k, v in mirror.items() if k != "volume-type"} == \
        {k: v for k, v in data.items() if k != "volume-type"}
    assert "device" in json_schema()["required"]


def test_entry_names():
    path = "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pv/mount"
    assert digest(path) == hashlib.sha256(path.encode()).hexdigest()
    assert len(digest(path)) == 64
    assert kata_name("/a") == "L2E="  # base64url with padding, as Kata names its directories
