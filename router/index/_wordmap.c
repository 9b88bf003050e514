/* WordMap (see _wordmap.h): the table; the Python type over it is _wordmap_type.c. */
#include "_wordmap.h"

#include <string.h>

#define MIN_CAPACITY 8

static inline size_t home(const WordMap *map, uint64_t key)
{
    return (size_t)((key * UINT64_C(0x9E3779B97F4A7C15)) >> map->shift);
}

static inline uint8_t full(WordKey key)
{
    return (uint8_t)(WORDMAP_FULL | (key.negative ? WORDMAP_NEGATIVE : 0));
}

Py_ssize_t wordmap_find(const WordMap *map, WordKey key)
{
    if (map->ctrl == NULL)
        return -1;
    uint8_t want = full(key);
    for (size_t i = home(map, key.bits);; i = (i + 1) & map->mask) {
        if (map->ctrl[i] == WORDMAP_EMPTY)
            return -1;
        if (map->ctrl[i] == want && map->slots[i * wordmap_stride(map)] == key.bits)
            return (Py_ssize_t)i;
    }
}

int wordmap_key(PyObject *key, WordKey *out)
{
    if (!PyLong_Check(key))
        return 0;
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(key, &overflow);
    if (value == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (overflow == 0) {
        out->bits = (uint64_t)value;
        out->negative = value < 0;
        return 1;
    }
    if (overflow < 0)
        return 0;
    out->bits = PyLong_AsUnsignedLongLong(key); /* 2**63 .. 2**64 - 1 */
    out->negative = 0;
    if (out->bits == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

PyObject *wordmap_key_object(uint64_t bits, uint8_t ctrl)
{
    return ctrl & WORDMAP_NEGATIVE ? PyLong_FromLongLong((long long)bits)
                           : PyLong_FromUnsignedLongLong(bits);
}

static int rehash(WordMap *map, size_t capacity)
{
    size_t width = (size_t)map->lanes + 1;
    uint8_t *ctrl = PyMem_Calloc(capacity, 1);
    uint64_t *slots = PyMem_Malloc(capacity * width * sizeof(uint64_t));
    if (ctrl == NULL || slots == NULL) {
        PyMem_Free(ctrl);
        PyMem_Free(slots);
        PyErr_NoMemory();
        return -1;
    }
    uint8_t *old_ctrl = map->ctrl;
    uint64_t *old_slots = map->slots;
    size_t old_capacity = old_ctrl == NULL ? 0 : map->mask + 1;
    map->ctrl = ctrl;
    map->slots = slots;
    map->mask = capacity - 1;
    map->shift = 64;
    for (size_t c = capacity; c > 1; c >>= 1)
        map->shift--;
    map->filled = map->used;
    for (size_t j = 0; j < old_capacity; j++) {
        if (!(old_ctrl[j] & WORDMAP_FULL))
            continue;
        const uint64_t *entry = old_slots + j * width;
        size_t i = home(map, entry[0]);
        while (ctrl[i] != WORDMAP_EMPTY)
            i = (i + 1) & map->mask;
        ctrl[i] = old_ctrl[j];
        memcpy(slots + i * width, entry, width * sizeof(uint64_t));
    }
    PyMem_Free(old_ctrl);
    PyMem_Free(old_slots);
    return 0;
}

int wordmap_insert_new(WordMap *map, WordKey key, const uint64_t *lanes)
{
    size_t capacity = map->ctrl == NULL ? 0 : map->mask + 1;
    if ((size_t)(map->filled + 1) * 4 > capacity * 3) { /* load above 3/4: grow or clean */
        size_t wanted = MIN_CAPACITY;
        while (wanted * 3 < (size_t)(map->used + 1) * 8) /* to a load of at most 3/8 */
            wanted <<= 1;
        if (rehash(map, wanted) < 0)
            return -1;
    }
    size_t i = home(map, key.bits);
    while (map->ctrl[i] & WORDMAP_FULL)
        i = (i + 1) & map->mask;
    if (map->ctrl[i] == WORDMAP_EMPTY)
        map->filled++;
    map->ctrl[i] = full(key);
    uint64_t *entry = map->slots + i * wordmap_stride(map);
    entry[0] = key.bits;
    memcpy(entry + 1, lanes, (size_t)map->lanes * sizeof(uint64_t));
    map->used++;
    return 0;
}

void wordmap_delete_at(WordMap *map, Py_ssize_t slot)
{
    map->ctrl[slot] = WORDMAP_DELETED;
    map->used--;
}

void wordmap_prefetch(const WordMap *map, const WordKey *keys, Py_ssize_t count)
{
#if defined(__GNUC__) || defined(__clang__)
    if (map->ctrl == NULL)
        return;
    for (Py_ssize_t i = 0; i < count; i++) {
        size_t slot = home(map, keys[i].bits);
        __builtin_prefetch(map->ctrl + slot);
        __builtin_prefetch(map->slots + slot * wordmap_stride(map));
    }
#else
    (void)map, (void)keys, (void)count;
#endif
}

int wordmap_extra_holds(const WordMap *map, PyObject *key)
{
    return map->extra == NULL ? 0 : PyDict_Contains(map->extra, key);
}

void wordmap_release(WordMap *map)
{
    PyMem_Free(map->ctrl);
    PyMem_Free(map->slots);
    map->ctrl = NULL;
    map->slots = NULL;
    map->mask = 0;
    map->used = map->filled = 0;
    Py_CLEAR(map->extra);
}

PyObject *wordmap_int(const uint64_t *lanes, int count)
{
    uint8_t bytes[WORDMAP_MAX_LANES * 8];
    for (int l = 0; l < count; l++)
        for (int b = 0; b < 8; b++)
            bytes[l * 8 + b] = (uint8_t)(lanes[l] >> (8 * b));
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(bytes, (Py_ssize_t)count * 8,
                                          Py_ASNATIVEBYTES_LITTLE_ENDIAN |
                                              Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
#else
    return _PyLong_FromByteArray(bytes, (size_t)count * 8, 1, 0);
#endif
}
