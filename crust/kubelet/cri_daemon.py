"""What a private CRI runtime of ours (crust.kubelet.containerd,
crust.kubelet.crio) does the same way whichever it is: stopping and
restarting its process, its log's tail, the CRI channel and stubs, a
crictl config, and removing every pod through CRI before a close."""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from pathlib import Path

import grpc

from crust.api import cri_pb2, cri_pb2_grpc
from crust.common.channel import local_channel

log = logging.getLogger(__name__)


class CriDaemon:
    """A mixin of a daemon dataclass with `directory`, `process`,
    `_channel`, `socket`, `log_path` and start() (which calls
    _await_answer())."""

    directory: Path
    process: subprocess.Popen | None
    _channel: grpc.Channel | None
    # How long stop() waits for the daemon after its signal, then SIGKILL.
    stop_timeout: float = 15.0

    def stop(self, sig: int = signal.SIGTERM, timeout: float | None = None) -> int | None:
        """Stop the daemon itself; its shims or monitors and their
        containers keep running."""
        self._close_channel()
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def _await_answer(self, timeout: float, error: type[Exception], name: str, what: str = "CRI"):
        """Until the started daemon answers (_answers()); error, with its
        log's tail, when it exits first or timeout passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise error(f"{name} exited with {self.process.returncode}: {self.log_tail()}")
            if self.socket.exists() and self._answers():
                return self
            time.sleep(0.05)
        raise error(f"{name} did not answer {what} within {timeout:g} s: {self.log_tail()}")

    def _answers(self) -> bool:
        try:
            self.version()
            return True
        except grpc.RpcError:
            return False

    def restart(self, sig: int = signal.SIGTERM):
        self.stop(sig)
        return self.start()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- CRI ----------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = local_channel(self.endpoint)
        return self._channel

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    @property
    def runtime_service(self) -> cri_pb2_grpc.RuntimeServiceStub:
        return cri_pb2_grpc.RuntimeServiceStub(self.channel)

    @property
    def image_service(self) -> cri_pb2_grpc.ImageServiceStub:
        return cri_pb2_grpc.ImageServiceStub(self.channel)

    def version(self) -> cri_pb2.VersionResponse:
        return self.runtime_service.Version(cri_pb2.VersionRequest(version="v1"), timeout=2)

    def crictl_config(self) -> Path:
        """A crictl.yaml for this daemon (crictl --config PATH ps)."""
        path = self.directory / "crictl.yaml"
        path.write_text(f"runtime-endpoint: {self.endpoint}\nimage-endpoint: {self.endpoint}\ntimeout: 30\n")
        return path

    def _remove_pods(self) -> list[str]:
        """Every pod through CRI, each on its own: one that cannot be
        stopped does not keep the others (what is left of it goes with
        the forced cleanup)."""
        removed = []
        try:
            pods = self.runtime_service.ListPodSandbox(cri_pb2.ListPodSandboxRequest(), timeout=10).items
        except grpc.RpcError as exc:
            log.warning("could not list pods through CRI", extra={"fields": {"error": str(exc.details())}})
            return removed
        for pod in pods:
            try:
                self.runtime_service.StopPodSandbox(cri_pb2.StopPodSandboxRequest(pod_sandbox_id=pod.id), timeout=60)
                self.runtime_service.RemovePodSandbox(cri_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod.id),
                                                      timeout=60)
                removed.append(f"pod sandbox {pod.id[:13]}")
            except grpc.RpcError as exc:
                log.warning("could not remove a pod through CRI",
                            extra={"fields": {"pod": pod.id[:13], "error": str(exc.details())}})
        return removed
