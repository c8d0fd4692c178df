"""crust-runc, the OCI runtime's front end (a small C program), with a real
`crust handler`: it creates a deferred container through the handler with no
interpreter started, the pod's sandbox process holds the claim and the
handler lets go of the device, it hands create to the Python runtime when the
handler cannot do it, and the handler's JSON socket answers as its gRPC
service does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import stat
import tempfile
from pathlib import Path

from crust.contract.mountinfo import digest
from crust.sys import mount as sysmount
from tests.harness.cri import PYTHON_OCI_RUNTIME
from tests.harness.daemons import device_held
from tests.harness.handler_env import make_env  # noqa: F401 - make_env is a fixture
from tests.harness.daemons import wait_until
from tests.harness.oci_runtime import _last_error, _runc_bundle, _runtime


# -- crust-runc and the handler ----------------------------------------------------------------------


FAILING_RUNTIME = """#!/bin/sh
echo "$@" >> "{calls}"
exit 1
"""


def _front_end_without_python(tmp_path: Path) -> tuple[Path, Path]:
    """crust-runc whose Python runtime is a stand-in that records its call
    and fails: a create that succeeds never started it."""
    from crust.oci_runtime import frontend

    calls = tmp_path / "python.calls"
    stand_in = tmp_path / "python-runtime"
    stand_in.write_text(FAILING_RUNTIME.format(calls=calls))
    stand_in.chmod(0o755)
    binary = tmp_path / "fe" / "crust-runc"
    frontend.build(binary, stand_in)
    return binary, calls


def test_crust_runc_creates_a_deferred_container_with_the_handler_and_no_interpreter(make_env, tmp_path):
    """The pod-start path of crust-runc: `create` of a bundle that binds a
    deferred volume is done by the front end and the handler (PrepareBundle,
    runc, ContainerCreated), never by the Python runtime. The container has
    the device mounted at its destination, the bundle and the marker are the
    Python runtime's own (its `delete` releases the claim), and a runc or a
    handler that fails leaves no claim and no marker behind."""
    env = make_env()
    vol = env.volume("pv-front")
    binary, python_calls = _front_end_without_python(tmp_path)
    state, runc_root = tmp_path / "state", tmp_path / "runc"
    handler = f"unix://{env.handler.socket}"
    bind = {"destination": "/data", "type": "bind", "source": str(vol.target), "options": ["rbind", "rw"]}
    bundle = _runc_bundle(tmp_path / "b1", [bind], "pod-front")
    original = json.loads((bundle / "config.json").read_text())
    log = tmp_path / "b1.json"
    try:
        done = _runtime(bundle, log, state, runc=shutil.which("runc"), handler=handler, runc_root=runc_root,
                        container_id="front1", runtime=binary)
        assert done.returncode == 0, (done.stderr, log.read_text() if log.exists() else "")
        assert not python_calls.exists(), python_calls.read_text()
        init = int((bundle / "init.pid").read_text())
        mounted = [line.split() for line in Path(f"/proc/{init}/mountinfo").read_text().splitlines()
                   if line.split()[4] == "/data"]
        assert [(m[2], m[-3]) for m in mounted] == [("%d:%d" % vol.majmin, "ext4")], mounted
        assert json.loads((bundle / "config.crust-original.json").read_text()) == original
        (data,) = [m for m in json.loads((bundle / "config.json").read_text())["mounts"] if m["destination"] == "/data"]
        assert (data["type"], data["source"]) == ("ext4", vol.device)
        assert json.loads((state / "front1").read_text()) == {"sandbox_id": "pod-front", "bundle": str(bundle)}
        assert {(c[0], c[2]) for c in env.claim_set()} == {(str(vol.target), "pod-front")}
        # The bundle joins no pod's namespaces by /proc path: the init holds the claim.
        assert [c.sandbox_pid for c in env.claims()] == [init]
        (held,) = _json_call(Path(f"{env.handler.socket}.json"),
                             b'{"method": "ListContainers", "request": {}}\n')["response"]["containers"]
        assert (held["containerId"], held["state"], int(held["pid"])) == ("front1", "created", init)
        lines = [json.loads(line)["msg"] for line in log.read_text().splitlines()]
        assert any(f"/data: ext4 on {vol.device}" in line for line in lines), lines
        assert any(line.startswith("crust: create took ") for line in lines), lines

        # delete: runc deletes, the claim and the marker go; the Python
        # runtime's delete of a container the front end created, the same.
        settings = {**os.environ, "CRUST_RUNC": shutil.which("runc"), "CRUST_HANDLER_ENDPOINT": handler,
                    "CRUST_OCI_RUNTIME_STATE": str(state), "CRUST_OCI_RUNTIME_CONFIG": str(state / "none.json")}
        for runtime in (binary, PYTHON_OCI_RUNTIME):
            if runtime == PYTHON_OCI_RUNTIME:
                done = _runtime(bundle, log, state, runc=shutil.which("runc"), handler=handler,
                                runc_root=runc_root, container_id="front1", runtime=binary)
                assert done.returncode == 0, done.stderr
            done = subprocess.run([str(runtime), "--root", str(runc_root), "delete", "--force", "front1"],
                                  env=settings, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            assert env.claim_set() == set() and not (state / "front1").exists()
            assert subprocess.run(["runc", "--root", str(runc_root), "state", "front1"],
                                  capture_output=True).returncode != 0, "runc still has the container"
        assert not python_calls.exists(), python_calls.read_text()

        # runc fails: its exit code, no claim, no marker.
        failing = _runc_bundle(tmp_path / "b2", [bind], "pod-front")
        done = _runtime(failing, tmp_path / "b2.json", state, runc="/bin/false", handler=handler,
                        container_id="front2", runtime=binary)
        assert done.returncode == 1
        assert env.claim_set() == set() and not (state / "front2").exists()
        # The handler refuses (a deferred target whose entry is gone): its reason in runc's log.
        entry_dir = env.proxy.volumes_dir / digest(str(vol.target))
        saved = entry_dir.with_name(entry_dir.name + ".saved")
        entry_dir.rename(saved)
        try:
            refused = _runc_bundle(tmp_path / "b3", [bind], "pod-front")
            done = _runtime(refused, tmp_path / "b3.json", state, runc=shutil.which("runc"), handler=handler,
                            runc_root=runc_root, container_id="front3", runtime=binary)
        finally:
            saved.rename(entry_dir)
        assert done.returncode != 0
        message = _last_error(tmp_path / "b3.json")
        assert message.startswith("crust handler: FAILED_PRECONDITION: ") and "has no entry" in message, message
        assert env.claim_set() == set() and not (state / "front3").exists()
        assert not python_calls.exists(), python_calls.read_text()
    finally:
        for name in ("front1", "front3"):
            subprocess.run(["runc", "--root", str(runc_root), "delete", "--force", name], capture_output=True)
    env.unpublish(vol)


def test_the_pods_sandbox_process_holds_the_claim_and_the_handler_lets_go_of_the_device(make_env, tmp_path):
    """A container that joins its pod's namespaces by /proc/PID/ns paths,
    as containerd's CRI plugin writes them: the claim names that process
    from PrepareBundle on (the handler's record too), and ContainerCreated
    leaves it so. The file system the handler read ahead of runc (a
    detached mount) is let go of: once the container is deleted, and when
    runc fails, nothing holds the device."""
    env = make_env()
    vol = env.volume("pv-podpid", "xfs")
    binary, python_calls = _front_end_without_python(tmp_path)
    state, runc_root = tmp_path / "state", tmp_path / "runc"
    handler = f"unix://{env.handler.socket}"
    own_ipc = os.readlink("/proc/self/ns/ipc")
    pod = subprocess.Popen(["unshare", "--ipc", "sleep", "600"])  # the pod's sandbox process
    bundles = []
    try:
        wait_until(lambda: os.readlink(f"/proc/{pod.pid}/ns/ipc") != own_ipc, timeout=10, what="the pod's ipc")
        bind = {"destination": "/data", "type": "bind", "source": str(vol.target), "options": ["rbind", "rw"]}
        for name in ("pid1", "pid2"):
            bundle = _runc_bundle(tmp_path / name, [bind], "pod-pid")
            spec = json.loads((bundle / "config.json").read_text())
            spec["linux"]["namespaces"] = [
                {"type": "ipc", "path": f"/proc/{pod.pid}/ns/ipc"} if n["type"] == "ipc" else n
                for n in spec["linux"]["namespaces"]]
            (bundle / "config.json").write_text(json.dumps(spec))
            bundles.append(bundle)
        done = _runtime(bundles[0], tmp_path / "pid1.json", state, runc=shutil.which("runc"), handler=handler,
                        runc_root=runc_root, container_id="pid1", runtime=binary)
        assert done.returncode == 0, done.stderr
        init = int((bundles[0] / "init.pid").read_text())
        assert os.readlink(f"/proc/{init}/ns/ipc") == os.readlink(f"/proc/{pod.pid}/ns/ipc")
        (claim,) = env.claims()
        assert (claim.target_path, claim.sandbox_id, claim.sandbox_pid) == (str(vol.target), "pod-pid", pod.pid)
        record = json.loads((env.handler.state_dir / "containers" / "pid1.json").read_text())
        assert (record["state"], record["pid"], record["pod_pid"]) == ("created", init, pod.pid)
        mounted = [line.split() for line in Path(f"/proc/{init}/mountinfo").read_text().splitlines()
                   if line.split()[4] == "/data"]
        assert [(m[2], m[-3]) for m in mounted] == [(f"{vol.majmin[0]}:{vol.majmin[1]}", "xfs")], mounted
        assert device_held(vol.device) and sysmount.of_device(*vol.majmin) == []  # the host mounts it nowhere

        settings = {**os.environ, "CRUST_RUNC": shutil.which("runc"), "CRUST_HANDLER_ENDPOINT": handler,
                    "CRUST_OCI_RUNTIME_STATE": str(state), "CRUST_OCI_RUNTIME_CONFIG": str(state / "none.json")}
        done = subprocess.run([str(binary), "--root", str(runc_root), "delete", "--force", "pid1"], env=settings,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert env.claims() == [] and not device_held(vol.device)

        # runc fails after the handler prepared (and read the file system ahead): nothing is held.
        done = _runtime(bundles[1], tmp_path / "pid2.json", state, runc="/bin/false", handler=handler,
                        container_id="pid2", runtime=binary)
        assert done.returncode == 1
        assert env.claims() == [] and not device_held(vol.device) and not (state / "pid2").exists()
        assert not python_calls.exists(), python_calls.read_text()
    finally:
        subprocess.run(["runc", "--root", str(runc_root), "delete", "--force", "pid1"], capture_output=True, check=False)
        pod.kill()
        pod.wait()
    env.unpublish(vol)


def test_crust_runc_hands_create_to_the_python_runtime_when_the_handler_cannot_do_it(tmp_path):
    """A handler without PrepareBundle (UNIMPLEMENTED), one that cannot see
    the bundle (NOT_FOUND), no handler at all, or a create without a pid
    file: the Python runtime gets the call, with its arguments."""
    import socket
    import threading

    binary, python_calls = _front_end_without_python(tmp_path)
    csi = tmp_path / "var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv/mount"
    csi.mkdir(parents=True)
    bundle = _runc_bundle(tmp_path / "b", [{"destination": "/data", "type": "bind", "source": str(csi),
                                            "options": ["rbind"]}], "pod")
    socket_path = tmp_path / "h.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{socket_path}.json")
    listener.listen(4)
    answers = []

    def answer_each() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                request = conn.makefile("rb").readline()
                answers.append(json.loads(request))
                conn.sendall(answers_to_give.pop(0))

    answers_to_give = [b'{"error":{"code":"UNIMPLEMENTED","message":"method \'PrepareBundle\': no"}}\n',
                       b'{"error":{"code":"NOT_FOUND","message":"bundle /x is not a directory the handler sees"}}\n']
    thread = threading.Thread(target=answer_each, daemon=True)
    thread.start()
    try:
        for handler, args in ((f"unix://{socket_path}", ["--pid-file", "p"]),
                              (f"unix://{socket_path}", ["--pid-file", "p"]),
                              (f"unix://{tmp_path}/none.sock", ["--pid-file", "p"]),
                              (f"unix://{socket_path}", [])):
            python_calls.unlink(missing_ok=True)
            done = subprocess.run([str(binary), "create", "--bundle", str(bundle), *args, "c1"],
                                  env={**os.environ, "CRUST_HANDLER_ENDPOINT": handler, "CRUST_RUNC": "/bin/false",
                                       "CRUST_OCI_RUNTIME_STATE": str(tmp_path / "state"),
                                       "CRUST_OCI_RUNTIME_CONFIG": str(tmp_path / "none.json")},
                                  capture_output=True, text=True, timeout=30)
            assert done.returncode == 1
            assert python_calls.read_text().split() == ["create", "--bundle", str(bundle), *args, "c1"], handler
        # The two answered calls asked for PrepareBundle with the request's fields.
        assert [a["method"] for a in answers] == ["PrepareBundle", "PrepareBundle"]
        assert answers[0]["request"]["containerId"] == "c1" and answers[0]["request"]["bundle"] == str(bundle)
        assert int(answers[0]["request"]["runtimePid"]) > 0
    finally:
        listener.close()
        thread.join(5)


def _json_call(path: Path, line: bytes) -> dict:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(line)
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    return json.loads(reply)


def test_the_handlers_json_socket_answers_as_its_grpc_service(make_env, tmp_path):
    """ContainerVolumes on `<endpoint>.json` (crust-oci-runtime's way in,
    without gRPC): the service's answers and codes as JSON, a bad line or
    method refused naming it, root's socket only (mode 0600; another user
    that reaches it anyway is refused)."""
    env = make_env()
    path = Path(f"{env.handler.socket}.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    listed = _json_call(path, b'{"method": "ListContainers", "request": {}}\n')
    assert listed == {"response": {}}, listed
    huge = tmp_path / "huge-bundle"
    huge.mkdir()
    with open(huge / "config.json", "wb") as spec:
        spec.truncate((64 << 20) + 1)   # sparse: the handler must refuse it by its size, unread
    malformed = tmp_path / "malformed-bundle"
    malformed.mkdir()
    (malformed / "config.json").write_text('{"mounts": [{"destination": "/d", "source": "/var/lib/kubelet/pods/u/'
                                           'volumes/kubernetes.io~csi/pv/mount", "options": "rbind"}]}')
    for line, code, words in (
            (b'{"method": "PrepareContainer", "request": {"sandboxId": "p"}}\n', "INVALID_ARGUMENT", "container_id"),
            (b'{"method": "PrepareContainer", "request": {"containerId": 7}}\n', "INVALID_ARGUMENT", "containerId"),
            (b'{"method": "PrepareBundle", "request": {"containerId": "c", "bundle": "b", "stateDir": "/s"}}\n',
             "INVALID_ARGUMENT", "bundle 'b' must be an absolute path"),
            (b'{"method": "PrepareBundle", "request": {"containerId": "c", "bundle": "/b"}}\n', "INVALID_ARGUMENT",
             "state_dir"),
            (b'{"method": "PrepareBundle", "request": {"containerId": "c", "bundle": "/nonexistent/b", '
             b'"stateDir": "/s"}}\n', "NOT_FOUND", "/nonexistent/b"),
            (json.dumps({"method": "PrepareBundle", "request": {"containerId": "c", "bundle": str(huge),
                                                               "stateDir": "/s"}}).encode() + b"\n",
             "INVALID_ARGUMENT", "more than the 67108864 the handler reads"),
            (json.dumps({"method": "PrepareBundle", "request": {"containerId": "c", "bundle": str(malformed),
                                                               "stateDir": "/s"}}).encode() + b"\n",
             "INVALID_ARGUMENT", "mounts[0].options must be a list of strings"),
            (b'{"method": "DeleteEverything", "request": {}}\n', "UNIMPLEMENTED", "DeleteEverything"),
            (b'{"method": "ReleaseContainer", "request": []}\n', "INVALID_ARGUMENT", "request"),
            (b'not json\n', "INVALID_ARGUMENT", "JSON")):
        answer = _json_call(path, line)
        assert answer["error"]["code"] == code and words in answer["error"]["message"], (line, answer)
    # Released twice, unknown: idempotent, as over gRPC.
    assert _json_call(path, b'{"method": "ReleaseContainer", "request": {"containerId": "none"}}\n') == {"response": {}}
    # Another user reaching the socket anyway (the socket and the test's
    # directories opened up for the moment): refused by its credentials.
    top = Path(tempfile.gettempdir())
    opened = [path] + [d for d in path.parents if d.is_relative_to(top) and d != top]
    modes = {p: stat.S_IMODE(os.stat(p).st_mode) for p in opened}
    for p, mode in modes.items():
        os.chmod(p, mode | (0o666 if p == path else 0o011))
    try:
        # A child that becomes nobody, asks, and hands the answer back.
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_end)
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                try:
                    answer = _json_call(path, b'{"method": "ListContainers", "request": {}}\n')
                except OSError as exc:
                    answer = {"connect": str(exc)}
                os.write(write_end, json.dumps(answer).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as answer_pipe:
            answer = json.loads(answer_pipe.read() or b"{}")
        os.waitpid(pid, 0)
        assert answer.get("error", {}).get("code") == "PERMISSION_DENIED", answer
    finally:
        for p, mode in modes.items():
            os.chmod(p, mode)
