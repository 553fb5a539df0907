# cython: language_level=3
"""Checkpoints the engine passes through: a state copy allocates, a prompt fill added
its tokens, a step begins. In a release build each check does nothing.

Why C preprocessor blocks and not Cython's IF: the generated .c is the same for
every build (so a stale .c can never carry one build's code into the other), and
what a release build leaves out is simply never compiled: no string, no symbol.
The build switch is described in setup.py; what the checks do when compiled in is
described in tests/faults/README.md. Settings are read once, when this module loads.

The decode thread is the only caller (DESIGN.md contract 1), so the counters need no lock.
"""

cdef extern from *:
    """
    #ifndef FASTSERVE_TEST_FAULTS
    #define FASTSERVE_TEST_FAULTS 0
    #endif
    #if FASTSERVE_TEST_FAULTS
    #include <stdlib.h>
    #include <time.h>
    static long long fsf_copies_left = 0, fsf_fills_left = 0;   /* 64 bits everywhere (a long is 32 on Windows) */
    static double fsf_stall_s = 0.0;
    static long long fsf_env_count(const char *name) {
        const char *s = getenv(name);
        long long n = s ? strtoll(s, NULL, 10) : 0;
        return n > 0 ? n : 0;
    }
    static void fsf_load(void) {
        const char *s = getenv("FASTSERVE_TEST_STALL_STEP_S");
        fsf_copies_left = fsf_env_count("FASTSERVE_TEST_FAIL_CACHE_COPIES");
        fsf_fills_left = fsf_env_count("FASTSERVE_TEST_FAIL_PROMPT_FILLS");
        fsf_stall_s = s ? strtod(s, NULL) : 0.0;
        if (!(fsf_stall_s > 0.0)) fsf_stall_s = 0.0;
    }
    static const char *fsf_copy(void) {
        if (fsf_copies_left <= 0) return NULL;
        fsf_copies_left--;
        return "test fault: the state copy could not be allocated";
    }
    static const char *fsf_fill(void) {
        if (fsf_fills_left <= 0) return NULL;
        fsf_fills_left--;
        return "test fault: the prompt fill failed after adding its tokens";
    }
    static double fsf_take_stall(void) {
        double s = fsf_stall_s;
        fsf_stall_s = 0.0;
        return s;
    }
    static void fsf_sleep(double s) {
        struct timespec ts;
        ts.tv_sec = (time_t)s;
        ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
        while (nanosleep(&ts, &ts) != 0) {}
    }
    static PyObject *fsf_settings(void) {
        return Py_BuildValue("{s:L,s:L,s:d}", "copies", fsf_copies_left, "fills", fsf_fills_left,
                             "stall_s", fsf_stall_s);
    }
    #define FSF_ENABLED 1
    #else
    #define fsf_load() ((void)0)
    #define fsf_copy() ((const char *)0)
    #define fsf_fill() ((const char *)0)
    #define fsf_take_stall() (0.0)
    #define fsf_sleep(s) ((void)0)
    #define fsf_settings() PyDict_New()
    #define FSF_ENABLED 0
    #endif
    """
    bint FSF_ENABLED
    void fsf_load() nogil
    const char *fsf_copy() nogil
    const char *fsf_fill() nogil
    double fsf_take_stall() nogil
    void fsf_sleep(double s) nogil
    object fsf_settings()

fsf_load()

ENABLED = bool(FSF_ENABLED)     # True only in a build made to carry the checks


def check_copy():
    """A state copy is about to take its memory: raises MemoryError when it must be refused."""
    cdef const char *why = fsf_copy()
    if why != NULL:
        raise MemoryError(why.decode())


def check_fill():
    """A prompt fill has added its tokens to the batch: raises RuntimeError when it must fail."""
    cdef const char *why = fsf_fill()
    if why != NULL:
        raise RuntimeError(why.decode())


def check_step():
    """A step with work is about to run its forward pass: may block (without the GIL)."""
    cdef double s = fsf_take_stall()
    if s > 0.0:
        with nogil:
            fsf_sleep(s)


def settings():
    """What is left to trigger (empty in a release build)."""
    return fsf_settings()
