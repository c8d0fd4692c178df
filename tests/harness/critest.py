"""The CRI conformance suite (critest, from kubernetes-sigs/cri-tools)
against a private CRI runtime (containerd or CRI-O) with its runtime
handlers, without a network: what tests/vm/test_critest.py needs.

- critest itself is not part of crust: it is kubernetes-sigs/cri-tools'
  cmd/critest, found on PATH or by CRITEST (tests/harness/upstream.py);
- the node (critest_node(engine)): a local registry holding the images
  critest pulls (tests/harness/critest_images.py), crust's node stack with the
  runtime handlers the engine's RuntimeClasses need (the mount-namespace
  one behind crust-runc, the microVM one behind crust-microvm), and the
  engine: a private containerd (crust.kubelet.containerd) whose handlers
  are `runc`, `crust-runc` and `crust`, or a private CRI-O
  (crust.kubelet.crio) whose handlers are `runc` and `crust-runc`; either
  with every registry critest names mirrored to the local one and a pod
  network of its own;
- one run of critest for a handler (run_critest()), its JSON report read
  spec by spec (a spec's name is its full text, as ginkgo prints it);
- what critest's specs leave on the host, removed after each run
  (HostIpc's shared memory segments, the mount propagation specs' bind
  mounts);
- what does not pass here and why (docs/critest.yaml, read by
  load_expectations() and rendered into docs/conformance.md by
  render_expectations()), runc's baseline one list per engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from crust.kubelet.containerd import CGROUP_FS, remove_cgroup_trees
from crust.kubelet.registry import LocalRegistry
from tests.harness.critest_images import PAUSE, REGISTRY_HOSTS, build_all, push_all
from tests.harness.critest_host import HostTraces
from tests.harness.cri import KATA_HANDLER, OCI_RUNTIME, containerd_binary, private_containerd
from tests.harness.csi_sanity import PROJECT
from tests.harness.daemons import Root
EXPECTATIONS = PROJECT / "docs" / "critest.yaml"
CONFORMANCE_DOC = PROJECT / "docs" / "conformance.md"

# Per engine (the CRI runtime critest talks to): the RuntimeClass a user
# names -> the handler critest is told (--runtime-handler), which the
# engine's config maps to what it runs (critest_node()).
ENGINES = {"containerd": {"runc": "runc", "crust-runc": "crust-runc", "crust-microvm": "crust"},
           "containerd2": {"runc": "runc", "crust-runc": "crust-runc", "crust-microvm": "crust"},
           "crio": {"runc": "runc", "crust-runc": "crust-runc", "crust-microvm": "crust"}}
ENGINE_NAMES = {"containerd": "containerd 1.6", "containerd2": "containerd 2.3", "crio": "CRI-O 1.37"}
# critest runs its pods below this cgroup parent when the runtime does not
# say which cgroup driver it uses (containerd 1.6 does not).
CRITEST_CGROUP_PARENT = "test.slice"

# The groups of specs (top-level describe blocks, by their exact text) the
# microVM runs in every CI run; the longer job (CRUST_CRITEST_MICROVM=all)
# runs every group. See docs/conformance.md for the choice.
MICROVM_CI_GROUPS = ("PodSandbox", "Container", "Container OOM", "Container Mount Propagation",
                     "Container Mount Readonly", "Security Context", "Streaming", "Networking",
                     "Multiple Containers [Conformance]", "Runtime info", "Idempotence")
MICROVM_ALL = os.environ.get("CRUST_CRITEST_MICROVM", "").lower() == "all"

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


GO_REGEXP_SPECIAL = set("\\.+*?()|[]{}^$")


def exact_focus(names: set[str]) -> str:
    """A ginkgo focus (a Go regular expression: no look-around) matching
    exactly these specs by their full text. Ginkgo matches it against the
    suite's description, a space and that text, so the match is anchored
    at the end only: every name begins with "[k8s.io] ", which no name
    holds elsewhere."""
    escaped = ("".join("\\" + c if c in GO_REGEXP_SPECIAL else c for c in name) for name in sorted(names))
    return "(" + "|".join(escaped) + ")$"


def list_specs(critest: Path, workdir: Path) -> dict[str, "Spec"]:
    """Every spec of this critest, from a dry run (nothing is called; a
    spec a run would not skip up front shows as passed)."""
    report = workdir / "dry-run.json"
    subprocess.run([str(critest), "--ginkgo.dry-run", "--ginkgo.no-color", f"--ginkgo.json-report={report}"],
                   capture_output=True, text=True, cwd=workdir, timeout=60)
    return read_report(report)


def group_specs(specs: dict[str, "Spec"], groups: tuple[str, ...]) -> set[str]:
    """The specs of exactly these top-level groups ("Container" is not
    "Container OOM")."""
    wanted = {f"[k8s.io] {g}" for g in groups}
    return {name for name, spec in specs.items() if spec.group in wanted and spec.state != SKIPPED}


# -- the node ----------------------------------------------------------------------------------------


@dataclass
class CritestNode:
    root: Root
    engine: str  # a key of ENGINES
    daemon: object  # the engine's private daemon (Containerd, Crio): its endpoint
    registry: LocalRegistry

    @property
    def handlers(self) -> dict[str, str]:
        return ENGINES[self.engine]


def _cgroup_parent_exists() -> bool:
    return CGROUP_FS.is_dir() and any((h / CRITEST_CGROUP_PARENT).exists() for h in CGROUP_FS.iterdir())


@contextlib.contextmanager
def _containerd(registry: LocalRegistry, handler_env: dict[str, str], binary: str = "containerd") -> Iterator[object]:
    with private_containerd(runtimes={"runc": "", "crust-runc": str(OCI_RUNTIME)},
                            shim_runtimes={"crust": "io.containerd.crust.v2"}, env=handler_env,
                            mirrors={host: registry.url for host in REGISTRY_HOSTS},
                            pod_network=True, sandbox_image=PAUSE, binary=binary) as (containerd, _):
        yield containerd


def _containerd2(registry: LocalRegistry, handler_env: dict[str, str]):
    """The containerd 2.x CONTAINERD2 names (tests/harness/upstream.py)."""
    return _containerd(registry, handler_env, containerd_binary("containerd2"))


@contextlib.contextmanager
def _crio(registry: LocalRegistry, handler_env: dict[str, str]) -> Iterator[object]:
    """A private CRI-O in a short directory of its own (its attach sockets'
    paths, crust.kubelet.crio.Crio.check_paths), its critest images pulled
    through the mirrors, CRI's pod metrics on (critest's metrics specs);
    the microVM's handler as deploy/crio/crust-microvm.conf states it."""
    from tests.harness.crio import crio_tools, microvm_handler, started_crio

    tools = crio_tools()
    directory = Path(tempfile.mkdtemp(prefix="crust-crio-"))
    vm_runtimes, vm_settings = microvm_handler(directory, handler_env["CRUST_KATA_HANDLER_ENDPOINT"])
    try:
        with started_crio(directory, tools, PAUSE, {host: registry.url for host in REGISTRY_HOSTS},
                          runtimes={"runc": "", "crust-runc": str(OCI_RUNTIME)}, env=handler_env,
                          vm_runtimes=vm_runtimes, vm_runtime_settings=vm_settings,
                          pod_network=True, pod_metrics=True) as crio:
            yield crio
    finally:
        # Crio.close() removed it, unless CRI-O never got that far.
        shutil.rmtree(directory, ignore_errors=True)


