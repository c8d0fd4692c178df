"""bench/runtime/pod_share.py runs end to end and reports what it promises (one
small run: the numbers themselves are in docs/performance.md)."""

from tests.harness.bench_run import run_bench


def test_the_pod_share_benchmark_reports_every_part(tmp_path):
    result = run_bench("bench/runtime/pod_share.py", "--runs", "1", "--mib", "8", "--big-mib", "8",
                       out=tmp_path / "result.json")
    for name in ("busybox", "big"):
        assert result["create_s"][name]["copy"] > 0 and result["create_s"][name]["share"] > 0
    assert result["first_output_s"] > 0
    for side in ("virtio-fs", "virtio-blk"):
        assert result["io_mib_per_s"][side]["write"] > 0 and result["io_mib_per_s"][side]["read"] > 0
    assert set(result["io_ratio_blk_over_fs"]) == {"write", "read"}
