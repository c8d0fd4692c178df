"""The images critest pulls, made here from Debian's busybox-static and put
into a local registry (crust.kubelet.registry) under the names critest
uses, so its specs run without a network.

What each spec expects of its image was read from cri-tools' pkg/validate
(commit ba03eabc) and its images/ recipes; every image here is busybox
plus what those specs look for:

- registry.k8s.io/e2e-test-images/busybox:1.29-2, the default container
  image: busybox with its applets as hard links (as registries' busybox
  images have them: masking /bin/ls masks ls alone), the users the
  security-context specs name (nobody), and `pgrep` and `ipcs -m`, two
  applets Debian's static busybox lacks, as short scripts reading /proc
  (the exec-timeout and IPC-namespace specs run them). Every image below
  is built on the same layers.
- registry.k8s.io/e2e-test-images/nginx:1.14-2 and
  gcr.io/k8s-staging-cri-tools/hostnet-nginx-<arch> (port 12003): a web
  server that answers 200 on /, whose first process is named nginx, says
  "master process" in its command line and writes /var/run/nginx.pid (the
  PID-namespace specs look for those). busybox's httpd stands in for nginx.
- registry.k8s.io/e2e-test-images/httpd:2.4.39-4 (the multi-container
  specs): busybox's httpd again, in Apache httpd's place, saying "httpd" in
  its log.
- registry.k8s.io/e2e-test-images/nonewprivs:1.3: a program installed
  setuid root that prints its effective uid, compiled here from a few lines
  of C (static, so it needs nothing of the image).
- gcr.io/k8s-staging-cri-tools/test-image-*: the image specs' images: users
  (uid, name, uid:group, name:group), a user of a group defined in the
  image, three different images, one image under three tags, tags
  `test` and `all`, an untagged name (latest).
- registry.k8s.io/pause:3.9, also as k8s.gcr.io/pause:3.9 (one image from
  two registries), also the pods' sandbox image: a program named pause that
  waits for a signal and exits, compiled here like nonewprivs, whose stop
  signal is SIGKILL. Its name
  matters: in a pod sharing one PID namespace it is every container's
  process 1, and a spec that looks for a leftover `sleep` must not find it.

One image cannot be made: gcr.io/k8s-staging-cri-tools/test-image-digest
is pulled by a digest fixed in critest, the hash of upstream's exact
bytes. The spec that pulls it needs a real registry (docs/critest.yaml).

Building all of them takes well under a second (layers are written in
memory, deterministically: the same busybox and compiler give the same
digests), so nothing is cached between runs.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from crust.kubelet import image as images
from crust.kubelet.registry import LocalRegistry, split_reference

E2E = "registry.k8s.io/e2e-test-images"
CRI_TOOLS = "gcr.io/k8s-staging-cri-tools"
# Every registry host critest names; each is mirrored to the local registry.
REGISTRY_HOSTS = ("registry.k8s.io", "gcr.io", "k8s.gcr.io")

PASSWD = """\
root:x:0:0:root:/root:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/bin/false
bin:x:2:2:bin:/bin:/bin/false
sys:x:3:3:sys:/dev:/bin/false
www-data:x:33:33:www-data:/var/www:/bin/false
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
"""
GROUP = """\
root:x:0:
daemon:x:1:
bin:x:2:
sys:x:3:
www-data:x:33:
nogroup:x:65534:
"""
# test-image-predefined-group: uid 1000 is a member of gid 50000 by /etc/group.
PREDEFINED_PASSWD = PASSWD + "default-user:x:1000:1000::/home/default-user:/bin/sh\n"
PREDEFINED_GROUP = GROUP + "default-user:x:1000:\ngroup-defined-in-image:x:50000:default-user\n"

# busybox's httpd in nginx's place. It re-executes itself once so that its
# command line reads like nginx's master process; it stays the container's
# first process (named nginx, its pid in nginx's pid file) and ends its
# server on SIGTERM.
NGINX = """\
#!/bin/sh
if [ "$1" != "nginx: master process" ]; then
    exec "$0" "nginx: master process" "$@"
