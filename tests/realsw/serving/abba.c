/*
 * abba.c: a "native extension" with a lock-order bug, for the native-abba shape.
 *
 * Two pthread mutexes; abba_ab() takes A then B, abba_ba() takes B then A, with a barrier
 * between the first and the second lock so that the deadlock is certain, not likely.
 * The scheduler calls both from two Python threads through ctypes (which releases the GIL
 * around the call), so both threads end up in futex(2) inside pthread_mutex_lock, holding
 * one mutex each. Built at test time: gcc -shared -fPIC -pthread (see native.py).
 */
#include <pthread.h>

pthread_mutex_t abba_a = PTHREAD_MUTEX_INITIALIZER;
pthread_mutex_t abba_b = PTHREAD_MUTEX_INITIALIZER;
static pthread_barrier_t meet;

int abba_init(void) { return pthread_barrier_init(&meet, NULL, 2); }

static int lock_both(pthread_mutex_t *first, pthread_mutex_t *second) {
    pthread_mutex_lock(first);
    pthread_barrier_wait(&meet); /* both hold their first lock before either asks */
    pthread_mutex_lock(second);  /* never returns */
    pthread_mutex_unlock(second);
    pthread_mutex_unlock(first);
    return 0;
}

int abba_ab(void) { return lock_both(&abba_a, &abba_b); }
int abba_ba(void) { return lock_both(&abba_b, &abba_a); }