# engine -> its private daemon, started with the registry's mirrors and the
# runtimes' environment (`handler_env`) for each of its handlers.
DAEMONS = {"containerd": _containerd, "containerd2": _containerd2, "crio": _crio}


@contextlib.contextmanager
def critest_node(engine: str = "containerd") -> Iterator[CritestNode]:
    """Everything critest talks to, closed (pods first) whatever happens."""
    from tests.harness.handler_env import Env

    root = Root()
    registry = LocalRegistry(root.path / "registry")
    # critest's cgroup parent is removed at the end only if this run made it.
    made_cgroup_parent = not _cgroup_parent_exists()
    try:
        registry.start()
        push_all(registry, build_all())
        env = Env(root)  # driver, shim, proxy and the mount-namespace handler
        handler_env = {"CRUST_HANDLER_ENDPOINT": f"unix://{env.handler.socket}",
                       "CRUST_OCI_RUNTIME_STATE": str(root.path / "oci-runtime")}
        if "crust-microvm" in ENGINES[engine]:
            kata = root.handler(env.proxy, **KATA_HANDLER, extra=["--kata-dir", str(root.path / "kata")])
            kata.start(timeout=900)  # the first start on a machine builds the guest image
            handler_env["CRUST_KATA_HANDLER_ENDPOINT"] = f"unix://{kata.socket}"
        with DAEMONS[engine](registry, handler_env) as daemon:
            yield CritestNode(root, engine, daemon, registry)
    finally:
        registry.close()
        root.close()
        if made_cgroup_parent:
            # Our daemon and its containers are gone by now: a cgroup that
            # cannot be removed holds processes of another critest run on
            # this machine, which removes it when it ends.
            remove_cgroup_trees(CRITEST_CGROUP_PARENT)
    # As for every test's root: an unexpected exception in a daemon is a defect.
    assert not root.unexpected, "a daemon hit an unexpected error:\n" + "\n".join(root.unexpected[:20])


