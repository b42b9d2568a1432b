/*
 * The benchmark workloads, one binary with a mode argument:
 *
 *   workloads futex-wait N     FUTEX_WAIT on a word not holding the expected value (EAGAIN)
 *   workloads futex-wake N     FUTEX_WAKE with nobody waiting
 *   workloads pingpong N       two threads on one CPU hand a turn back and forth through a
 *                              mutex and a condvar: a real wait and wake per hand-off
 *   workloads mutex N          uncontended pthread_mutex_lock/unlock: no syscall at all
 *   workloads getppid N        getppid(2), the cheapest syscall there is
 *   workloads write N          write(2) of one byte to /dev/null
 *   workloads pread N          pread(2) of 64 bytes of a regular file in the page cache (the
 *                              workload's own binary): the read probe's counted path
 *   workloads read-dev N       read(2) of one byte of /dev/zero: a read the read probe looks
 *                              up and leaves out (not a regular file)
 *   workloads poll N           poll(2) of an empty pipe with a timeout of 0: it finds nothing,
 *                              the poll probe's counted path (a spinning loop's call)
 *   workloads send N           send(2) of one byte on a unix datagram socketpair, and the
 *                              recv(2) that drains it (recv is not traced)
 *   workloads answer N         send(2) of one byte on a loopback TCP connection it accepted
 *                              (after its go line, so a watching probe sees the accept), and
 *                              the recv(2) of it at the connecting end: a server's answer
 *   workloads rename N         prctl(PR_SET_NAME), two names in turn: the task_rename
 *                              tracepoint that any process can fire in a loop
 *   workloads futex-rate R S   about R EAGAIN futex calls per second for S seconds
 *   workloads park N           N threads parked on a condvar nobody signals, until killed
 *   workloads bind-listen R S  about R socket+bind+listen+close per second for S seconds
 *   workloads serve N          a front-end: listens on a port the kernel chooses (it prints
 *                              "PORT p" before reading its go line), accepts N connections,
 *                              prints "SERVING n", then waits in epoll_wait on all of them
 *                              and its listening socket with no timeout, as an event loop
 *                              holding idle keep-alive connections does; it accepts what
 *                              comes later, answers each read with "ok\n", closes at EOF
 *   workloads turn N S         two threads hand two mutexes back and forth for S seconds
 *                              (N hand-offs a second at most), then take them in opposite
 *                              orders: a service that turns deadlocked; prints "DEADLOCKED"
 *
 * Each prints nothing and does nothing until it reads a line on stdin, so the harness can
 * make sure the daemon watches it first. The timed modes then print "ns/op"; the rate modes
 * print "RATE achieved/s"; park prints "PARKED n" once every thread waits.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
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

static void die(const char *what)
{
	perror(what);
	exit(1);
}

static void futex_eagain(void)
{
	syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
}

/* --- pingpong ---------------------------------------------------------------------------- */

static pthread_mutex_t pp_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pp_cv = PTHREAD_COND_INITIALIZER;
static long pp_turn; /* even: main's turn, odd: the peer's */
static long pp_n;

static void *pp_peer(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&pp_mu);
	while (pp_turn < 2 * pp_n) {
		while (!(pp_turn & 1) && pp_turn < 2 * pp_n)
			pthread_cond_wait(&pp_cv, &pp_mu);
		if (pp_turn >= 2 * pp_n)
			break;
		pp_turn++;
		pthread_cond_signal(&pp_cv);
	}
	pthread_mutex_unlock(&pp_mu);
	return NULL;
}

