"""Records on disk (crust.common.recordstore): round trips, damaged files
set aside, unsafe keys refused.
"""

from __future__ import annotations

import stat

import pytest
from pydantic import BaseModel

from crust.common.recordstore import RecordStore


class Rec(BaseModel):
    name: str
    size: int = 0
    tags: dict[str, str] = {}


async def test_recordstore_round_trip(tmp_path):
    store = RecordStore(tmp_path / "recs", Rec)
    assert stat.S_IMODE((tmp_path / "recs").stat().st_mode) == 0o700
    assert store.get("vol-1") is None
    store.put_sync("vol-1", Rec(name="one", size=1, tags={"a": "b"}))
    await store.put("vol-2", Rec(name="two", size=2))
    assert store.get("vol-1") == Rec(name="one", size=1, tags={"a": "b"})
    assert stat.S_IMODE((tmp_path / "recs" / "vol-1.json").stat().st_mode) == 0o600
    # A second store over the same directory (a restart) sees the same.
    again = RecordStore(tmp_path / "recs", Rec)
    assert dict(again.load_all()) == {"vol-1": Rec(name="one", size=1, tags={"a": "b"}),
                                      "vol-2": Rec(name="two", size=2)}
    await again.put("vol-1", Rec(name="one", size=10))
    assert store.get("vol-1").size == 10
    await again.delete("vol-1")
    again.delete_sync("vol-1")  # idempotent
    assert store.get("vol-1") is None
    assert [k for k, _ in store.load_all()] == ["vol-2"]
    assert sorted(p.name for p in (tmp_path / "recs").iterdir()) == ["vol-2.json"]


def test_recordstore_moves_corrupt_files_aside(tmp_path):
    d = tmp_path / "recs"
    store = RecordStore(d, Rec)
    store.put_sync("good", Rec(name="g"))
    (d / "broken.json").write_bytes(b'{"name": "trunc')
    (d / "wrongshape.json").write_bytes(b'{"size": "not a number"}')
    (d / "empty.json").write_bytes(b"")
    loaded = dict(store.load_all())
    assert loaded == {"good": Rec(name="g")}
    assert sorted(p.name for p in d.iterdir()) == ["broken.corrupt", "empty.corrupt", "good.json",
                                                   "wrongshape.corrupt"]
    assert (d / "broken.corrupt").read_bytes() == b'{"name": "trunc'  # kept for a human
    assert dict(store.load_all()) == {"good": Rec(name="g")}  # and stays out of the way


def test_recordstore_cleans_temporaries_at_open(tmp_path):
    d = tmp_path / "recs"
    d.mkdir()
    (d / ".vol-1.json.abcd1234.tmp").write_bytes(b'{"name": "half')
    store = RecordStore(d, Rec)
    assert list(d.iterdir()) == []
    assert list(store.load_all()) == []


@pytest.mark.parametrize("key", ["../x", "a/b", "/etc/passwd", "..", ".hidden", "", "x\n", "a b", "-x", "x" * 202])
def test_recordstore_rejects_unsafe_keys(tmp_path, key):
    store = RecordStore(tmp_path / "recs", Rec)
    with pytest.raises(ValueError):
        store.put_sync(key, Rec(name="evil"))
    # Nothing can be stored under such a key, so nothing is found or removed
    # (a CO may ask about any id: no error that would end in INTERNAL).
    (tmp_path / "x.json").write_text(Rec(name="bait").model_dump_json())
    assert store.get(key) is None
    store.delete_sync(key)
    assert (tmp_path / "x.json").exists()
    (tmp_path / "x.json").unlink()
    assert list((tmp_path / "recs").iterdir()) == []
    assert not (tmp_path / "x.json").exists()
