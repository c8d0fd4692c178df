/*
 * crust-runc: the front end of crust's OCI runtime.
 *
 * containerd's runc shim (BinaryName) and CRI-O run their OCI runtime for
 * every operation on a container: create, start, state, kill, exec, delete,
 * and more. crust's runtime (crust-oci-runtime, Python) has work of its own
 * in two of them only: `create` of a bundle that binds a kubelet CSI volume,
 * and `delete` of a container it created so (a marker in its state
 * directory says which). Started for every call, the interpreter would cost
 * each one tens of milliseconds before it execs runc.
 *
 * This program decides which kind of call it is, with nothing but the
 * C library, and becomes runc at once (execv, the same arguments) for
 * every call crust has nothing to do in. The calls that need crust, and
 * every call it cannot decide with certainty (a setting it cannot read
 * simply, a bundle it cannot read, a string with an escape in it), become
 * the Python runtime instead, which reads everything again and decides for
 * itself: a wrong "crust" here costs time, never a wrong result, and no
 * "runc" is answered unless it is certain.
 *
 * The settings are the Python runtime's (crust/oci_runtime/main.py):
 * CRUST_OCI_RUNTIME_CONFIG (default /etc/crust/oci-runtime.json, a JSON
 * object of strings: runc, handlerEndpoint, stateDir), then CRUST_RUNC and
 * CRUST_OCI_RUNTIME_STATE override it; runc defaults to the first runc on
 * PATH that is not this program.
 *
 * Built by `crust runtime-frontend --output PATH` (crust/oci_runtime/frontend.py),
 * which compiles in the program that runs the Python runtime as
 * CRUST_PYTHON_RUNTIME and, by default, CRUST_PYTHON_ENTRY: then that program
 * is the interpreter, started as `python -I -S ENTRY ARGS` (crust's entry
 * script, oci_runtime/entry.py): without the site module the interpreter
 * scans no site-packages and loads no import hooks of an editable install,
 * most of the interpreter's own start. Without CRUST_PYTHON_ENTRY the program
 * is the runtime itself (crust-oci-runtime, or a stand-in in the tests).
 */

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef CRUST_PYTHON_RUNTIME
#error "build with -DCRUST_PYTHON_RUNTIME=\"/path/of/crust-oci-runtime\""
#endif

#define CONFIG_FILE "/etc/crust/oci-runtime.json"
#define DEFAULT_STATE_DIR "/run/crust/oci-runtime"
#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define CSI_MARK "/kubernetes.io~csi/"
/* A spec larger than this is read by the Python runtime. */
#define MAX_SPEC (64 << 20)
#define MAX_CONFIG (64 << 10)

static char **arguments;   /* argv[1..]: what runc or the Python runtime gets */
static int argument_count;

/* -- the two ways out ------------------------------------------------------------------------- */

static void log_failure(const char *log_path, int json, const char *message)
{
    /* runc's log, where the shim reads why a call failed. */
    FILE *out = log_path ? fopen(log_path, "a") : NULL;
    char stamp[64];
    time_t now = time(NULL);
    strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    if (out == NULL)
        out = stderr;
    if (json)
        fprintf(out, "{\"level\":\"error\",\"msg\":\"crust-runc: %s\",\"time\":\"%s\"}\n", message, stamp);
    else
        fprintf(out, "time=\"%s\" level=error msg=\"crust-runc: %s\"\n", stamp, message);
    if (out != stderr)
        fclose(out);
}

static const char *log_path;
static int log_json;

/* program, with its own leading arguments (NULL-terminated, may be NULL), then ours. */
static void become_with(const char *program, const char *const *leading)
{
    int lead = 0;
    while (leading != NULL && leading[lead] != NULL)
        lead++;
    char **argv = calloc((size_t)(argument_count + lead) + 2, sizeof *argv);
    if (argv == NULL)
        exit(1);
    argv[0] = (char *)program;
    if (lead > 0)
        memcpy(argv + 1, leading, (size_t)lead * sizeof *argv);
    memcpy(argv + 1 + lead, arguments, (size_t)argument_count * sizeof *argv);
    execv(program, argv);
    char message[PATH_MAX + 64];
    snprintf(message, sizeof message, "cannot run %s: %s", program, strerror(errno));
    log_failure(log_path, log_json, message);
    exit(1);
}

static void become(const char *program) { become_with(program, NULL); }

/* runc, once the settings named it or PATH had it. */
static const char *resolved_runc;

/* Everything this program cannot decide, and what needs crust. */
static void become_crust(void)
{
    /* The runc found here is the Python runtime's too (the same settings in
     * the same order): it need not look again, and cannot take this
     * program, installed under runc's name, for runc. */
    if (resolved_runc != NULL)
        setenv("CRUST_RUNC", resolved_runc, 1);
#ifdef CRUST_PYTHON_ENTRY
    static const char *const entry[] = {"-I", "-S", CRUST_PYTHON_ENTRY, NULL};
    become_with(CRUST_PYTHON_RUNTIME, entry);
#else
    become(CRUST_PYTHON_RUNTIME);
#endif
}