/* n round trips, 2n hand-offs; returns ns per hand-off. */
static double pingpong(long n)
{
	pthread_t th;
	pp_n = n;
	/* Both threads on one CPU: each hand-off is then a wake and a context switch, the same
	 * every time. Across two CPUs the figure mostly measures how deep the idle CPU slept,
	 * and varied twofold from run to run. The peer inherits the mask. */
	cpu_set_t one;
	CPU_ZERO(&one);
	CPU_SET(sched_getcpu(), &one);
	if (sched_setaffinity(0, sizeof one, &one) != 0)
		die("sched_setaffinity");
	if (pthread_create(&th, NULL, pp_peer, NULL) != 0)
		die("pthread_create");
	double t0 = now_ns();
	pthread_mutex_lock(&pp_mu);
	while (pp_turn < 2 * n) {
		pp_turn++;
		pthread_cond_signal(&pp_cv);
		while ((pp_turn & 1) && pp_turn < 2 * n)
			pthread_cond_wait(&pp_cv, &pp_mu);
	}
	pthread_mutex_unlock(&pp_mu);
	double dt = now_ns() - t0;
	pthread_join(th, NULL);
	return dt / (2.0 * n);
}

/* --- paced loops --------------------------------------------------------------------------- */

/* Calls step() about rate times a second for secs seconds, in batches so the clock is read
 * rarely; returns the rate achieved. */
static double paced(double rate, double secs, void (*step)(void))
{
	long batch = rate >= 10000 ? (long)(rate / 1000) : 1;
	double t0 = now_ns(), end = t0 + secs * 1e9;
	long done = 0;
	for (;;) {
		double t = now_ns();
		if (t >= end)
			break;
		double due = t0 + done * 1e9 / rate;
		if (t < due) {
			double wait = due - t;
			struct timespec ts = {(time_t)(wait / 1e9), (long)((long long)wait % 1000000000LL)};
			nanosleep(&ts, NULL);
			continue;
		}
		for (long i = 0; i < batch; i++)
			step();
		done += batch;
	}
	return done / ((now_ns() - t0) / 1e9);
}

static void bind_listen_once(void)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd < 0)
		die("socket");
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
	sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0)
		die("bind");
	if (listen(fd, 1) != 0)
		die("listen");
	close(fd);
}

/* --- park ---------------------------------------------------------------------------------- */

static pthread_mutex_t pk_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pk_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pk_all_in = PTHREAD_COND_INITIALIZER;
static long pk_waiting;

static void *pk_worker(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&pk_mu);
	pk_waiting++;
	pthread_cond_signal(&pk_all_in);
	for (;;)
		pthread_cond_wait(&pk_cv, &pk_mu);
	return NULL;
}

static void park(long n)
{
	pthread_attr_t attr;
	pthread_attr_init(&attr);
	pthread_attr_setstacksize(&attr, 64 * 1024); /* 2,000 default 8 MiB stacks is a lot of VM */
	for (long i = 0; i < n; i++) {
		pthread_t th;
		if (pthread_create(&th, &attr, pk_worker, NULL) != 0)
			die("pthread_create");
	}
	/* cond_wait releases the mutex atomically: once all have counted in under it, all wait. */
	pthread_mutex_lock(&pk_mu);
	while (pk_waiting < n)
		pthread_cond_wait(&pk_all_in, &pk_mu);
	pthread_mutex_unlock(&pk_mu);
	printf("PARKED %ld\n", n);
	fflush(stdout);
	for (;;)
		pause();
}

/* --- serve ----------------------------------------------------------------------------- */

static int serve_listen(void)
{
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t len = sizeof a;
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 4096) != 0)
		die("listen");
	if (getsockname(fd, (struct sockaddr *)&a, &len) != 0)
		die("getsockname");
	printf("PORT %d\n", ntohs(a.sin_port));
	fflush(stdout);
	return fd;
}

