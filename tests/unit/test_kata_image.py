"""The guest image's files (crust.kata.image.build) and the package data they ship in."""

from __future__ import annotations

from crust.kata.image import build as kata_image
from tests.unit.helpers import REPO


def test_every_file_the_guest_image_takes_is_packaged():
    """The image builder reads its guest files from the installed package
    (`crust kata image` in the container image): each must match the
    package data pyproject.toml declares."""
    import fnmatch
    import tomllib

    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["crust.guest"]
    for name in (*kata_image.GUEST_FILES.values(), *kata_image.GUEST_PROGRAMS.values()):
        assert any(fnmatch.fnmatch(f"files/{name}", p) for p in patterns), (name, patterns)
