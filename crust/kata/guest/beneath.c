/*
 * beneath: bind a path below a volume's root without ever leaving it, for
 * a container's subPath.
 *
 * A container of the pod can rewrite the volume (an emptyDir it shares)
 * while another container's subPath is resolved in it: a name checked as
 * a directory may be a symlink to / a moment later. So nothing here
 * resolves a string twice. The subPath is opened with openat2 below a
 * descriptor of the root (RESOLVE_BENEATH: a link or ".." that would leave
 * it fails; RESOLVE_NO_MAGICLINKS: no /proc/.../fd jump), missing
 * directories are made with mkdirat on a descriptor of their parent
 * (kubelet makes a missing subPath with the volume directory's mode), and
 * the bind is made from the descriptor that was opened (open_tree and
 * move_mount), so the mount is of exactly the file that was checked.
 *
 *   beneath [--strict] <root> <subpath> <target>
 *
 * --strict (a deferred volume's subpath, as crust's handlers take one):
 * the subpath must exist and pass no symlink at all; nothing is made.
 *
 * root is an absolute path the agent owns (a volume's mount point, the
 * pod's tmpfs); subpath is relative, without "..". target (made here, a
 * directory or an empty file as the subPath is) gets the bind. Prints
 * "kind=dir" or "kind=file"; a reason on stderr and exit 1 otherwise, exit
 * 2 when the subpath leads out of the root.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/mount.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PATH_MAX_LEN 4096
#define LEAVES_ROOT 2

static const char *subpath_arg;
static int strict;

static int fail(int code, const char *what)
{
    fprintf(stderr, "subpath %s: %s: %s\n", subpath_arg, what, strerror(errno));
    return code;
}

static int open_beneath(int root, const char *path, int flags)
{
    struct open_how how = {
        .flags = (unsigned long long)(flags | O_PATH | O_CLOEXEC),
        .resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | (strict ? RESOLVE_NO_SYMLINKS : 0),
    };
    return (int)syscall(SYS_openat2, root, path, &how, sizeof(how));
}

/* Each component of path (already checked: relative, no "..") opened in
 * turn below root; a missing one made as a directory with mode, in the
 * directory opened just before it. Returns a descriptor of the last. */
static int walk(int root, char *path, mode_t mode)
{
    int parent = dup(root);
    if (parent < 0)
        return -1;
    char *save = NULL;
    char done[PATH_MAX_LEN] = ".";
    for (char *part = strtok_r(path, "/", &save); part; part = strtok_r(NULL, "/", &save)) {
        if (strcmp(part, ".") == 0)
            continue;
        if (strlen(done) + strlen(part) + 2 > sizeof(done)) {
            errno = ENAMETOOLONG;
            close(parent);
            return -1;
        }
        strcat(done, "/");
        strcat(done, part);
        /* Opened from the root every time: a link in the volume may point
         * anywhere inside it, as kubelet allows, but never out. */
        int next = open_beneath(root, done, 0);
        if (next < 0 && errno == ENOENT && !strict) {
            struct stat st;
            /* The parent must be a directory we hold, not a path again. */
            if (fstat(parent, &st) < 0 || !S_ISDIR(st.st_mode)) {
                errno = ENOTDIR;
                close(parent);
                return -1;
            }
            if (mkdirat(parent, part, mode) < 0 && errno != EEXIST) {
                close(parent);
                return -1;
            }
            next = open_beneath(root, done, 0);
        }
        close(parent);
        if (next < 0)
            return -1;
        parent = next;
    }
    return parent;
}

static const char *why(void)
{
    switch (errno) {
    case EXDEV:
        return "resolves outside its volume";
    case ELOOP:
        return strict ? "goes through a symlink inside the volume" : "has too many symlinks";
    case ENOENT:
        return "does not exist in the volume";
    default:
        return "cannot be opened in its volume";
    }
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "--strict") == 0) {
        strict = 1;
        argc--;
        argv++;
    }
    if (argc != 4 || argv[1][0] != '/' || argv[3][0] != '/') {
        fprintf(stderr, "usage: beneath [--strict] <root> <subpath> <target>\n");
        return 1;
    }
    subpath_arg = argv[2];
    char path[PATH_MAX_LEN];
    if (argv[2][0] == '/' || strlen(argv[2]) >= sizeof(path)) {
        fprintf(stderr, "subpath %s: must be a relative path\n", argv[2]);
        return 1;
    }
    strcpy(path, argv[2]);
    for (char *p = path; (p = strstr(p, "..")) != NULL; p += 2) {
        int starts = p == path || p[-1] == '/', ends = p[2] == '\0' || p[2] == '/';
        if (starts && ends) {
            fprintf(stderr, "subpath %s: must not contain '..'\n", argv[2]);
            return LEAVES_ROOT;
        }
    }
    umask(0);
    int root = open(argv[1], O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (root < 0)
        return fail(1, argv[1]);
    struct stat st;
    if (fstat(root, &st) < 0)
        return fail(1, argv[1]);
    int fd = walk(root, path, st.st_mode & 07777);
    if (fd < 0)
        return fail(errno == EXDEV || errno == ELOOP ? LEAVES_ROOT : 1, why());
    if (fstat(fd, &st) < 0)
        return fail(1, "fstat");
    int dir = S_ISDIR(st.st_mode);
    if (!dir && !S_ISREG(st.st_mode)) {
        fprintf(stderr, "subpath %s: neither a directory nor a regular file\n", argv[2]);
        return 1;
    }
    if (dir ? mkdir(argv[3], 0700) < 0 && errno != EEXIST
            : mknod(argv[3], S_IFREG | 0600, 0) < 0 && errno != EEXIST)
        return fail(1, argv[3]);
    int tree = (int)syscall(SYS_open_tree, fd, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH);
    if (tree < 0)
        return fail(1, "open_tree");
    if (syscall(SYS_move_mount, tree, "", AT_FDCWD, argv[3], MOVE_MOUNT_F_EMPTY_PATH) < 0)
        return fail(1, "move_mount");
    printf("kind=%s\n", dir ? "dir" : "file");
    return 0;
}
