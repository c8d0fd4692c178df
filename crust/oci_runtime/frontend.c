/*
 * crust-runc: the front end of crust's OCI runtime.
 *
 * containerd's runc shim (BinaryName) and CRI-O run their OCI runtime for
 * every operation on a container: create, start, state, kill, exec, delete,
 * and more. crust's runtime (crust-oci-runtime, Python) has work of its own
 * in two of them only: `create` of a bundle that binds a kubelet CSI volume,
 * and `delete` of a container it created so (a marker in its state
 * directory says which). Started for every call, the interpreter would cost
 * each one tens of milliseconds before it execs runc. This program does
 * both of those too, with the crust handler (below), and starts the
 * interpreter only where the handler cannot help.
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
 * `create` of a bundle that may bind a CSI volume is the one call on a
 * pod's start path that needs crust. It is done here too, without the
 * interpreter: the crust handler, a daemon that reads JSON anyway, is asked
 * to do the runtime's part (PrepareBundle on its JSON socket: read the
 * spec, claim the deferred binds, rewrite config.json, write the marker),
 * then runc creates the container, then the handler hears of it
 * (ContainerCreated) before `start`; a failed runc or handler call leaves
 * no claim and no marker behind. An older handler (UNIMPLEMENTED), one
 * that cannot see the bundle (NOT_FOUND), an unreachable one, or a create
 * without --pid-file becomes the Python runtime, which does it all itself.
 * `delete` of a container with a marker: runc deletes, then the handler
 * releases the claims (ReleaseContainer) and the marker goes.
 *
 * The settings are the Python runtime's (crust/oci_runtime/main.py):
 * CRUST_OCI_RUNTIME_CONFIG (default /etc/crust/oci-runtime.json, a JSON
 * object of strings: runc, handlerEndpoint, stateDir), then CRUST_RUNC,
 * CRUST_HANDLER_ENDPOINT and CRUST_OCI_RUNTIME_STATE override it; runc
 * defaults to the first runc on PATH that is not this program.
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
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#ifndef CRUST_PYTHON_RUNTIME
#error "build with -DCRUST_PYTHON_RUNTIME=\"/path/of/crust-oci-runtime\""
#endif

#define CONFIG_FILE "/etc/crust/oci-runtime.json"
#define DEFAULT_STATE_DIR "/run/crust/oci-runtime"
#define DEFAULT_HANDLER_ENDPOINT "unix:///run/crust/handler.sock"
/* The handler's answer to PrepareBundle may wait for a claim at the proxy
 * and for an entry kubelet just published (crust/oci_runtime/client.py). */
#define PREPARE_TIMEOUT 60
#define CALL_TIMEOUT 30
#define MAX_REPLY (16 << 20)
#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define CSI_MARK "/kubernetes.io~csi/"
/* A spec larger than this is read by the Python runtime. */
#define MAX_SPEC (64 << 20)
#define MAX_CONFIG (64 << 10)

static char **arguments;   /* argv[1..]: what runc or the Python runtime gets */
static int argument_count;

/* -- the two ways out ------------------------------------------------------------------------- */

static const char *log_path;
static const char *runc_root = "/run/runc";   /* runc's --root */
static int log_json;

/* A growing string. */
struct text {
    char *data;
    size_t length, size;
};

static void add(struct text *t, const char *s, size_t n)
{
    if (t->length + n + 1 > t->size) {
        size_t size = (t->length + n + 1) * 2;
        char *data = realloc(t->data, size);
        if (data == NULL)
            exit(1);
        t->data = data;
        t->size = size;
    }
    memcpy(t->data + t->length, s, n);
    t->length += n;
    t->data[t->length] = '\0';
}

static void add_str(struct text *t, const char *s) { add(t, s, strlen(s)); }

/* s as the inside of a JSON string. */
static void add_escaped(struct text *t, const char *s)
{
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        char escape[8];
        if (c == '"' || c == '\\') {
            escape[0] = '\\';
            escape[1] = (char)c;
            add(t, escape, 2);
        } else if (c < 0x20) {
            snprintf(escape, sizeof escape, "\\u%04x", c);
            add(t, escape, 6);
        } else {
            add(t, (const char *)&c, 1);
        }
    }
}