# -- a run -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    name: str
    group: str  # the top-level describe block, e.g. "[k8s.io] Container"
    state: str  # passed, failed, skipped, pending; panicked, timedout... count as failed
    seconds: float
    message: str = ""


@dataclass
class Run:
    handler: str
    specs: dict[str, Spec]
    seconds: float
    returncode: int
    output: str
    engine: str = "containerd"
    # spec -> how it failed the first time, for specs that passed when run
    # once more alone (rerun_unexpected_failures)
    flaked: dict[str, str] = field(default_factory=dict)
    # the mounts critest's specs left on the host, released after the run
    host_traces: list[str] = field(default_factory=list)

    def named(self, state: str) -> set[str]:
        return {n for n, s in self.specs.items() if s.state == state}

    @property
    def ran(self) -> set[str]:
        return self.named(PASSED) | self.named(FAILED)

    def counts(self) -> dict[str, int]:
        return {"ran": len(self.ran), PASSED: len(self.named(PASSED)), FAILED: len(self.named(FAILED)),
                SKIPPED: len(self.named(SKIPPED))}

    def why(self, name: str) -> str:
        """A failed spec's failure: its first words, and the gRPC status it
        names (gomega prints the status's code and text after a dump of the
        error's struct, past the first words)."""
        # runc's warnings (a line each in a runtime's error) hide its error.
        text = " ".join(RUNC_WARNING.sub("", self.specs[name].message).split())
        head = text[:300]
        status = re.search(r"rpc error: code = .{0,300}", text)
        return head if status is None or status.group(0) in head else f"{head} ... {status.group(0)}"


RUNC_WARNING = re.compile(r'time=\\?"[^"\\]*\\?" level=warning msg=\\?"(?:[^"\\]|\\.)*?\\?"')


def read_report(path: Path) -> dict[str, Spec]:
    """ginkgo's JSON report: each It, by its full text."""
    specs = {}
    for suite in json.loads(path.read_text()):
        for report in suite.get("SpecReports") or []:
            if report.get("LeafNodeType") != "It":
                continue
            hierarchy = report.get("ContainerHierarchyTexts") or []
            name = " ".join([*hierarchy, report["LeafNodeText"]])
            state = report["State"]
            if state not in (PASSED, SKIPPED, "pending"):
                state = FAILED
            failure = report.get("Failure") or {}
            specs[name] = Spec(name, hierarchy[0] if hierarchy else "", state, report.get("RunTime", 0) / 1e9,
                               failure.get("Message", ""))
    return specs


def run_critest(critest: Path, node: CritestNode, runtime_class: str, focus: str = "",
                timeout: float = 1800, attempt: int = 1, shard: str = "", traces: HostTraces | None = None) -> Run:
    """critest against the node's engine for one handler; the whole suite
    unless focused. The run is killed after timeout seconds; what its specs
    leave on the host is removed (tests/harness/critest_host.py), by `traces` when
    given (the caller's, around several runs at once), else around this
    run. shard names a run of a part of the suite beside others (its own
    directory and report)."""
    work = node.root.path / f"critest-{runtime_class}{'-' + shard if shard else ''}"
    work.mkdir(exist_ok=True)
    if traces is None:
        with HostTraces(work) as own:
            run = run_critest(critest, node, runtime_class, focus, timeout, attempt, shard, own)
        run.host_traces = own.removed
        return run
    report = work / f"report-{attempt}.json"
    endpoint = node.daemon.endpoint
    argv = [str(critest), f"--runtime-endpoint={endpoint}", f"--image-endpoint={endpoint}",
            f"--runtime-handler={node.handlers[runtime_class]}",
            "--ginkgo.no-color", f"--ginkgo.json-report={report}", f"--ginkgo.timeout={int(timeout)}s",
            # critest's benchmarks are not conformance (skipped by critest too).
            "--ginkgo.skip=benchmark"]
    if focus:
        argv.append(f"--ginkgo.focus={focus}")
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=work, timeout=timeout + 60,
                              env={**os.environ, "TMPDIR": str(traces.tmpdir)})
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, output = -9, f"critest ran past {timeout:g} s: {(exc.stdout or b'')[-3000:]!r}"
    seconds = time.monotonic() - started
    specs = read_report(report) if report.exists() else {}
    return Run(runtime_class, specs, seconds, returncode, output, engine=node.engine)


