"""crust-runc, the OCI runtime's front end (crust/oci_runtime/frontend.c):
which program each call of runc's command line becomes.

The front end is built for real with the system's compiler, its Python
runtime and its runc being two recorders that write who they are and the
arguments they got: every call crust has nothing to do in must reach runc
with its arguments unchanged, and every call that needs crust, or that the
front end cannot decide with certainty, the Python runtime."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from crust.oci_runtime import frontend

RECORDER = """#!/bin/sh
printf '%s' "{name}" >> "{log}"
for word in "$@"; do printf ' %s' "$word" >> "{log}"; done
echo >> "{log}"
printf '%s\\n' "$CRUST_RUNC" > "{log}.runc"
"""


class Frontend:
    def __init__(self, root: Path):
        self.root = root
        self.log = root / "calls.log"
        self.python = self._recorder("python")
        self.runc = self._recorder("runc")
        self.state = root / "state"
        self.state.mkdir()
        self.binary = root / "bin" / "crust-runc"
        assert frontend.build(self.binary, self.python)
        # The defaults the runtime reads: no settings file, runc from CRUST_RUNC,
        # no handler (a create that needs crust is then the Python runtime's).
        self.env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "CRUST_RUNC": str(self.runc),
                    "CRUST_OCI_RUNTIME_STATE": str(self.state),
                    "CRUST_HANDLER_ENDPOINT": f"unix://{root}/no-handler.sock",
                    "CRUST_OCI_RUNTIME_CONFIG": str(root / "absent.json")}

    def _recorder(self, name: str) -> Path:
        path = self.root / name
        path.write_text(RECORDER.format(name=name, log=self.log))
        path.chmod(0o755)
        return path

    def call(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """Who got the call, and with which arguments."""
        return self.call_and_stderr(*args, env=env, cwd=cwd)[0]

    def call_and_stderr(self, *args: str, env: dict[str, str] | None = None,
                        cwd: Path | None = None) -> tuple[str, str]:
        """Who got the call, with which arguments, and what the front end
        said on its standard error (runc's log, without --log)."""
        self.log.unlink(missing_ok=True)
        done = subprocess.run([str(self.binary), *args], env={**self.env, **(env or {})}, cwd=cwd or self.root,
                              capture_output=True, text=True, timeout=10)
        assert done.returncode == 0, done.stderr
        return self.log.read_text().strip(), done.stderr

    def bundle(self, name: str, mounts: list[dict], raw: str | None = None) -> Path:
        path = self.root / name
        path.mkdir()
        spec = {"ociVersion": "1.0.2", "process": {"args": ["sh"]}, "mounts": mounts}
        (path / "config.json").write_text(raw if raw is not None else json.dumps(spec, separators=(",", ":")))
        return path


@pytest.fixture
def fe(tmp_path) -> Frontend:
    return Frontend(tmp_path)


def bind(source: str, destination: str = "/data") -> dict:
    return {"destination": destination, "type": "bind", "source": source, "options": ["rbind", "rw"]}


def test_calls_crust_has_nothing_to_do_in_are_runcs_with_their_arguments(fe):
    plain = fe.bundle("plain", [bind("/var/lib/kubelet/pods/u/volumes/kubernetes.io~empty-dir/x")])
    for args in (["--version"], ["state", "c1"], ["--root", "/run/r", "--log", "/tmp/l", "--log-format", "json",
                                                    "start", "c1"],
                 ["kill", "c1", "9"], ["exec", "--process", "/p.json", "c1"], ["features"],
                 ["create", "--bundle", str(plain), "c1"], ["--root=/run/r", "create", "-b", str(plain),
                                                             "--pid-file", "/p", "c1"],
                 ["create", f"--bundle={plain}", "--console-socket", "/s", "c1"], ["delete", "--force", "c1"]):
        assert fe.call(*args) == " ".join(["runc", *args]), args
    # Without --bundle, the bundle is the working directory.
    assert fe.call("create", "c1", cwd=plain) == "runc create c1"


def test_calls_that_need_crust_are_the_python_runtimes(fe):
    csi = fe.bundle("csi", [bind("/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv/mount")])
    assert fe.call("--root", "/r", "create", "--bundle", str(csi), "c1") == f"python --root /r create --bundle {csi} c1"
    assert fe.call("create", "c1", cwd=csi) == "python create c1"
    # A source whose real path leads below a CSI volume's path (a link on the way).
    target = fe.root / "kubelet" / "pods" / "u" / "volumes" / "kubernetes.io~csi" / "pv" / "mount"
    target.mkdir(parents=True)
    (fe.root / "link").symlink_to(target)
    linked = fe.bundle("linked", [bind(str(fe.root / "link"))])
    assert fe.call("create", "-b", str(linked), "c1").startswith("python ")
    # A container crust created (its marker in the state directory) is
    # deleted by runc, then released at the handler; none answers here, so
    # the marker stays for a later delete, and runc's log says why.
    (fe.state / "c2").write_text("{}")
    log = fe.root / "runc.log"
    assert fe.call("--log", str(log), "delete", "--force", "c2") == f"runc --log {log} delete --force c2"
    assert (fe.state / "c2").exists()
    assert "level=warning" in log.read_text() and "c2 deleted, its claims not released yet" in log.read_text()
    assert fe.call("run", "-b", str(csi), "c3") == f"python run -b {csi} c3"


def test_what_it_cannot_decide_with_certainty_is_the_python_runtimes(fe):
    # A string with an escape (Go's encoder writes & as \\u0026), an
    # unreadable spec, a bundle crust rewrote before, an odd container id.
    escaped = fe.bundle("escaped", [], raw='{"mounts":[{"source":"/a\\u0026b","destination":"/d"}]}')
    assert fe.call("create", "-b", str(escaped), "c1").startswith("python ")
    assert fe.call("create", "-b", str(fe.root / "missing"), "c1").startswith("python ")
    rewritten = fe.bundle("rewritten", [])
    (rewritten / "config.crust-original.json").write_text("{}")
    assert fe.call("create", "-b", str(rewritten), "c1").startswith("python ")
    assert fe.call("delete", "../c1").startswith("python ")
    # A settings file it cannot read simply: an unknown key, an escape, not an object.
    for text in ('{"runc": "/usr/sbin/runc", "extra": "x"}', '{"runc": "/usr/s\\u0062in/runc"}', '[]', '{"runc": 1}'):
        settings = fe.root / "settings.json"
        settings.write_text(text)
        assert fe.call("state", "c1", env={"CRUST_OCI_RUNTIME_CONFIG": str(settings)}).startswith("python "), text


def test_the_settings_file_and_the_environment_name_runc_and_the_state(fe, tmp_path):
    other = fe._recorder("other-runc")
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"runc": str(other), "handlerEndpoint": "unix:///h.sock",
                                    "stateDir": str(tmp_path / "elsewhere")}, indent=2))
    env = {"CRUST_OCI_RUNTIME_CONFIG": str(settings), "CRUST_RUNC": "", "CRUST_OCI_RUNTIME_STATE": "",
           "CRUST_HANDLER_ENDPOINT": ""}
    assert fe.call("state", "c1", env=env) == "other-runc state c1"
    # A marker in the file's state directory: runc deletes, then the
    # handler the file names is asked to release the claims (none answers).
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "c9").write_text("{}")
    called, said = fe.call_and_stderr("delete", "c9", env=env)
    assert called == "other-runc delete c9" and "c9 deleted, its claims not released yet" in said, said
    assert "unix:///h.sock" in said, said
    # The environment's state directory wins over the file's.
    (tmp_path / "elsewhere" / "c9").unlink()
    called, said = fe.call_and_stderr("delete", "c9", env=env)
    assert called == "other-runc delete c9" and said == ""
    (fe.state / "c9").write_text("{}")
    called, said = fe.call_and_stderr("delete", "c9", env={**env, "CRUST_OCI_RUNTIME_STATE": str(fe.state)})
    assert "c9 deleted, its claims not released yet" in said, said
    assert fe.call("state", "c1", env={**env, "CRUST_RUNC": str(fe.runc)}) == "runc state c1"
    # Neither: the first runc on PATH that is not the front end itself.
    path_dir = tmp_path / "path"
    path_dir.mkdir()
    os.symlink(fe.binary, path_dir / "runc")
    os.symlink(fe.runc, tmp_path / "bin" / "runc")
    found = fe.call("state", "c1", env={"CRUST_RUNC": "", "PATH": f"{path_dir}:{tmp_path / 'bin'}"})
    assert found == "runc state c1"
    # The Python runtime is told the runc found, so that it never takes
    # the front end, installed under runc's name, for runc.
    assert fe.call("run", "c9", env={"CRUST_RUNC": "", "PATH": f"{path_dir}:{tmp_path / 'bin'}"}) == "python run c9"
    assert Path(f"{fe.log}.runc").read_text().strip() == str(tmp_path / "bin" / "runc")
    assert fe.call("run", "c9", env=env) == "python run c9"
    assert Path(f"{fe.log}.runc").read_text().strip() == str(other)