static void serve(int lfd, long n)
{
	/* Each connection is an fd: as many as the hard limit allows (the harness raises it). */
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	int ep = epoll_create1(0);
	if (ep < 0)
		die("epoll_create1");
	for (long i = 0; i < n; i++) {
		int c = accept(lfd, NULL, NULL);
		if (c < 0)
			die("accept");
		struct epoll_event ev = {.events = EPOLLIN, .data.fd = c};
		if (epoll_ctl(ep, EPOLL_CTL_ADD, c, &ev) != 0)
			die("epoll_ctl");
	}
	printf("SERVING %ld\n", n);
	fflush(stdout);
	struct epoll_event lev = {.events = EPOLLIN, .data.fd = lfd};
	if (epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &lev) != 0)
		die("epoll_ctl");
	struct epoll_event evs[64];
	char buf[4096];
	for (;;) {
		int k = epoll_wait(ep, evs, 64, -1);
		for (int i = 0; i < k; i++) {
			int fd = evs[i].data.fd;
			if (fd == lfd) {
				int c = accept(lfd, NULL, NULL);
				struct epoll_event ev = {.events = EPOLLIN, .data.fd = c};
				if (c >= 0 && epoll_ctl(ep, EPOLL_CTL_ADD, c, &ev) != 0)
					close(c);
			} else if (read(fd, buf, sizeof buf) <= 0 || write(fd, "ok\n", 3) != 3) {
				close(fd); /* closing removes it from the epoll set */
			}
		}
	}
}

/* --- turn ------------------------------------------------------------------------------ */

static pthread_mutex_t tn_a = PTHREAD_MUTEX_INITIALIZER, tn_b = PTHREAD_MUTEX_INITIALIZER;
static double tn_until;
static long tn_rate;

static void *tn_worker(void *arg)
{
	int flip = (int)(intptr_t)arg;
	struct timespec pause_ = {0, 1000000000L / tn_rate};
	while (now_ns() < tn_until) {
		pthread_mutex_lock(&tn_a);
		pthread_mutex_lock(&tn_b);
		pthread_mutex_unlock(&tn_b);
		pthread_mutex_unlock(&tn_a);
		nanosleep(&pause_, NULL);
	}
	/* Opposite orders, each holding its first long enough for the other to take its own. */
	struct timespec hold = {0, 50000000L};
	pthread_mutex_lock(flip ? &tn_b : &tn_a);
	nanosleep(&hold, NULL);
	pthread_mutex_lock(flip ? &tn_a : &tn_b);
	return NULL;
}

static void turn(long rate, double secs)
{
	pthread_t th[2];
	tn_rate = rate;
	tn_until = now_ns() + secs * 1e9;
	for (long i = 0; i < 2; i++)
		if (pthread_create(&th[i], NULL, tn_worker, (void *)(intptr_t)i) != 0)
			die("pthread_create");
	struct timespec past = {(time_t)secs, 200000000L};
	nanosleep(&past, NULL);
	printf("DEADLOCKED\n");
	fflush(stdout);
	for (;;)
		pause();
}

/* A connection to itself over loopback: *client is the connecting end, the accepted end is
 * returned, Nagle off on both so each 1-byte send goes at once. */