def run_critest_sharded(critest: Path, node: CritestNode, runtime_class: str, names: set[str], shards: int,
                        timeout: float = 1800) -> Run:
    """These specs in `shards` critest runs at once against the same node,
    each spec in exactly one (dealt in turn, by name), their reports merged
    into one Run; its seconds are the wall time of the slowest. critest runs
    its specs in parallel this way itself (ginkgo's nodes) when it finds a
    ginkgo binary, which is not here; no spec of the microVM's groups is
    marked Serial. The microVM's specs mostly wait (a VM boots under tcg, a
    poll interval passes), so two at a time use the machine's cores better.
    What the specs leave on the host is removed once all runs ended (one
    run's cleanup must not take a spec of another's from under it)."""
    dealt = [sorted(names)[i::shards] for i in range(shards)]
    with HostTraces(node.root.path / f"critest-{runtime_class}-shards") as traces, \
            ThreadPoolExecutor(max_workers=shards) as pool:
        runs = list(pool.map(lambda part: run_critest(critest, node, runtime_class, focus=exact_focus(set(part[1])),
                                                      timeout=timeout, shard=str(part[0]), traces=traces),
                             [(i, part) for i, part in enumerate(dealt) if part]))
    merged = Run(runtime_class, {}, max(r.seconds for r in runs), max(r.returncode for r in runs),
                 "\n".join(r.output for r in runs), engine=node.engine, host_traces=traces.removed)
    for run in runs:
        merged.specs.update({name: spec for name, spec in run.specs.items()
                             if spec.state != SKIPPED or name not in merged.specs})
    return merged


def logged_errors(node: CritestNode, last: int = 12) -> list[str]:
    """The last error lines of the engine's log and of crust's daemons'
    logs: what a spec that passes only when run again leaves to find its
    cause by (the node's directories are gone after the test)."""
    logs = dict.fromkeys([Path(node.daemon.log_path).resolve()] + sorted(node.root.path.resolve().glob("*.log")))
    found = []
    for log in logs:
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        found += [f"{log.name}: {line[:400]}" for line in lines
                  if "level=error" in line or '"level": "error"' in line or '"level": "warning"' in line][-last:]
    return found


def rerun_unexpected_failures(critest: Path, node: CritestNode, run: Run, known: set[str],
                              timeout: float = 900) -> Run:
    """Failed specs on no list, run once more, alone. One that passes then
    counts as passed and is kept in run.flaked with its first failure
    (the test prints them): a spec that fails now and then is seen, while
    a spec that fails every time still fails the test."""
    again = run.named(FAILED) - known
    if not again:
        return run
    logged = logged_errors(node)
    second = run_critest(critest, node, run.handler, focus=exact_focus(again), timeout=timeout, attempt=2)
    for name in sorted(again):
        if name in second.specs and second.specs[name].state == PASSED:
            run.flaked[name] = run.why(name) + ("\n    what the engine and crust's daemons logged as errors by "
                                                "then:\n      " + "\n      ".join(logged) if logged else "")
            run.specs[name] = second.specs[name]
    run.seconds += second.seconds
    run.host_traces += second.host_traces
    return run


# -- what does not pass here -------------------------------------------------------------------------


