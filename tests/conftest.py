import os

import pytest

from tests.harness import Root


def pytest_configure(config):
    if os.geteuid() != 0:
        raise pytest.UsageError("crust's tests create loop devices and mounts: run them as root")


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