/* -- reading ------------------------------------------------------------------------------------ */

/* The whole file, NUL-terminated; NULL when it cannot be read or is larger than limit. */
static char *read_file(const char *path, size_t limit, size_t *length)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (size_t)st.st_size > limit) {
        close(fd);
        return NULL;
    }
    char *data = malloc((size_t)st.st_size + 1);
    size_t have = 0;
    while (data != NULL) {
        ssize_t got = read(fd, data + have, (size_t)st.st_size + 1 - have);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0 || have + (size_t)got > (size_t)st.st_size) {
            free(data);
            data = NULL;  /* an error, or the file grew: not read simply */
            break;
        }
        if (got == 0)
            break;
        have += (size_t)got;
    }
    close(fd);
    if (data != NULL) {
        data[have] = '\0';
        if (length)
            *length = have;
    }
    return data;
}

static const char *skip_space(const char *p)
{
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    return p;
}

/* A JSON string at p (at its opening quote) without escapes: its text, and
 * where it ends; NULL for anything else. */
static char *plain_string(const char *p, const char **end)
{
    if (*p != '"')
        return NULL;
    const char *close = p + 1;
    while (*close != '"') {
        if (*close == '\0' || *close == '\\' || (unsigned char)*close < 0x20)
            return NULL;
        close++;
    }
    *end = close + 1;
    return strndup(p + 1, (size_t)(close - p - 1));
}

/* The settings file: a flat object of plain strings with the runtime's keys,
 * or nothing certain (returns 0). */
static int read_settings(const char *path, char **runc, char **state_dir)
{
    char *text = read_file(path, MAX_CONFIG, NULL);
    if (text == NULL)
        return access(path, F_OK) != 0 && errno == ENOENT;   /* no file: the defaults */
    int ok = 0;
    const char *p = skip_space(text);
    if (*p++ != '{')
        goto out;
    p = skip_space(p);
    while (*p != '}') {
        char *key = plain_string(p, &p), *value;
        if (key == NULL)
            goto out;
        p = skip_space(p);
        if (*p++ != ':' || (value = plain_string(skip_space(p), &p)) == NULL) {
            free(key);
            goto out;
        }
        if (strcmp(key, "runc") == 0)
            *runc = value;
        else if (strcmp(key, "stateDir") == 0)
            *state_dir = value;
        else if (strcmp(key, "handlerEndpoint") == 0)
            free(value);
        else {
            free(key);
            free(value);
            goto out;   /* a key the runtime refuses: let it say so */
        }
        free(key);
        p = skip_space(p);
        if (*p == ',')
            p = skip_space(p + 1);
        else if (*p != '}')
            goto out;
    }
    ok = *skip_space(p + 1) == '\0';
out:
    free(text);
    return ok;
}

