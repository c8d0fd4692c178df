/*
 * enter: start a process inside a running container, confined as its OCI
 * process says, for the guest agent (crust/guest/enter.py prepares every
 * argument and reads the report).
 *
 * The agent forks this program with vfork (a fork of the agent's Python
 * would copy its memory: a hundred milliseconds of the guest's one vCPU
 * under emulation). It starts outside the container and makes itself
 * undumpable before anything else, so nothing in the container can trace
 * it while it holds every capability. It sets the OOM score, enters the
 * namespaces of the container's first process by its pidfd (the PID
 * namespace applies to its children), takes the umask, directory and
 * rlimits, and clones the process with CLONE_PARENT and CLONE_INTO_CGROUP:
 * a child of the agent, born in the container's PID namespace and cgroup
 * (no migration, which waits for the kernel's RCU), undumpable until its
 * exec. The child takes a session of its
 * own, drops the bounding set, changes ids keeping its permitted set, sets
 * the capability sets, no_new_privs and the seccomp filter (before the ids
 * when no_new_privs is unset: the kernel takes a filter then only from a
 * holder of CAP_SYS_ADMIN), sets HOME from the container's /etc/passwd when
 * the environment has none, and executes the program on its PATH.
 *
 *   enter report=FD pidfd=FD ns=FLAGS [cgroup=DIRFD] [oom=N] umask=N cwd=PATH
 *         uid=N gid=N [groups=N,N...] lastcap=N bounding=HEX effective=HEX
 *         permitted=HEX inheritable=HEX ambient=HEX nnp=0|1 [seccomp=FD
 *         seccomp_flags=N] [rlimit=RES:SOFT:HARD ...] [console=FD [rows=N
 *         columns=N]] -- PROGRAM ARGS...
 *
 * With console (a connected unix socket), the process runs on a terminal
 * of the container's own: once inside its namespaces, this program opens
 * the container's /dev/ptmx (its devpts), sizes the terminal, opens the
 * terminal's other end by the master (TIOCGPTPEER: no path looked up),
 * hands the master to the agent over the socket (SCM_RIGHTS) and gives
 * the other end to the process as its controlling terminal and standard
 * streams, owned by the process's user as runc leaves it.
 *
 * The report (a pipe the agent reads to its end) gets "pid N" (the
 * process, as the agent's PID namespace numbers it) and, on a failure,
 * "error STEP: REASON"; it ends once the process executed or failed. This
 * program exits 0 once the process is cloned, 1 when it failed before.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/close_range.h>
#include <linux/filter.h>
#include <linux/sched.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#define MAX_RLIMITS 16
#define MAX_GROUPS 1024
#define MAX_FILTER (4096 * sizeof(struct sock_filter))
/* The multiplexer's device, devpts' ptmx as /dev/ptmx (devices.txt). */
#define PTMX_MAJOR 5
#define PTMX_MINOR 2

static int report = -1;

static void say(const char *text)
{
    size_t len = strlen(text);
    while (len > 0) {
        ssize_t n = write(report, text, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return;
        text += n;
        len -= (size_t)n;
    }
}

static void fail(const char *step, const char *detail)
{
    char line[1024];
    snprintf(line, sizeof(line), "error %s%s%s: %s\n", step, detail ? ": " : "", detail ? detail : "",
             strerror(errno));
    say(line);
    _exit(127);
}

static long long number(const char *text, int base, const char *what)
{
    char *end;
    errno = 0;
    long long value = strtoll(text, &end, base);
    if (errno || end == text || *end) {
        errno = EINVAL;
        fail("argument", what);
    }
    return value;
}

static unsigned long long mask(const char *text, const char *what)
{
    char *end;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 16);
    if (errno || end == text || *end) {
        errno = EINVAL;
        fail("argument", what);
    }
    return value;
}

struct spec {
    int pidfd, ns, cgroup, has_oom, oom, umask_, nnp, seccomp, seccomp_flags, lastcap;
    int console, rows, columns, terminal;
    const char *cwd;
    uid_t uid;
    gid_t gid;
    gid_t groups[MAX_GROUPS];
    size_t ngroups;
    unsigned long long bounding, effective, permitted, inheritable, ambient;
    struct { int resource; struct rlimit limit; } rlimits[MAX_RLIMITS];
    int nrlimits;
    char **argv;
};

