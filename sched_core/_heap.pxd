# cython: language_level=3
"""A 4-ary min-heap of 16-byte C structs, for the compiled core.

Four children share one cache line, so a heap of n entries is log4(n) lines deep: at
10^5 queued requests the heaps no longer fit in cache and every line is a miss.

Entries order by ``p``; ties (rare: keys are times and costs) go to a secondary key looked
up by handle, ``sec[h]``, then to the string ``ids[h]``, then to ``v``; without ``sec``
they go to ``h`` itself, then ``v``. That is the total order of the reference's tuples
(``(p, arrival, id, ...)``, or ``(counter, tenant, version)``), so both pop the valid
entries in the same sequence.
"""

from libc.stdlib cimport free, realloc

from sched_core._fast cimport PyList_GET_ITEM, PyUnicode_Compare


cdef struct Entry:
    double p          # primary key
    int h             # request handle (or tenant index, in a heap without sec)
    unsigned int v    # version (wraps; only ever compared with the current one)


cdef struct Heap:
    Entry* a
    Py_ssize_t n
    Py_ssize_t cap


cdef inline bint entry_lt(const Entry* x, const Entry* y, const double* sec,
                          list ids) noexcept:
    if x.p != y.p:
        return x.p < y.p
    return tie_lt(x, y, sec, ids)


cdef inline bint tie_lt(const Entry* x, const Entry* y, const double* sec,
                        list ids) noexcept:
    # ids holds only str (Request checks it), so the comparison cannot fail.
    cdef int c
    if x.h != y.h:
        if sec == NULL:
            return x.h < y.h
        if sec[x.h] != sec[y.h]:
            return sec[x.h] < sec[y.h]
        c = PyUnicode_Compare(PyList_GET_ITEM(ids, x.h), PyList_GET_ITEM(ids, y.h))
        if c != 0:
            return c < 0
    return x.v < y.v


cdef inline int heap_grow(Heap* hp) except -1:
    cdef Entry* grown
    if hp.n == hp.cap:
        hp.cap = 16 if hp.cap == 0 else 2 * hp.cap
        grown = <Entry*>realloc(hp.a, hp.cap * sizeof(Entry))
        if grown == NULL:
            raise MemoryError()
        hp.a = grown
    return 0


cdef inline Py_ssize_t min_child(const Heap* hp, Py_ssize_t i, const double* sec,
                                 list ids) noexcept:
    """The smallest child of node i, or -1 for a leaf."""
    cdef Py_ssize_t first = 4 * i + 1, c, best
    if first >= hp.n:
        return -1
    best = first
    for c in range(first + 1, min(first + 4, hp.n)):
        if entry_lt(&hp.a[c], &hp.a[best], sec, ids):
            best = c
    return best


cdef inline int heap_push(Heap* hp, Entry e, const double* sec, list ids) except -1:
    cdef Py_ssize_t i, parent
    heap_grow(hp)
    i = hp.n
    hp.n += 1
    while i > 0:
        parent = (i - 1) >> 2
        if not entry_lt(&e, &hp.a[parent], sec, ids):
            break
        hp.a[i] = hp.a[parent]
        i = parent
    hp.a[i] = e
    return 0


cdef inline int heap_replace_top(Heap* hp, Entry e, const double* sec, list ids) noexcept:
    """Replace the smallest entry by ``e`` (the heap must not be empty)."""
    cdef Py_ssize_t i = 0, child
    while True:
        child = min_child(hp, i, sec, ids)
        if child < 0 or not entry_lt(&hp.a[child], &e, sec, ids):
            break
        hp.a[i] = hp.a[child]
        i = child
    hp.a[i] = e
    return 0


cdef inline Entry heap_pop(Heap* hp, const double* sec, list ids) noexcept:
    """Remove and return the smallest entry (the heap must not be empty)."""
    cdef Entry top = hp.a[0]
    hp.n -= 1
    if hp.n > 0:
        heap_replace_top(hp, hp.a[hp.n], sec, ids)
    return top


cdef inline void heap_free(Heap* hp) noexcept:
    free(hp.a)
    hp.a = NULL
    hp.n = 0
    hp.cap = 0