/* The first runc on PATH that is not this program. */
static char *find_runc(void)
{
    char me[PATH_MAX], candidate[PATH_MAX], resolved[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", me, sizeof me - 1);
    me[n > 0 ? n : 0] = '\0';
    const char *path = getenv("PATH");
    char *dirs = strdup(path && *path ? path : DEFAULT_PATH);
    for (char *save = NULL, *dir = strtok_r(dirs, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) {
        snprintf(candidate, sizeof candidate, "%s/runc", *dir ? dir : ".");
        if (access(candidate, X_OK) == 0 && realpath(candidate, resolved) && strcmp(resolved, me) != 0)
            return strdup(candidate);
    }
    return NULL;
}

/* -- runc's command line -------------------------------------------------------------------------- */

/* Whether name[0..length) is one of flags (a NULL-terminated list). */
static int is_one_of(const char *name, size_t length, const char *const *flags)
{
    for (; *flags; flags++)
        if (strlen(*flags) == length && strncmp(*flags, name, length) == 0)
            return 1;
    return 0;
}

/* runc's global flags that take a value, and create's (the others are booleans). */
static const char *const GLOBAL_VALUE_FLAGS[] = {"--log", "--log-format", "--root", "--criu", "--rootless", NULL};
static const char *const CREATE_VALUE_FLAGS[] = {"--bundle", "-b", "--console-socket", "--pid-file",
                                                 "--preserve-fds", NULL};

/* A command's options from rest[0..count): the container id (the first
 * positional) and, for create, the bundle. */
static const char *command_options(char **rest, int count, int create, const char **bundle)
{
    int i = 0;
    while (i < count) {
        const char *word = rest[i];
        if (strcmp(word, "--") == 0) {
            i++;
            break;
        }
        if (word[0] != '-')
            break;
        const char *eq = strchr(word, '=');
        size_t length = eq ? (size_t)(eq - word) : strlen(word);
        const char *value = eq ? eq + 1 : NULL;
        if (create && is_one_of(word, length, CREATE_VALUE_FLAGS) && !eq) {
            i++;
            value = i < count ? rest[i] : "";
        }
        if (bundle && value && ((length == 8 && strncmp(word, "--bundle", 8) == 0)
                                || (length == 2 && strncmp(word, "-b", 2) == 0)))
            *bundle = value;
        i++;
    }
    return i < count ? rest[i] : "";
}

/* -- the bundle ------------------------------------------------------------------------------------ */

/* Whether the spec may bind a CSI volume: the mark anywhere in its text, or
 * a "source" whose real path leads below one (a link on the way). 1 also
 * for anything not read simply. */
static int may_bind_csi_volume(const char *spec)
{
    if (strstr(spec, "kubernetes.io~csi") != NULL)
        return 1;
    for (const char *p = strstr(spec, "\"source\""); p; p = strstr(p, "\"source\"")) {
        p = skip_space(p + 8);
        if (*p != ':')
            continue;
        p = skip_space(p + 1);
        if (*p != '"')
            continue;
        const char *end;
        char *source = plain_string(p, &end);
        if (source == NULL)
            return 1;   /* an escape: the Python runtime reads it */
        p = end;
        char resolved[PATH_MAX + 2];
        if (source[0] == '/' && realpath(source, resolved) != NULL) {
            strcat(resolved, "/");
            if (strstr(resolved, CSI_MARK) != NULL) {
                free(source);
                return 1;
            }
        }
        free(source);
    }
    return 0;
}

static int create_needs_crust(const char *bundle)
{
    char path[PATH_MAX];
    char cwd[PATH_MAX];
    if (bundle == NULL || *bundle == '\0')
        bundle = getcwd(cwd, sizeof cwd);
    if (bundle == NULL)
        return 1;
    /* crust rewrote this bundle's spec before (a retried create). */
    if (snprintf(path, sizeof path, "%s/config.crust-original.json", bundle) >= (int)sizeof path
        || access(path, F_OK) == 0 || errno != ENOENT)
        return 1;
    snprintf(path, sizeof path, "%s/config.json", bundle);
    char *spec = read_file(path, MAX_SPEC, NULL);
    if (spec == NULL)
        return 1;   /* the Python runtime says why */
    int needs = may_bind_csi_volume(spec);
    free(spec);
    return needs;
}

static int delete_needs_crust(const char *state_dir, const char *id)
{
    char marker[PATH_MAX];
    if (*id == '\0' || strchr(id, '/') || strcmp(id, ".") == 0 || strcmp(id, "..") == 0)
        return 1;
    if (snprintf(marker, sizeof marker, "%s/%s", state_dir, id) >= (int)sizeof marker)
        return 1;
    return access(marker, F_OK) == 0 || errno != ENOENT;
}

int main(int argc, char **argv)
{
    arguments = argv + 1;
    argument_count = argc - 1;

    int i = 0;
    while (i < argument_count && arguments[i][0] == '-') {
        const char *word = arguments[i];
        const char *eq = strchr(word, '=');
        size_t length = eq ? (size_t)(eq - word) : strlen(word);
        const char *value = eq ? eq + 1 : NULL;
        if (is_one_of(word, length, GLOBAL_VALUE_FLAGS) && !eq) {
            i++;
            value = i < argument_count ? arguments[i] : "";
        }
        if (value && length == 5 && strncmp(word, "--log", 5) == 0)
            log_path = value;
        if (value && length == 12 && strncmp(word, "--log-format", 12) == 0)
            log_json = strcmp(value, "json") == 0;
        i++;
    }
    const char *command = i < argument_count ? arguments[i] : "";
    char **rest = arguments + (i < argument_count ? i + 1 : argument_count);
    int rest_count = i < argument_count ? argument_count - i - 1 : 0;

    char *runc = NULL, *state_dir = NULL;
    const char *config = getenv("CRUST_OCI_RUNTIME_CONFIG");
    if (!read_settings(config && *config ? config : CONFIG_FILE, &runc, &state_dir))
        become_crust();
    const char *env_runc = getenv("CRUST_RUNC"), *env_state = getenv("CRUST_OCI_RUNTIME_STATE");
    if (env_runc && *env_runc)
        runc = strdup(env_runc);
    if (env_state && *env_state)
        state_dir = strdup(env_state);
    if (runc == NULL || *runc == '\0')
        runc = find_runc();
    if (runc == NULL)
        become_crust();   /* it says no runc was found, in runc's log */
    if (state_dir == NULL || *state_dir == '\0')
        state_dir = DEFAULT_STATE_DIR;
    resolved_runc = runc;

    if (strcmp(command, "create") == 0) {
        const char *bundle = NULL;
        command_options(rest, rest_count, 1, &bundle);
        if (create_needs_crust(bundle))
            become_crust();
    } else if (strcmp(command, "delete") == 0) {
        if (delete_needs_crust(state_dir, command_options(rest, rest_count, 0, NULL)))
            become_crust();
    } else if (strcmp(command, "run") == 0) {
        become_crust();
    }
    become(runc);
    return 1;
}
