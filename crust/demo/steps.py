"""The demo's steps: each timed, checked and printed as it ends (or kept
for the JSON report); a failed step stops the story."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from crust.kubelet.cri import SyncError


class StepFailed(Exception):
    pass


@dataclass
class Step:
    name: str
    ms: float
    ok: bool
    detail: str = ""


@dataclass
class Timeline:
    as_json: bool
    steps: list[Step] = field(default_factory=list)

    def run(self, name: str, action):
        started = time.perf_counter()
        try:
            detail = action() or ""
        except grpc.RpcError as exc:
            self._record(name, started, False, f"{exc.code().name}: {exc.details()}")
            raise StepFailed(name) from None
        except StepFailed as exc:
            self._record(name, started, False, str(exc))
            raise StepFailed(name) from None
        except OSError as exc:
            self._record(name, started, False, str(exc))
            raise StepFailed(name) from None
        except SyncError as exc:
            # kubelet's CRI side gave up: a failed step too, not a traceback.
            self._record(name, started, False, str(exc))
            raise StepFailed(name) from None
        self._record(name, started, True, detail)
        return detail

    def _record(self, name: str, started: float, ok: bool, detail: str) -> None:
        step = Step(name, round((time.perf_counter() - started) * 1e3, 2), ok, detail)
        self.steps.append(step)
        if not self.as_json:
            mark = "ok  " if ok else "FAIL"
            print(f"{step.ms:9.1f} ms  {mark} {name:<34} {detail}", flush=True)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise StepFailed(message)

