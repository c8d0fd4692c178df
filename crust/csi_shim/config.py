"""Configuration of `crust shim`."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from crust.common.endpoint import socket_path


class ShimConfig(BaseModel):
    endpoint: str
    backend_endpoint: str
    proxy_endpoint: str
    state_dir: Path
    default_fs_type: str = "ext4"
    # Advertise DEFER_FS_OPS*. On by default: deferral is what the shim is for.
    # Off for conformance tools that reject capability values they do not know.
    advertise_deferral: bool = True
    # Largest request the shim accepts; CSI requests are small, a huge one is
    # an attack or a bug.
    max_request_bytes: int = Field(default=1024 * 1024, ge=64 * 1024)
    # Prometheus metrics on metrics_address:metrics_port; 0: off.
    metrics_port: int = Field(0, ge=0, le=65535)
    metrics_address: str = "127.0.0.1"
    # The bound of a snapshot's freeze, applied by the sandbox holding the
    # volume: it thaws by itself this long after the freeze if no thaw came.
    freeze_timeout_seconds: int = Field(60, ge=1, le=600)

    @field_validator("endpoint", "backend_endpoint", "proxy_endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        socket_path(value)  # raises ValueError with a clear message
        return value

    @field_validator("default_fs_type")
    @classmethod
    def _fs(cls, value: str) -> str:
        if value not in ("ext4", "xfs"):
            raise ValueError("default fs type must be ext4 or xfs")
        return value