def test_the_default_build_starts_crusts_python_runtime_without_the_site_module(tmp_path):
    """Built without --runtime, the front end starts this interpreter on
    crust's entry script, `-I -S`: the real runtime answers (here: the
    handler it must claim the volume through is not there, said in runc's
    log), whatever PYTHONPATH or a site directory in the environment says."""
    binary = tmp_path / "crust-runc"
    assert frontend.build(binary)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"mounts": [bind("/var/lib/kubelet/pods/u/volumes/"
                                                                    "kubernetes.io~csi/pv/mount")]}))
    # A module that would stand in for crust's, were the environment read.
    decoy = tmp_path / "decoy" / "crust"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise SystemExit('the decoy crust was imported')\n")
    log = tmp_path / "runc.log"
    done = subprocess.run([str(binary), "--log", str(log), "--log-format", "json", "create", "--bundle", str(bundle),
                           "c1"], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "CRUST_RUNC": "/bin/false",
                               "PYTHONPATH": str(tmp_path / "decoy"), "PYTHONSTARTUP": str(decoy / "__init__.py"),
                               "CRUST_OCI_RUNTIME_CONFIG": str(tmp_path / "absent.json"),
                               "CRUST_OCI_RUNTIME_STATE": str(tmp_path / "state"),
                               "CRUST_HANDLER_ENDPOINT": f"unix://{tmp_path}/no-handler.sock"})
    assert done.returncode == 1, (done.stdout, done.stderr)
    line = json.loads(log.read_text().splitlines()[-1])
    assert line["level"] == "error" and "unreachable" in line["msg"] and "no-handler.sock" in line["msg"], line
    assert json.loads((bundle / "config.json").read_text())["mounts"][0]["type"] == "bind", "the bundle was changed"


def test_a_runc_that_cannot_be_run_is_said_in_runcs_log(fe, tmp_path):
    log = tmp_path / "runc.log"
    done = subprocess.run([str(fe.binary), "--log", str(log), "--log-format", "json", "state", "c1"],
                          env={**fe.env, "CRUST_RUNC": str(tmp_path / "no-such-runc")}, capture_output=True,
                          text=True, timeout=10)
    assert done.returncode == 1
    line = json.loads(log.read_text().splitlines()[-1])
    assert line["level"] == "error" and "no-such-runc" in line["msg"], line


def test_the_build_is_skipped_when_nothing_changed_and_redone_when_the_runtime_moves(fe, tmp_path):
    assert not frontend.build(fe.binary, fe.python)
    moved = fe._recorder("python-elsewhere")
    assert frontend.build(fe.binary, moved)
    assert fe.call("run", "c1") == "python-elsewhere run c1"
