/*
 * guest_maker: makes and runs one container the way bench/guest_crun.py's
 * full spec asks crun to, with no OCI runtime, to tell the kernel's part of
 * a container's start from the runtime's own (bench/guest_crun.py runs both
 * in one guest, taking turns).
 *
 *   guest_maker ROOTFS CGROUP_PARENT NAME
 *
 * The container's process is cloned into a new PID namespace and into a
 * cgroup of its own below CGROUP_PARENT (removed after its exit), then
 * takes new IPC, UTS and mount namespaces; ROOTFS bound, /proc, a /dev
 * tmpfs with the default devices, /dev/pts, /dev/mqueue, /sys read-only
 * and /dev/shm mounted in it; the root pivoted and the old one detached; masked and read-only paths; the
 * hostname; the capability sets cut to the spec's, no_new_privs; then
 * /bin/true executed. The cgroup's device rule is not set: cgroup v2 takes
 * it as an eBPF program, which this program does not load.
 *
 * Exits with the container's status (120 when a step failed, named on
 * stderr).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#define FAILED 120

static const char *const MASKED[] = {
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap", NULL};
static const char *const READ_ONLY[] = {"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger", NULL};
/* The spec's capabilities, by number (capabilities(7)). */
static const int KEPT_CAPS[] = {0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31, -1};
static const struct {
    const char *name;
    unsigned major, minor;
} DEVICES[] = {{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}};

static void fail(const char *step)
{
    fprintf(stderr, "%s: %s\n", step, strerror(errno));
    _exit(FAILED);
}

static void mount_at(const char *root, const char *where, const char *source, const char *type,
                     unsigned long flags, const char *data)
{
    char path[4096];
    snprintf(path, sizeof path, "%s%s", root, where);
    if (mount(source, path, type, flags, data) != 0)
        fail(path);
}

static void make_dev(const char *root)
{
    char path[4096];
    mount_at(root, "/dev", "tmpfs", "tmpfs", MS_NOSUID | MS_STRICTATIME, "mode=755,size=65536k");
    for (size_t i = 0; i < sizeof DEVICES / sizeof DEVICES[0]; i++) {
        snprintf(path, sizeof path, "%s/dev/%s", root, DEVICES[i].name);
        if (mknod(path, S_IFCHR | 0666, makedev(DEVICES[i].major, DEVICES[i].minor)) != 0)
            fail(path);
    }
    static const char *const dirs[] = {"/dev/pts", "/dev/mqueue", "/dev/shm"};
    for (size_t i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s%s", root, dirs[i]);
        if (mkdir(path, 0755) != 0)
            fail(path);
    }
    mount_at(root, "/dev/pts", "devpts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5");
    mount_at(root, "/dev/mqueue", "mqueue", "mqueue", MS_NOSUID | MS_NOEXEC | MS_NODEV, NULL);
    mount_at(root, "/dev/shm", "shm", "tmpfs", MS_NOSUID | MS_NOEXEC | MS_NODEV, "mode=1777,size=65536k");
}

static void confine(void)
{
    for (int i = 0; MASKED[i]; i++) {
        struct stat st;
        if (stat(MASKED[i], &st) != 0)
            continue;   /* absent: nothing to hide */
        if (mount(S_ISDIR(st.st_mode) ? "tmpfs" : "/dev/null", MASKED[i], S_ISDIR(st.st_mode) ? "tmpfs" : NULL,
                  S_ISDIR(st.st_mode) ? MS_RDONLY : MS_BIND, NULL) != 0)
            fail(MASKED[i]);
    }
    for (int i = 0; READ_ONLY[i]; i++) {
        if (mount(READ_ONLY[i], READ_ONLY[i], NULL, MS_BIND | MS_REC, NULL) != 0) {
            if (errno == ENOENT)
                continue;
            fail(READ_ONLY[i]);
        }
        if (mount(NULL, READ_ONLY[i], NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC, NULL) != 0)
            fail(READ_ONLY[i]);
    }
    if (sethostname("bench", 5) != 0)
        fail("sethostname");
    unsigned long long kept = 0;
    for (int i = 0; KEPT_CAPS[i] >= 0; i++)
        kept |= 1ULL << KEPT_CAPS[i];
    int last = 0;
    FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "r");
    if (!f || fscanf(f, "%d", &last) != 1)
        fail("cap_last_cap");
    fclose(f);
    for (int cap = 0; cap <= last; cap++)
        if (!(kept >> cap & 1) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0)
            fail("PR_CAPBSET_DROP");
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2] = {{(__u32)kept, (__u32)kept, 0}, {(__u32)(kept >> 32), (__u32)(kept >> 32), 0}};
    if (syscall(SYS_capset, &header, data) != 0)
        fail("capset");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        fail("PR_SET_NO_NEW_PRIVS");
}

static void container(const char *root)
{
    /* Namespaces of its own, not the parent's: a pivot moves the root of every process of the mount namespace. */
    if (unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC) != 0)
        fail("unshare");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0)
        fail("/ private");
    if (mount(root, root, NULL, MS_BIND | MS_REC, NULL) != 0)
        fail(root);
    mount_at(root, "/proc", "proc", "proc", MS_NOSUID | MS_NOEXEC | MS_NODEV, NULL);
    make_dev(root);
    mount_at(root, "/sys", "sysfs", "sysfs", MS_NOSUID | MS_NOEXEC | MS_NODEV | MS_RDONLY, NULL);
    if (chdir(root) != 0 || syscall(SYS_pivot_root, ".", ".") != 0)
        fail("pivot_root");
    if (umount2(".", MNT_DETACH) != 0 || chdir("/") != 0)
        fail("the old root");
    if (mount(NULL, "/", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY, NULL) != 0)
        fail("/ read-only");
    confine();
    char *argv[] = {"/bin/true", NULL};
    char *envp[] = {"PATH=/sbin:/bin:/usr/sbin:/usr/bin", NULL};
    execve(argv[0], argv, envp);
    fail("execve");
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: guest_maker ROOTFS CGROUP_PARENT NAME\n");
        return 2;
    }
    char cgroup[4096];
    snprintf(cgroup, sizeof cgroup, "%s/%s", argv[2], argv[3]);
    if (mkdir(cgroup, 0755) != 0)
        fail(cgroup);
    int cgroup_fd = open(cgroup, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (cgroup_fd < 0)
        fail(cgroup);
    /* Born in its cgroup and its PID namespace: a move into a cgroup waits for an RCU grace period. */
    struct clone_args args = {.flags = CLONE_NEWPID | CLONE_INTO_CGROUP, .exit_signal = SIGCHLD,
                              .cgroup = (__u64)cgroup_fd};
    pid_t pid = (pid_t)syscall(SYS_clone3, &args, sizeof args);
    if (pid < 0)
        fail("clone3");
    if (pid == 0)
        container(argv[1]);
    int status;
    if (waitpid(pid, &status, 0) != pid)
        fail("waitpid");
    if (rmdir(cgroup) != 0)
        fail(cgroup);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