@dataclass(frozen=True)
class Expectations:
    # engine -> spec -> why runc fails it there too (what that engine or
    # this host lacks)
    baselines: dict[str, dict[str, str]]
    needs_registry: dict[str, str]  # spec -> why only a real registry can serve it
    # spec -> {reason, issue | vm_cannot | engine_lacks, engines (only
    # these; every engine without)}
    microvm: dict[str, dict]
    # engine -> spec -> the race of the engine's own its outcome turns on:
    # counted for no handler on that engine
    unstable: dict[str, dict[str, str]] = field(default_factory=dict)

    def baseline(self, engine: str) -> dict[str, str]:
        return self.baselines[engine]

    def unstable_on(self, engine: str) -> set[str]:
        return set(self.unstable.get(engine, {}))

    def microvm_for(self, engine: str) -> dict[str, dict]:
        """The microVM's exceptions on one engine."""
        return {spec: entry for spec, entry in self.microvm.items() if engine in entry.get("engines", ENGINES)}

    def known_failures(self, engine: str, runtime_class: str) -> set[str]:
        known = set(self.baseline(engine)) | set(self.needs_registry)
        return known | set(self.microvm_for(engine)) if runtime_class == "crust-microvm" else known


def load_expectations(path: Path = EXPECTATIONS) -> Expectations:
    data = yaml.safe_load(path.read_text())
    return Expectations(
        baselines={engine: {e["spec"]: e["reason"] for e in entries} for engine, entries in data["baseline"].items()},
        needs_registry={e["spec"]: e["reason"] for e in data["needs_registry"]},
        microvm={e["spec"]: {k: v for k, v in e.items() if k != "spec"} for e in data["microvm"]},
        unstable={engine: {e["spec"]: e["reason"] for e in entries}
                  for engine, entries in (data.get("unstable") or {}).items()})


def render_expectations(expectations: Expectations) -> str:
    """The lists as docs/conformance.md shows them (between its markers)."""
    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    lines = []
    for engine, baseline in expectations.baselines.items():
        lines += [f"Specs runc fails on this machine too ({ENGINE_NAMES[engine]}, this host):", "",
                  "| spec | why |", "|---|---|"]
        lines += [f"| {cell(spec)} | {cell(why)} |" for spec, why in sorted(baseline.items())]
        lines.append("")
    for engine, unstable in expectations.unstable.items():
        lines += [f"Specs whose outcome on {ENGINE_NAMES[engine]} turns on a race of the engine's own (counted for "
                  "no handler):", "", "| spec | why |", "|---|---|"]
        lines += [f"| {cell(spec)} | {cell(why)} |" for spec, why in sorted(unstable.items())]
        lines.append("")
    lines += ["Specs that need a real registry (never counted as passing):", "",
              "| spec | why |", "|---|---|"]
    lines += [f"| {cell(spec)} | {cell(why)} |" for spec, why in sorted(expectations.needs_registry.items())]
    by_issue = Counter(e.get("issue") or ("engine" if e.get("engine_lacks") else "vm")
                       for e in expectations.microvm.values())
    fixes = "".join(f"issue {i}: {by_issue[i]}; " for i in sorted(k for k in by_issue if k not in ("vm", "engine")))
    lines += ["", f"The microVM's exceptions ({len(expectations.microvm)} specs runc passes and "
              f"crust-microvm does not; {fixes}no VM runtime can: {by_issue['vm']}; the engine does not do "
              f"for a VM runtime: {by_issue['engine']}):", "",
              "| spec | why | fixed by |", "|---|---|---|"]
    for spec, entry in sorted(expectations.microvm.items()):
        fixed = (f"issue {entry['issue']}" if entry.get("issue") else
                 f"none: {cell(entry.get('vm_cannot') or entry['engine_lacks'])}")
        where = f"On {', '.join(ENGINE_NAMES[e] for e in entry['engines'])} only. " if "engines" in entry else ""
        lines.append(f"| {cell(spec)} | {where}{cell(entry['reason'])} | {fixed} |")
    return "\n".join(lines) + "\n"


BEGIN_MARK = "<!-- critest expectations: rendered from docs/critest.yaml by tests/harness/critest.py -->"
END_MARK = "<!-- end of critest expectations -->"


def documented_expectations(doc: Path = CONFORMANCE_DOC) -> str:
    text = doc.read_text()
    start, end = text.index(BEGIN_MARK) + len(BEGIN_MARK), text.index(END_MARK)
    return text[start:end].strip("\n") + "\n"


if __name__ == "__main__":
    # `python -m tests.harness.critest`: the block docs/conformance.md holds between its markers.
    print(render_expectations(load_expectations()), end="")