static void parse_groups(struct spec *s, const char *text)
{
    char copy[16384];
    snprintf(copy, sizeof(copy), "%s", text);
    for (char *save = NULL, *part = strtok_r(copy, ",", &save); part; part = strtok_r(NULL, ",", &save)) {
        if (s->ngroups == MAX_GROUPS) {
            errno = E2BIG;
            fail("process.user.additionalGids", NULL);
        }
        s->groups[s->ngroups++] = (gid_t)number(part, 10, "groups");
    }
}

static void parse_rlimit(struct spec *s, const char *text)
{
    unsigned long long soft, hard;
    int resource;
    if (s->nrlimits == MAX_RLIMITS || sscanf(text, "%d:%llu:%llu", &resource, &soft, &hard) != 3) {
        errno = EINVAL;
        fail("argument", "rlimit");
    }
    s->rlimits[s->nrlimits].resource = resource;
    s->rlimits[s->nrlimits].limit.rlim_cur = soft;
    s->rlimits[s->nrlimits].limit.rlim_max = hard;
    s->nrlimits++;
}

static void parse(struct spec *s, int argc, char **argv)
{
    int i;
    memset(s, 0, sizeof(*s));
    s->pidfd = s->cgroup = s->seccomp = s->console = s->terminal = -1;
    s->cwd = "/";
    for (i = 1; i < argc && strcmp(argv[i], "--") != 0; i++) {
        char *arg = argv[i], *value = strchr(arg, '=');
        if (!value) {
            errno = EINVAL;
            fail("argument", arg);
        }
        *value++ = '\0';
        if (!strcmp(arg, "report")) report = (int)number(value, 10, arg);
        else if (!strcmp(arg, "pidfd")) s->pidfd = (int)number(value, 10, arg);
        else if (!strcmp(arg, "ns")) s->ns = (int)number(value, 10, arg);
        else if (!strcmp(arg, "cgroup")) s->cgroup = (int)number(value, 10, arg);
        else if (!strcmp(arg, "oom")) { s->has_oom = 1; s->oom = (int)number(value, 10, arg); }
        else if (!strcmp(arg, "umask")) s->umask_ = (int)number(value, 10, arg);
        else if (!strcmp(arg, "cwd")) s->cwd = value;
        else if (!strcmp(arg, "uid")) s->uid = (uid_t)number(value, 10, arg);
        else if (!strcmp(arg, "gid")) s->gid = (gid_t)number(value, 10, arg);
        else if (!strcmp(arg, "groups")) parse_groups(s, value);
        else if (!strcmp(arg, "lastcap")) s->lastcap = (int)number(value, 10, arg);
        else if (!strcmp(arg, "bounding")) s->bounding = mask(value, arg);
        else if (!strcmp(arg, "effective")) s->effective = mask(value, arg);
        else if (!strcmp(arg, "permitted")) s->permitted = mask(value, arg);
        else if (!strcmp(arg, "inheritable")) s->inheritable = mask(value, arg);
        else if (!strcmp(arg, "ambient")) s->ambient = mask(value, arg);
        else if (!strcmp(arg, "nnp")) s->nnp = (int)number(value, 10, arg);
        else if (!strcmp(arg, "seccomp")) s->seccomp = (int)number(value, 10, arg);
        else if (!strcmp(arg, "seccomp_flags")) s->seccomp_flags = (int)number(value, 10, arg);
        else if (!strcmp(arg, "rlimit")) parse_rlimit(s, value);
        else if (!strcmp(arg, "console")) s->console = (int)number(value, 10, arg);
        else if (!strcmp(arg, "rows")) s->rows = (int)number(value, 10, arg);
        else if (!strcmp(arg, "columns")) s->columns = (int)number(value, 10, arg);
        else {
            errno = EINVAL;
            fail("argument", arg);
        }
    }
    if (report < 0 || s->pidfd < 0 || i + 1 >= argc) {
        errno = EINVAL;
        fail("argument", "report, pidfd and a program are needed");
    }
    s->argv = &argv[i + 1];
}

