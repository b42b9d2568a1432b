/* A futex syscall that returns at once, N times; prints ns per call.
 *   wait: FUTEX_WAIT on a word that does not hold the expected value (EAGAIN): the probe's
 *         whole enter/exit path runs when the process is watched.
 *   wake: FUTEX_WAKE with nobody waiting: the probe returns at its first check. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static unsigned int word = 1;

static double now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(int argc, char **argv)
{
	if (argc != 3 || (strcmp(argv[2], "wait") && strcmp(argv[2], "wake"))) {
		fprintf(stderr, "usage: %s N wait|wake\n", argv[0]);
		return 2;
	}
	long n = atol(argv[1]);
	int wait = strcmp(argv[2], "wait") == 0;
	/* Wait for a line on stdin, so the harness can watch us before the timed loop. */
	char go[8];
	if (!fgets(go, sizeof(go), stdin))
		return 1;
	double t0 = now_ns();
	for (long i = 0; i < n; i++) {
		if (wait)
			syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
		else
			syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
	}
	printf("%.1f\n", (now_ns() - t0) / n);
	return 0;
}
