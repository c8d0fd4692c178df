"""The part of an OCI runtime bundle (config.json, runtime-spec) a sandbox honours:
process args, env, cwd and user; root path; mounts."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crust.common.errors import InvalidArgument


class User(BaseModel):
    model_config = ConfigDict(extra="ignore")
    uid: int = Field(default=0, ge=0, le=2**32 - 1)
    gid: int = Field(default=0, ge=0, le=2**32 - 1)
    additionalGids: list[int] = Field(default_factory=list)


class Process(BaseModel):
    model_config = ConfigDict(extra="ignore")
    args: list[str] = Field(min_length=1)
    env: list[str] = Field(default_factory=list)
    cwd: str = "/"
    user: User | None = None


class Root(BaseModel):
    model_config = ConfigDict(extra="ignore")
    path: str = "rootfs"
    readonly: bool = False


class Mount(BaseModel):
    model_config = ConfigDict(extra="ignore")
    destination: str
    source: str = ""
    type: str = ""
    options: list[str] = Field(default_factory=list)


class Spec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ociVersion: str = ""
    process: Process
    root: Root | None = None
    mounts: list[Mount] = Field(default_factory=list)


class BundleError(ValueError):
    pass


def load_bundle(bundle: Path) -> Spec:
    path = bundle / "config.json"
    try:
        spec = Spec.model_validate(json.loads(path.read_text()))
    except FileNotFoundError:
        raise BundleError(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValidationError) as exc:
        raise BundleError(f"{path}: {exc}") from None
    except OSError as exc:  # a directory, a FIFO, no permission, a name too long: not a bundle
        raise BundleError(f"{path}: {exc.strerror or exc}") from None
    for m in spec.mounts:
        if not m.destination.startswith("/"):
            raise BundleError(f"{path}: mount destination {m.destination!r} must be absolute")
    return spec


def load_requested_bundle(bundle: str) -> Spec:
    """The bundle a request names: an absolute path whose config.json reads
    as a spec; INVALID_ARGUMENT naming what is wrong otherwise."""
    if not bundle.startswith("/"):
        raise InvalidArgument("bundle must be an absolute path")
    try:
        return load_bundle(Path(bundle))
    except BundleError as exc:
        raise InvalidArgument(str(exc)) from None