static int answer_connection(int *client)
{
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t len = sizeof a;
	int one = 1;
	int lfd = socket(AF_INET, SOCK_STREAM, 0);
	if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(lfd, 1) != 0 ||
	    getsockname(lfd, (struct sockaddr *)&a, &len) != 0)
		die("answer listen");
	*client = socket(AF_INET, SOCK_STREAM, 0);
	if (*client < 0 || connect(*client, (struct sockaddr *)&a, sizeof a) != 0)
		die("answer connect");
	int fd = accept(lfd, NULL, NULL);
	if (fd < 0)
		die("answer accept");
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	setsockopt(*client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	return fd;
}

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: %s MODE N [SECONDS]\n", argv[0]);
		return 2;
	}
	const char *mode = argv[1];
	long n = atol(argv[2]);
	double secs = argc > 3 ? atof(argv[3]) : 0;
	if (n <= 0) {
		fprintf(stderr, "N must be positive\n");
		return 2;
	}
	int devnull = strcmp(mode, "write") == 0 ? open("/dev/null", O_WRONLY) : -1;
	int file = strcmp(mode, "pread") == 0 ? open("/proc/self/exe", O_RDONLY)
		 : strcmp(mode, "read-dev") == 0 ? open("/dev/zero", O_RDONLY)
						 : -1;
	int pair[2] = {-1, -1};
	if (strcmp(mode, "send") == 0 && socketpair(AF_UNIX, SOCK_DGRAM, 0, pair) != 0)
		die("socketpair");
	int lfd = strcmp(mode, "serve") == 0 ? serve_listen() : -1;
	char go[16];
	if (!fgets(go, sizeof go, stdin))
		return 1;

	int client = -1;
	int answer = strcmp(mode, "answer") == 0 ? answer_connection(&client) : -1;

	double t0 = now_ns();
	if (strcmp(mode, "futex-wait") == 0) {
		for (long i = 0; i < n; i++)
			futex_eagain();
	} else if (strcmp(mode, "futex-wake") == 0) {
		for (long i = 0; i < n; i++)
			syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
	} else if (strcmp(mode, "mutex") == 0) {
		static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
		static volatile long counter;
		for (long i = 0; i < n; i++) {
			pthread_mutex_lock(&mu);
			counter++;
			pthread_mutex_unlock(&mu);
		}
	} else if (strcmp(mode, "getppid") == 0) {
		for (long i = 0; i < n; i++)
			syscall(SYS_getppid);
	} else if (strcmp(mode, "rename") == 0) {
		for (long i = 0; i < n; i++)
			prctl(PR_SET_NAME, (i & 1) ? "hw-bench-a" : "hw-bench-b", 0, 0, 0);
	} else if (strcmp(mode, "write") == 0) {
		for (long i = 0; i < n; i++)
			if (write(devnull, "x", 1) != 1)
				die("write");
	} else if (strcmp(mode, "poll") == 0) {
		int fds[2];
		if (pipe(fds) != 0)
			die("pipe");
		struct pollfd p = {.fd = fds[0], .events = POLLIN};
		for (long i = 0; i < n; i++)
			if (poll(&p, 1, 0) != 0)
				die("poll");
	} else if (strcmp(mode, "pread") == 0) {
		char buf[64];
		for (long i = 0; i < n; i++)
			if (pread(file, buf, sizeof buf, 0) != sizeof buf)
				die("pread");
	} else if (strcmp(mode, "read-dev") == 0) {
		char c;
		for (long i = 0; i < n; i++)
			if (read(file, &c, 1) != 1)
				die("read");
	} else if (strcmp(mode, "send") == 0) {
		char c;
		for (long i = 0; i < n; i++)
			if (send(pair[0], "x", 1, 0) != 1 || recv(pair[1], &c, 1, 0) != 1)
				die("send");
	} else if (strcmp(mode, "answer") == 0) {
		char c;
		for (long i = 0; i < n; i++)
			if (send(answer, "x", 1, 0) != 1 || recv(client, &c, 1, 0) != 1)
				die("answer");
	} else if (strcmp(mode, "pingpong") == 0) {
		printf("%.1f\n", pingpong(n));
		return 0;
	} else if (strcmp(mode, "futex-rate") == 0) {
		printf("RATE %.0f\n", paced((double)n, secs, futex_eagain));
		return 0;
	} else if (strcmp(mode, "bind-listen") == 0) {
		printf("RATE %.0f\n", paced((double)n, secs, bind_listen_once));
		return 0;
	} else if (strcmp(mode, "park") == 0) {
		park(n);
	} else if (strcmp(mode, "serve") == 0) {
		serve(lfd, n);
	} else if (strcmp(mode, "turn") == 0) {
		turn(n, secs);
	} else {
		fprintf(stderr, "unknown mode %s\n", mode);
		return 2;
	}
	printf("%.1f\n", (now_ns() - t0) / n);
	return 0;
}