/* A line in runc's log (where the shim reads why a call failed) in its format, the message already a JSON string's
 * inside (the Python runtime's text format quotes it the same way). */
static void log_escaped(const char *level, const char *message)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    char stamp[64], when[32];
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", gmtime(&now.tv_sec));
    snprintf(stamp, sizeof stamp, "%s.%09ldZ", when, now.tv_nsec);
    FILE *out = log_path ? fopen(log_path, "a") : NULL;
    if (out == NULL)
        out = stderr;
    if (log_json)
        fprintf(out, "{\"level\":\"%s\",\"msg\":\"%s\",\"time\":\"%s\"}\n", level, message, stamp);
    else
        fprintf(out, "time=\"%s\" level=%s msg=\"%s\"\n", stamp, level, message);
    if (out != stderr)
        fclose(out);
}

static void log_plain(const char *level, const char *message)
{
    struct text t = {0};
    add_escaped(&t, message);
    log_escaped(level, t.data ? t.data : "");
    free(t.data);
}


/* argv for program: its own leading arguments (NULL-terminated, may be
 * NULL), then this call's. */
static char **argv_of(const char *program, const char *const *leading)
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
    return argv;
}

static void become_with(const char *program, const char *const *leading)
{
    execv(program, argv_of(program, leading));
    char message[PATH_MAX + 64];
    snprintf(message, sizeof message, "crust-runc: cannot run %s: %s", program, strerror(errno));
    log_plain("error", message);
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
static int read_settings(const char *path, char **runc, char **state_dir, char **handler)
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
            *handler = value;
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
 * positional) and, for create, the bundle and the pid file. */
static const char *command_options(char **rest, int count, int create, const char **bundle, const char **pid_file)
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
        if (pid_file && value && length == 10 && strncmp(word, "--pid-file", 10) == 0)
            *pid_file = value;
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

/* The marker of container id in the state directory, into marker; 0 for
 * an id that is no plain file name (the Python runtime says what is wrong). */
static int marker_path(char marker[PATH_MAX], const char *state_dir, const char *id)
{
    return *id != '\0' && strchr(id, '/') == NULL && strcmp(id, ".") != 0 && strcmp(id, "..") != 0
           && snprintf(marker, PATH_MAX, "%s/%s", state_dir, id) < PATH_MAX;
}

static int delete_needs_crust(const char *state_dir, const char *id)
{
    char marker[PATH_MAX];
    if (!marker_path(marker, state_dir, id))
        return 1;
    return access(marker, F_OK) == 0 || errno != ENOENT;
}

/* -- create, with the handler doing the runtime's part ----------------------------------------------- */

static double now_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec * 1e3 + (double)now.tv_nsec / 1e6;
}

static const char *handler_endpoint;

enum answer { ANSWERED, UNREACHABLE };

/* One call on the handler's JSON socket: a line out, a line back (*reply,
 * NUL-terminated). UNREACHABLE when no handler listens there. */