static void write_text(int fd, const char *text, const char *step)
{
    if (write(fd, text, strlen(text)) < 0)
        fail(step, NULL);
}

/* The compiled filter, read whole before any change (its file is the
 * runtime's, outside the container). */
static struct sock_fprog read_filter(int fd)
{
    static unsigned char buffer[MAX_FILTER];
    size_t got = 0;
    ssize_t n;
    while ((n = read(fd, buffer + got, sizeof(buffer) - got)) > 0)
        got += (size_t)n;
    if (n < 0)
        fail("linux.seccomp", "reading the compiled filter");
    if (got == 0 || got % sizeof(struct sock_filter) || got == sizeof(buffer)) {
        errno = EINVAL;
        fail("linux.seccomp", "the compiled filter");
    }
    struct sock_fprog program = {(unsigned short)(got / sizeof(struct sock_filter)), (struct sock_filter *)buffer};
    return program;
}

static void load_filter(const struct spec *s, struct sock_fprog *program)
{
    if (s->seccomp >= 0 && syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, s->seccomp_flags, program) != 0)
        fail("linux.seccomp", "loading the filter");
}

static void set_home(uid_t uid)
{
    char line[4096];
    const char *home = "/";
    static char found[4096];
    if (getenv("HOME"))
        return;
    FILE *passwd = fopen("/etc/passwd", "re");
    if (passwd) {
        while (fgets(line, sizeof(line), passwd)) {
            char *fields[7] = {0};
            char *p = line;
            int n = 0;
            line[strcspn(line, "\n")] = '\0';
            /* strsep keeps empty fields, as the format has them. */
            while (n < 7 && (fields[n] = strsep(&p, ":")) != NULL)
                n++;
            if (n >= 6 && fields[2][0] && strtoul(fields[2], NULL, 10) == uid && fields[5][0]) {
                snprintf(found, sizeof(found), "%s", fields[5]);
                home = found;
                break;
            }
        }
        fclose(passwd);
    }
    if (setenv("HOME", home, 1) != 0)
        fail("process.env", "HOME");
}

static void hand_over(int console, int master)
{
    char byte = 't';
    struct iovec iov = {&byte, 1};
    union {
        char buffer[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    memset(&control, 0, sizeof(control));
    struct msghdr message = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buffer,
                             .msg_controllen = sizeof(control.buffer)};
    struct cmsghdr *header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(header), &master, sizeof(int));
    if (sendmsg(console, &message, MSG_NOSIGNAL) != 1)
        fail("process.terminal", "handing the master to the agent");
}

/* The process's terminal, made in the container's devpts (the caller is
 * inside its mount namespace): its other end, the master handed over. */
static int make_terminal(const struct spec *s)
{
    struct stat st;
    int master = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_NONBLOCK | O_CLOEXEC);
    if (master < 0)
        fail("process.terminal", "the container's /dev/ptmx");
    if (fstat(master, &st) != 0 || !S_ISCHR(st.st_mode) || major(st.st_rdev) != PTMX_MAJOR ||
        minor(st.st_rdev) != PTMX_MINOR) {
        errno = ENOTTY;
        fail("process.terminal", "the container's /dev/ptmx is no terminal multiplexer");
    }
    int unlock = 0;
    if (ioctl(master, TIOCSPTLCK, &unlock) != 0)
        fail("process.terminal", "unlocking the terminal");
    if (s->rows > 0 && s->columns > 0) {
        struct winsize size = {.ws_row = (unsigned short)s->rows, .ws_col = (unsigned short)s->columns};
        if (ioctl(master, TIOCSWINSZ, &size) != 0)
            fail("process.consoleSize", NULL);
    }
    int terminal = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (terminal < 0)
        fail("process.terminal", "opening the terminal");
    if (s->uid != 0 && fchown(terminal, s->uid, (gid_t)-1) != 0)
        fail("process.terminal", "giving the terminal to the process's user");
    hand_over(s->console, master);
    close(master);
    return terminal;
}

