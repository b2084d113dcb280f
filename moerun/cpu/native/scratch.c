/* moerun_scratch_parts (common.h): one grow-only region per calling thread, freed with the thread. */
#include <pthread.h>
#include <stdlib.h>

#include "common.h"

static pthread_key_t key;
static pthread_once_t once = PTHREAD_ONCE_INIT;

typedef struct {
    void *p;
    size_t cap;
} scratch_t;

static void release(void *s) {
    free(((scratch_t *)s)->p);
    free(s);
}

static void make_key(void) { pthread_key_create(&key, release); }

static void *scratch(size_t bytes) {
    pthread_once(&once, make_key);
    scratch_t *s = pthread_getspecific(key);
    if (!s) {
        if (!(s = calloc(1, sizeof *s))) return NULL;
        pthread_setspecific(key, s);
    }
    if (bytes > s->cap) {
        const size_t cap = (bytes + bytes / 4 + 4095) / 4096 * 4096; /* a quarter more: fewer regrowths */
        free(s->p);
        s->p = aligned_alloc(64, cap);
        s->cap = s->p ? cap : 0;
    }
    return s->p;
}

static size_t rounded(size_t bytes) { return (bytes + 63) / 64 * 64; }

int moerun_scratch_parts(int n, const size_t *sizes, void **parts) {
    size_t total = 64;
    for (int i = 0; i < n; i++) total += rounded(sizes[i]);
    char *base = scratch(total);
    for (int i = 0; i < n; i++) {
        if (!base) {
            parts[i] = NULL;
            continue;
        }
        parts[i] = sizes[i] ? base : NULL;
        base += rounded(sizes[i]);
    }
    return base ? 0 : -4;
}