static enum answer call_handler(const char *method, const char *request, int timeout, char **reply)
{
    *reply = NULL;
    const char *prefix = "unix://";
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    if (strncmp(handler_endpoint, prefix, strlen(prefix)) != 0
        || snprintf(address.sun_path, sizeof address.sun_path, "%s.json", handler_endpoint + strlen(prefix))
               >= (int)sizeof address.sun_path)
        return UNREACHABLE;   /* the Python runtime names what is wrong with it */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return UNREACHABLE;
    struct timeval limit = {.tv_sec = timeout};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
    if (connect(fd, (struct sockaddr *)&address, sizeof address) != 0) {
        close(fd);
        return UNREACHABLE;
    }
    struct text line = {0};
    add_str(&line, "{\"method\":\"");
    add_str(&line, method);
    add_str(&line, "\",\"request\":");
    add_str(&line, request);
    add_str(&line, "}\n");
    struct text in = {0};
    size_t sent = 0;
    while (sent < line.length) {
        ssize_t n = send(fd, line.data + sent, line.length - sent, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            goto done;
        sent += (size_t)n;
    }
    for (;;) {
        char chunk[65536];
        ssize_t n = recv(fd, chunk, sizeof chunk, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        add(&in, chunk, (size_t)n);
        if (in.data[in.length - 1] == '\n' || in.length > MAX_REPLY)
            break;
    }
done:
    close(fd);
    free(line.data);
    *reply = in.data ? in.data : strdup("");
    return ANSWERED;
}

enum outcome { ANSWER_OK, ANSWER_UNREACHABLE, ANSWER_ERROR, ANSWER_NONE };

/* One call on the handler's socket and what came of it: the reply (kept in
 * *reply when reply is not NULL), or the error's code (into code) and why
 * it failed, as a JSON string's inside ("crust handler: ..."), into why. */
static enum outcome ask(const char *method, const char *request, int timeout, char **reply, char code[64],
                        struct text *why)
{
    char *answer;
    code[0] = '\0';
    add_str(why, "crust handler: ");
    if (call_handler(method, request, timeout, &answer) == UNREACHABLE) {
        add_str(why, method);
        add_str(why, ": the handler at ");
        add_escaped(why, handler_endpoint);
        add_str(why, " is unreachable");
        return ANSWER_UNREACHABLE;
    }
    enum outcome outcome = ANSWER_NONE;
    const char *error = "{\"error\":{\"code\":\"", *end;
    if (strncmp(answer, "{\"response\":", 12) == 0) {
        outcome = ANSWER_OK;
    } else if (strncmp(answer, error, strlen(error)) == 0 && (end = strchr(answer + strlen(error), '"'))) {
        outcome = ANSWER_ERROR;
        snprintf(code, 64, "%.*s", (int)(end - answer - strlen(error)), answer + strlen(error));
        add_escaped(why, code);
        add_str(why, ": ");
        const char *m = strstr(end, "\"message\":\"");
        if (m != NULL) {
            m += strlen("\"message\":\"");
            const char *q = m;
            while (*q && *q != '"')
                q += (*q == '\\' && q[1]) ? 2 : 1;
            add(why, m, (size_t)(q - m));   /* still escaped: runc's log quotes it the same way */
        }
    } else {
        add_str(why, method);
        add_str(why, ": the connection ended without an answer");
    }
    if (reply != NULL && outcome == ANSWER_OK)
        *reply = answer;
    else
        free(answer);
    return outcome;
}

/* ask, a failure said in runc's log at level, after context (a JSON
 * string's inside); 1 when the handler answered with a response. */
static int ask_or_log(const char *method, const char *request, int timeout, const char *level,
                      const char *context)
{
    struct text why = {0}, line = {0};
    char code[64];
    int ok = ask(method, request, timeout, NULL, code, &why) == ANSWER_OK;
    if (!ok) {
        add_str(&line, context);
        add_str(&line, why.data);
        log_escaped(level, line.data);
    }
    free(why.data);
    free(line.data);
    return ok;
}

/* {"containerId":ID[,"pid":"PID"]}, the request of ContainerCreated and
 * ReleaseContainer. */
static char *container_request(const char *id, long pid)
{
    struct text request = {0};
    add_str(&request, "{\"containerId\":\"");
    add_escaped(&request, id);
    if (pid > 0) {
        char number[32];
        snprintf(number, sizeof number, "\",\"pid\":\"%ld", pid);
        add_str(&request, number);
    }
    add_str(&request, "\"}");
    return request.data;
}

/* runc with argv, its exit code. Descriptors without close-on-exec stay
 * open for it (the shim's console socket, --preserve-fds). */
static int run_runc(const char *runc, char **argv, int quiet)
{
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    if (quiet) {
        posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
        posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
    }
    pid_t pid;
    int failed = posix_spawn(&pid, runc, &actions, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    if (failed) {
        char message[PATH_MAX + 64];
        snprintf(message, sizeof message, "cannot run %s: %s", runc, strerror(failed));
        log_plain("error", message);
        return 1;
    }
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR)
            return 1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* How long ago this process started, to the clock tick. */
static double process_age_ms(void)
{
    char *stat = read_file("/proc/self/stat", 4096, NULL), *uptime = read_file("/proc/uptime", 256, NULL);
    double age = 0;
    char *close = stat ? strrchr(stat, ')') : NULL;
    if (close && uptime) {
        unsigned long long ticks = 0;
        char *field = close + 1;
        for (int i = 0; i < 20 && field; i++)
            field = strchr(field + 1, ' ');
        if (field)
            ticks = strtoull(field + 1, NULL, 10);
        age = (strtod(uptime, NULL) - (double)ticks / (double)sysconf(_SC_CLK_TCK)) * 1e3;
    }
    free(stat);
    free(uptime);
    return age > 0 ? age : 0;
}

/* The claims of a create that failed go, and its marker. */
static void release_claims(const char *id, const char *marker)
{
    char *request = container_request(id, 0);
    ask_or_log("ReleaseContainer", request, CALL_TIMEOUT, "error", "");
    free(request);
    unlink(marker);
}

/* `create` of a bundle that may bind a CSI volume, the handler doing the
 * runtime's part; returns only when the Python runtime should do it all. */
static void create_through_handler(const char *runc, const char *state_dir, const char *bundle, const char *id,
                                   const char *pid_file, int global_count)
{
    char cwd[PATH_MAX], absolute[PATH_MAX], marker[PATH_MAX];
    if (bundle == NULL || *bundle == '\0')
        bundle = getcwd(cwd, sizeof cwd);
    else if (bundle[0] != '/' && getcwd(cwd, sizeof cwd) != NULL
             && snprintf(absolute, sizeof absolute, "%s/%s", cwd, bundle) < (int)sizeof absolute)
        bundle = absolute;
    if (bundle == NULL || bundle[0] != '/' || pid_file == NULL || !marker_path(marker, state_dir, id))
        return;
    double began = now_ms(), startup = process_age_ms();

    struct text request = {0}, why = {0};
    char pid[32], code[64], *reply = NULL;
    snprintf(pid, sizeof pid, "%ld", (long)getpid());
    add_str(&request, "{\"containerId\":\"");
    add_escaped(&request, id);
    add_str(&request, "\",\"bundle\":\"");
    add_escaped(&request, bundle);
    add_str(&request, "\",\"runtimePid\":\"");
    add_str(&request, pid);
    add_str(&request, "\",\"stateDir\":\"");
    add_escaped(&request, state_dir);
    add_str(&request, "\",\"logPath\":\"");
    add_escaped(&request, log_path ? log_path : "");
    add_str(&request, "\",\"logFormat\":\"");
    add_str(&request, log_json ? "json" : "");
    add_str(&request, "\"}");
    enum outcome outcome = ask("PrepareBundle", request.data, PREPARE_TIMEOUT, &reply, code, &why);
    free(request.data);
    if (outcome == ANSWER_UNREACHABLE
        || (outcome == ANSWER_ERROR && (strcmp(code, "UNIMPLEMENTED") == 0 || strcmp(code, "NOT_FOUND") == 0)))
        return;
    if (outcome != ANSWER_OK) {
        log_escaped("error", why.data);
        exit(1);
    }
    free(why.data);
    /* protobuf's JSON mapping leaves an empty list out: no mounts, nothing deferred. */
    int deferred = strncmp(reply, "{\"response\":{\"mounts\":[", 23) == 0;
    free(reply);
    if (!deferred)
        become(runc);
    double prepared = now_ms();

    int code_of_runc = run_runc(runc, argv_of(runc, NULL), 0);
    if (code_of_runc != 0) {
        release_claims(id, marker);
        exit(code_of_runc);
    }
    double created = now_ms();

    /* The container's init, from runc's pid file. */
    char *text = read_file(pid_file, 64, NULL);
    long init = text ? strtol(text, NULL, 10) : 0;
    free(text);
    char *call = container_request(id, init);
    int ok = init > 0 && ask_or_log("ContainerCreated", call, CALL_TIMEOUT, "error", "");
    free(call);
    if (!ok) {
        if (init <= 0)
            log_plain("error", "crust: runc created the container but its pid file holds no pid");
        /* runc delete --force with this call's global flags. */
        char **del = calloc((size_t)global_count + 5, sizeof *del);
        if (del == NULL)
            exit(1);
        del[0] = (char *)runc;
        memcpy(del + 1, arguments, (size_t)global_count * sizeof *del);
        del[global_count + 1] = "delete";
        del[global_count + 2] = "--force";
        del[global_count + 3] = (char *)id;
        run_runc(runc, del, 1);
        release_claims(id, marker);
        exit(1);
    }
    double done = now_ms();
    char line[256];
    snprintf(line, sizeof line, "crust: create took %.0f ms: start and imports %.0f, handler prepare %.0f, "
             "runc create %.0f, handler created %.0f", startup + done - began, startup, prepared - began,
             created - prepared, done - created);
    log_plain("info", line);
    exit(0);
}

/* `delete` of a container crust created (its marker): runc deletes, then
 * the handler releases the claims and the marker goes (the Python
 * runtime's delete, without the interpreter). A container runc still has
 * keeps its claims; a handler that cannot release them now leaves them to
 * its reaper (a warning, the marker kept), and the delete is still runc's
 * success. */
static void delete_through_handler(const char *runc, const char *state_dir, const char *id)
{
    char marker[PATH_MAX], state[PATH_MAX];
    if (!marker_path(marker, state_dir, id)
        || snprintf(state, sizeof state, "%s/%s/state.json", runc_root, id) >= (int)sizeof state)
        become_crust();
    int code = run_runc(runc, argv_of(runc, NULL), 0);
    if (code != 0 && access(state, F_OK) == 0)
        exit(code);   /* still there (running, without --force): its claims stay */
    char *request = container_request(id, 0);
    struct text context = {0};
    add_str(&context, "crust: container ");
    add_escaped(&context, id);
    add_str(&context, " deleted, its claims not released yet: ");
    if (ask_or_log("ReleaseContainer", request, CALL_TIMEOUT, "warning", context.data))
        unlink(marker);
    exit(code);
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
        if (value && length == 6 && strncmp(word, "--root", 6) == 0)
            runc_root = value;
        if (value && length == 5 && strncmp(word, "--log", 5) == 0)
            log_path = value;
        if (value && length == 12 && strncmp(word, "--log-format", 12) == 0)
            log_json = strcmp(value, "json") == 0;
        i++;
    }
    const char *command = i < argument_count ? arguments[i] : "";
    char **rest = arguments + (i < argument_count ? i + 1 : argument_count);
    int rest_count = i < argument_count ? argument_count - i - 1 : 0;

    char *runc = NULL, *state_dir = NULL, *handler = NULL;
    const char *config = getenv("CRUST_OCI_RUNTIME_CONFIG");
    if (!read_settings(config && *config ? config : CONFIG_FILE, &runc, &state_dir, &handler))
        become_crust();
    const char *env_runc = getenv("CRUST_RUNC"), *env_state = getenv("CRUST_OCI_RUNTIME_STATE");
    const char *env_handler = getenv("CRUST_HANDLER_ENDPOINT");
    if (env_runc && *env_runc)
        runc = strdup(env_runc);
    if (env_state && *env_state)
        state_dir = strdup(env_state);
    if (env_handler && *env_handler)
        handler = strdup(env_handler);
    handler_endpoint = handler && *handler ? handler : DEFAULT_HANDLER_ENDPOINT;
    if (runc == NULL || *runc == '\0')
        runc = find_runc();
    if (runc == NULL)
        become_crust();   /* it says no runc was found, in runc's log */
    if (state_dir == NULL || *state_dir == '\0')
        state_dir = DEFAULT_STATE_DIR;
    resolved_runc = runc;

    if (strcmp(command, "create") == 0) {
        const char *bundle = NULL, *pid_file = NULL;
        const char *id = command_options(rest, rest_count, 1, &bundle, &pid_file);
        if (create_needs_crust(bundle)) {
            create_through_handler(runc, state_dir, bundle, id, pid_file, i);
            become_crust();
        }
    } else if (strcmp(command, "delete") == 0) {
        const char *id = command_options(rest, rest_count, 0, NULL, NULL);
        if (delete_needs_crust(state_dir, id))
            delete_through_handler(runc, state_dir, id);
    } else if (strcmp(command, "run") == 0) {
        become_crust();
    }
    become(runc);
    return 1;
}
