# cython: language_level=3
"""Request id (a str) → handle, an open-addressing hash table for the compiled core.

A dict keyed by str stores no hashes (since CPython 3.11) and reads every probed key
object to compare, a cache miss each at 10^5 keys; this table keeps the str's cached hash
beside the handle, so a probe touches one slot. Linear probing; removal shifts the
following entries back, so there are no tombstones.
"""

from cpython.object cimport PyObject
from libc.stdlib cimport calloc, free

from sched_core._fast cimport PyList_GET_ITEM, PyUnicode_Compare


cdef struct Slot:
    Py_hash_t hash
    int h                # handle, or -1 for an empty slot


cdef struct IdTable:
    Slot* slots
    size_t mask          # capacity - 1 (capacity is a power of two)
    size_t used


cdef inline int idt_init(IdTable* t, size_t capacity) except -1:
    cdef size_t i
    t.slots = <Slot*>calloc(capacity, sizeof(Slot))
    if t.slots == NULL:
        raise MemoryError()
    for i in range(capacity):
        t.slots[i].h = -1
    t.mask = capacity - 1
    t.used = 0
    return 0


cdef inline int idt_find(const IdTable* t, Py_hash_t hash, str rid, list ids) noexcept:
    """The handle whose id (``ids[handle]``) equals ``rid``, or -1."""
    cdef size_t i = <size_t>hash & t.mask
    cdef PyObject* other
    while t.slots[i].h >= 0:
        if t.slots[i].hash == hash:
            other = PyList_GET_ITEM(ids, t.slots[i].h)
            if other == <PyObject*>rid or PyUnicode_Compare(other, <PyObject*>rid) == 0:
                return t.slots[i].h
        i = (i + 1) & t.mask
    return -1


cdef inline void _idt_place(IdTable* t, Py_hash_t hash, int h) noexcept:
    cdef size_t i = <size_t>hash & t.mask
    while t.slots[i].h >= 0:
        i = (i + 1) & t.mask
    t.slots[i].hash = hash
    t.slots[i].h = h


cdef inline int idt_insert(IdTable* t, Py_hash_t hash, int h) except -1:
    """Add a handle whose id is not in the table; grows to keep the load under one half."""
    cdef IdTable old
    cdef size_t i
    if 2 * (t.used + 1) > t.mask + 1:
        old = t[0]
        idt_init(t, 2 * (old.mask + 1))
        for i in range(old.mask + 1):
            if old.slots[i].h >= 0:
                _idt_place(t, old.slots[i].hash, old.slots[i].h)
        t.used = old.used
        free(old.slots)
    _idt_place(t, hash, h)
    t.used += 1
    return 0


cdef inline void idt_remove(IdTable* t, Py_hash_t hash, int h) noexcept:
    """Remove handle ``h`` (entered with ``hash``)."""
    cdef size_t i = <size_t>hash & t.mask, j, home
    while t.slots[i].h != h:
        i = (i + 1) & t.mask
    j = i
    while True:
        j = (j + 1) & t.mask
        if t.slots[j].h < 0:
            break
        home = <size_t>t.slots[j].hash & t.mask
        # Move slot j back into the hole at i unless its home lies cyclically in (i, j].
        if ((j - home) & t.mask) >= ((j - i) & t.mask):
            t.slots[i] = t.slots[j]
            i = j
    t.slots[i].h = -1
    t.used -= 1


cdef inline void idt_free(IdTable* t) noexcept:
    free(t.slots)
    t.slots = NULL