fi
echo $$ > /var/run/nginx.pid
httpd -f -p "${NGINX_PORT:-80}" -h /usr/share/nginx/html &
server=$!
trap 'kill $server 2>/dev/null; exit 0' TERM INT QUIT
wait $server
"""
INDEX_HTML = "<html><body>busybox httpd standing in for nginx</body></html>\n"

HTTPD_FOREGROUND = """\
#!/bin/sh
echo "httpd: busybox httpd standing in for Apache httpd, serving port 80" >&2
exec httpd -f -p 80 -h /usr/local/apache2/htdocs
"""

# pgrep PATTERN: the pids of the processes whose name matches PATTERN (an
# extended regular expression), itself left out; exit status 1 when none.
PGREP = """\
#!/bin/sh
found=1
for dir in /proc/[0-9]*; do
    read -r name 2>/dev/null < "$dir/comm" || continue
    pid=${dir#/proc/}
    [ "$pid" = "$$" ] && continue
    if echo "$name" | grep -Eq -- "$1"; then
        echo "$pid"
        found=0
    fi
done
exit $found
"""

# ipcs -m: the System V shared memory segments of the caller's IPC
# namespace (/proc/sysvipc/shm shows those alone).
IPCS = """\
#!/bin/sh
if [ "$*" != "-m" ]; then
    echo "ipcs: only -m is supported here" >&2
    exit 1
fi
echo
echo "------ Shared Memory Segments --------"
echo "key        shmid      owner      perms      bytes      nattch"
tail -n +2 /proc/sysvipc/shm | while read -r key shmid perms size cpid lpid nattch uid rest; do
    echo "$key $shmid $uid $perms $size $nattch"
done
"""

# The nonewprivs program: with no_new_privs off, exec honours the setuid bit
# and the process runs as root; with it on, as the user that started it.
NONEWPRIVS_C = """\
#include <stdio.h>
#include <unistd.h>

int main(void)
{
    printf("Effective uid: %u\\n", (unsigned)geteuid());
    return 0;
}
"""


# The pod's first process: it only waits, and ends at SIGTERM or SIGINT.
PAUSE_C = """\
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

static void stop(int sig)
{
    (void)sig;
    exit(0);
}

int main(void)
{
    signal(SIGTERM, stop);
    signal(SIGINT, stop);
    for (;;)
        pause();
}
"""

PAUSE = "registry.k8s.io/pause:3.9"


class ImageBuildError(Exception):
    pass


@dataclass(frozen=True)
class Published:
    """One reference critest uses, and the image behind it."""

    reference: str
    image: images.OciImage


def compile_static(directory: Path, name: str, source: str) -> bytes:
    """A C program, linked statically (the images have no C library)."""
    compiler = shutil.which("gcc")
    if compiler is None:
        raise ImageBuildError(f"gcc is not installed (apt-get install gcc libc6-dev): the {name} image needs it")
    source_path, binary = directory / f"{name}.c", directory / name
    source_path.write_text(source)
    result = subprocess.run([compiler, "-static", "-Os", "-s", "-o", str(binary), str(source_path)],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise ImageBuildError(f"gcc -static {name}.c: {result.stderr.strip()[-1500:]}")
    return binary.read_bytes()


def _dir(path: str, mode: int = 0o755) -> images.File:
    return images.File(path, mode=mode, is_dir=True)


def build_all(busybox: Path | None = None) -> list[Published]:
    """Every image critest pulls (but the digest-pinned one), by reference."""
    busybox = busybox or images.find_busybox()
    images.check_static(busybox)
    version = images.busybox_version(busybox)
    base = images.layer_tar(busybox, passwd=PASSWD, group=GROUP, hard_links=True)
    tools = images.layer_of([images.File("usr/bin/pgrep", PGREP.encode(), mode=0o755),
                             images.File("usr/bin/ipcs", IPCS.encode(), mode=0o755)])
    env = [f"PATH={images.PATH}"]

    def image(config: dict, *extra_layers: bytes, base_layer: bytes = base) -> images.OciImage:
        return images.assemble([base_layer, tools, *extra_layers], {"Env": env, "WorkingDir": "/", **config},
                               created_by=f"crust critest image: Debian busybox-static {version}")

    def marker(name: str) -> bytes:
        """A layer with one empty file named for the image (as upstream's
        test images differ from each other)."""
        return images.layer_of([images.File(name)])

    shell = {"Cmd": ["sh"]}
    published = [Published(f"{E2E}/busybox:1.29-2", image(shell))]

    def web_server(port: int) -> images.OciImage:
        return image({"Cmd": ["nginx", "-g", "daemon off;"], "Env": [*env, f"NGINX_PORT={port}"],
                      "ExposedPorts": {f"{port}/tcp": {}}},
                     images.layer_of([_dir("usr/share"), _dir("usr/share/nginx"), _dir("usr/share/nginx/html"),
                                      images.File("usr/share/nginx/html/index.html", INDEX_HTML.encode()),
                                      images.File("usr/sbin/nginx", NGINX.encode(), mode=0o755),
                                      _dir("var/run")]))

    published.append(Published(f"{E2E}/nginx:1.14-2", web_server(80)))
    published.append(Published(f"{E2E}/httpd:2.4.39-4", image(
        {"Cmd": ["httpd-foreground"], "ExposedPorts": {"80/tcp": {}}},
        images.layer_of([_dir("usr/local"), _dir("usr/local/bin"), _dir("usr/local/apache2"),
                         _dir("usr/local/apache2/htdocs"),
                         images.File("usr/local/apache2/htdocs/index.html", b"<html><body>It works!</body></html>\n"),
                         images.File("usr/local/bin/httpd-foreground", HTTPD_FOREGROUND.encode(), mode=0o755)]))))
    published.append(Published(f"{CRI_TOOLS}/hostnet-nginx-{images.architecture()}:latest", web_server(12003)))

    with tempfile.TemporaryDirectory(prefix="crust-critest-c-") as scratch:
        nonewprivs = compile_static(Path(scratch), "nonewprivs", NONEWPRIVS_C)
        pause_program = compile_static(Path(scratch), "pause", PAUSE_C)
    published.append(Published(f"{E2E}/nonewprivs:1.3", image(
        {"Entrypoint": ["/usr/local/bin/nonewprivs"]},
        images.layer_of([_dir("usr/local"), _dir("usr/local/bin"),
                         images.File("usr/local/bin/nonewprivs", nonewprivs, mode=0o4755)]))))

    for name, user in (("test-image-user-uid", "1002"), ("test-image-user-username", "www-data"),
                       ("test-image-user-uid-group", "1003:1004"),
                       ("test-image-user-username-group", "www-data:1004")):
        published.append(Published(f"{CRI_TOOLS}/{name}:latest", image({**shell, "User": user})))
    predefined = images.layer_tar(busybox, passwd=PREDEFINED_PASSWD, group=PREDEFINED_GROUP, hard_links=True)
    published.append(Published(f"{CRI_TOOLS}/test-image-predefined-group:latest",
                               image({**shell, "User": "1000"}, base_layer=predefined)))

    for name in ("test-image-1", "test-image-2", "test-image-3", "test-image-latest"):
        published.append(Published(f"{CRI_TOOLS}/{name}:latest", image(shell, marker(name))))
    for tag in ("test", "all"):
        published.append(Published(f"{CRI_TOOLS}/test-image-tag:{tag}", image(shell, marker(tag))))
    same = image(shell, marker("same-image"))
    published += [Published(f"{CRI_TOOLS}/test-image-tags:{tag}", same) for tag in ("1", "2", "3")]

    # StopSignal SIGKILL: CRI-O stops an infra container with its image's
    # stop signal, and a SIGTERM that reaches the pause before its handler
    # is set (a pod stopped right after it started, as critest's specs do)
    # is dropped for a namespace's first process: the stop waits out its
    # timeout. A pause has nothing to end gracefully.
    pause = image({"Entrypoint": ["/pause"], "StopSignal": "SIGKILL"},
                  images.layer_of([images.File("pause", pause_program, mode=0o755)]))
    published += [Published(PAUSE, pause), Published("k8s.gcr.io/pause:3.9", pause)]
    return published


def push_all(registry: LocalRegistry, published: list[Published]) -> None:
    """Each image under its repository and tag; the registry host of the
    reference is dropped (every host is mirrored to this one registry)."""
    for item in published:
        host, repository, tag = split_reference(item.reference)
        if host not in REGISTRY_HOSTS:
            raise ImageBuildError(f"{item.reference}: {host} is not a mirrored registry host")
        registry.push(item.image, repository, [tag])

