import os
from pathlib import Path

import pytest

# The harness package holds assertions the tiers share: rewritten like a
# test module's, a failing one shows the values it compared.
pytest.register_assert_rewrite("tests.harness")

from tests.harness import upstream  # noqa: E402 - after the rewrite is registered
from tests.harness.daemons import Root  # noqa: E402

UNIT_TIER = Path(__file__).resolve().parent / "unit"
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")
NEEDS_ROOT = "needs root (loop devices, mounts, daemons): run as root, `sudo ./run tests`"


def needs_root(item: pytest.Item) -> bool:
    """Every test outside tests/unit makes devices, mounts or daemons, or
    runs beside tests that do; a unit test needs root only if it says so
    (the `root` mark) or takes the `root` fixture."""
    return (UNIT_TIER not in item.path.resolve().parents or item.get_closest_marker("root") is not None
            or "root" in getattr(item, "fixturenames", ()))


# The modules that start a private CRI-O run in one worker, one after
# another: what CRI-O makes outside its directory is shared by every
# instance, and one waits for another to close (crust.kubelet.crio).
CRIO_MODULES = {"test_crio.py", "test_crio_microvm.py", "test_critest.py"}


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """`-m unit` selects only tests/unit, whose tests alone carry the mark:
    the other tiers are then not even imported (some build crust-runc or
    read the host's tools when imported, which a user without root may not)."""
    if config.getoption("markexpr", "").strip() != "unit" or collection_path.suffix != ".py":
        return None
    return True if UNIT_TIER not in collection_path.resolve().parents else None


def pytest_xdist_make_scheduler(config, log):
    """Whole modules to each worker (a module's fixtures and its tests'
    order stay together), the CRI-O modules as one."""
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "cri-o" if Path(module).name in CRIO_MODULES else module

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if UNIT_TIER in item.path.resolve().parents:
            item.add_marker(pytest.mark.unit)
        if not needs_root(item):
            continue
        item.add_marker(pytest.mark.root)
        # A skip by mark is reported at the test's own line, so a non-root
        # run lists each test it did not run. CI runs everything: there a
        # test that cannot run fails (pytest_runtest_setup below).
        if os.geteuid() != 0 and not IN_CI:
            item.add_marker(pytest.mark.skip(reason=NEEDS_ROOT))


def pytest_runtest_setup(item):
    if os.geteuid() != 0 and item.get_closest_marker("root") is not None:
        pytest.fail(f"{NEEDS_ROOT}; CI runs every test, so it fails here instead of skipping", pytrace=False)


def pytest_configure(config):
    # The upstream suites' marks, checked before each test, and their lines
    # at the end of the run.
    config.pluginmanager.register(upstream.Reporter(), "crust-upstream")


@pytest.fixture
def root():
    r = Root()
    try:
        yield r
    finally:
        r.close()
    # An unexpected exception in any daemon is a defect, whatever the test
    # asserted: a request a daemon did not expect must get a definite code.
    if r.unexpected:
        pytest.fail("a daemon hit an unexpected error:\n" + "\n".join(r.unexpected[:20]), pytrace=False)


@pytest.fixture
def driver(root):
    """A `crust driver --mode all` serving on a fresh root."""
    return root.driver().start()
