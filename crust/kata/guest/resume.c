/*
 * resume: a VM restored from a saved template (crust.kata.template) made
 * its own, before it serves a pod.
 *
 * Every VM restored from one file wakes with the template's kernel state:
 * its wall clock where it was when the template was saved, and the key and
 * position of the kernel's random number generator, the same in all of
 * them. The agent runs this with the host's clock and fresh bytes from the
 * host's getrandom: the clock is set, the bytes are added to the kernel's
 * input pool and credited, and the generator takes a new key from the pool
 * at once (every CPU's key is derived again), not at its next scheduled
 * reseed, so no two restored VMs draw the same numbers (a LUKS2 volume's
 * key, a container's getrandom).
 *
 * A program and not a script: busybox has nothing that makes these ioctls,
 * and under software emulation a restored VM translates every program's
 * code afresh, so the smallest program costs the pod the least.
 *
 *   resume <unix-seconds> <nanoseconds> <seed-hex>
 *
 * Prints "seeded=<bits>" on success; a reason on stderr and exit 1 otherwise.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define MIN_SEED_BYTES 32
#define MAX_SEED_BYTES 512

static int fail(const char *what)
{
    fprintf(stderr, "%s: %s\n", what, strerror(errno));
    return 1;
}

static int usage(void)
{
    fprintf(stderr, "usage: resume <unix-seconds> <nanoseconds> <seed-hex> "
                    "(%d to %d bytes of seed)\n", MIN_SEED_BYTES, MAX_SEED_BYTES);
    return 2;
}

/* A decimal number of at most max, the whole word; -1 if it is not one. */
static long long decimal(const char *word, long long max)
{
    char *end;
    long long value;

    if (word[0] < '0' || word[0] > '9')
        return -1;
    errno = 0;
    value = strtoll(word, &end, 10);
    if (errno != 0 || *end != '\0' || value > max)
        return -1;
    return value;
}

static int nibble(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

int main(int argc, char **argv)
{
    /* struct rand_pool_info: the bits credited, the length, the bytes. */
    static union {
        struct rand_pool_info info;
        unsigned char room[sizeof(struct rand_pool_info) + MAX_SEED_BYTES];
    } seed;
    unsigned char *bytes = (unsigned char *)seed.info.buf;
    struct timespec now;
    long long seconds, nanoseconds;
    size_t length, i;
    int fd;

    if (argc != 4)
        return usage();
    seconds = decimal(argv[1], 1LL << 40);
    nanoseconds = decimal(argv[2], 999999999);
    length = strlen(argv[3]);
    if (seconds < 0 || nanoseconds < 0 || length % 2 != 0 || length / 2 < MIN_SEED_BYTES ||
        length / 2 > MAX_SEED_BYTES)
        return usage();
    for (i = 0; i < length / 2; i++) {
        int high = nibble(argv[3][2 * i]), low = nibble(argv[3][2 * i + 1]);
        if (high < 0 || low < 0)
            return usage();
        bytes[i] = (unsigned char)(high << 4 | low);
    }

    now.tv_sec = (time_t)seconds;
    now.tv_nsec = (long)nanoseconds;
    if (clock_settime(CLOCK_REALTIME, &now) != 0)
        return fail("clock_settime");

    fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return fail("/dev/urandom");
    /* The bytes come from the host's getrandom: every bit of them counts. */
    seed.info.entropy_count = (int)(8 * (length / 2));
    seed.info.buf_size = (int)(length / 2);
    if (ioctl(fd, RNDADDENTROPY, &seed.info) != 0)
        return fail("RNDADDENTROPY");
    if (ioctl(fd, RNDRESEEDCRNG) != 0)
        return fail("RNDRESEEDCRNG");
    close(fd);
    printf("seeded=%d\n", seed.info.entropy_count);
    return 0;
}