static void take_terminal(int terminal)
{
    if (ioctl(terminal, TIOCSCTTY, 0) != 0)
        fail("process.terminal", "as the controlling terminal");
    for (int fd = 0; fd < 3; fd++)
        if (dup2(terminal, fd) != fd)
            fail("process.terminal", "as the standard streams");
    if (terminal > 2)
        close(terminal);
}

static void confine_and_exec(const struct spec *s, struct sock_fprog *program)
{
    if (setsid() < 0)
        fail("setsid", NULL);
    if (s->terminal >= 0)
        take_terminal(s->terminal);
    if (!s->nnp)
        load_filter(s, program);
    for (int cap = 0; cap <= s->lastcap; cap++)
        if (!(s->bounding >> cap & 1) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0)
            fail("process.capabilities.bounding", NULL);
    if (setgroups(s->ngroups, s->groups) != 0)
        fail("process.user.additionalGids", NULL);
    if (setresgid(s->gid, s->gid, s->gid) != 0)
        fail("process.user.gid", NULL);
    if (prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0 || setresuid(s->uid, s->uid, s->uid) != 0 ||
        prctl(PR_SET_KEEPCAPS, 0, 0, 0, 0) != 0)
        fail("process.user.uid", NULL);
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2] = {
        {(uint32_t)s->effective, (uint32_t)s->permitted, (uint32_t)s->inheritable},
        {(uint32_t)(s->effective >> 32), (uint32_t)(s->permitted >> 32), (uint32_t)(s->inheritable >> 32)},
    };
    if (syscall(SYS_capset, &header, data) != 0)
        fail("process.capabilities", NULL);
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0)
        fail("process.capabilities.ambient", NULL);
    /* The kernel raises an ambient capability only if it is permitted and
     * inheritable (EPERM otherwise); the OCI runtimes skip the others. */
    for (int cap = 0; cap <= s->lastcap; cap++)
        if ((s->ambient >> cap & 1) && prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0) != 0 && errno != EPERM)
            fail("process.capabilities.ambient", NULL);
    if (s->nnp) {
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
            fail("process.noNewPrivileges", NULL);
        load_filter(s, program);
    }
    set_home(s->uid);
    execvp(s->argv[0], s->argv);
    fail("process.args", s->argv[0]);
}

int main(int argc, char **argv)
{
    struct spec s;
    struct sock_fprog program = {0, NULL};
    char line[64];

    /* First: nothing may trace this process or read its memory. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    parse(&s, argc, argv);
    if (fcntl(report, F_SETFD, FD_CLOEXEC) != 0)
        fail("report", NULL);
    if (s.seccomp >= 0)
        program = read_filter(s.seccomp);
    if (s.has_oom) {
        snprintf(line, sizeof(line), "%d", s.oom);
        int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (fd < 0)
            fail("process.oomScoreAdj", NULL);
        write_text(fd, line, "process.oomScoreAdj");
        close(fd);
    }
    if (setns(s.pidfd, s.ns | CLONE_NEWPID) != 0)
        fail("linux.namespaces", "entering the container's namespaces");
    umask((mode_t)s.umask_);
    if (s.console >= 0)
        s.terminal = make_terminal(&s);
    if (chdir(s.cwd) != 0)
        fail("process.cwd", s.cwd);
    for (int i = 0; i < s.nrlimits; i++)
        if (setrlimit((__rlimit_resource_t)s.rlimits[i].resource, &s.rlimits[i].limit) != 0)
            fail("process.rlimits", NULL);
    /* Every descriptor but the standard ones closes at the exec. */
    if (syscall(SYS_close_range, 3, ~0U, CLOSE_RANGE_CLOEXEC) != 0)
        fail("close_range", NULL);

    struct clone_args clone = {.flags = CLONE_PARENT};
    if (s.cgroup >= 0) {
        clone.flags |= CLONE_INTO_CGROUP;
        clone.cgroup = (uint64_t)s.cgroup;
    }
    pid_t pid = (pid_t)syscall(SYS_clone3, &clone, sizeof(clone));
    if (pid < 0)
        fail("clone3", s.cgroup >= 0 ? "into the container's cgroup" : NULL);
    if (pid == 0)
        confine_and_exec(&s, &program);
    snprintf(line, sizeof(line), "pid %d\n", pid);
    say(line);
    return 0;
}
