/* WordMap (see _wordmap.h): the table; the Python type over it is _wordmap_type.c. */
#include "_wordmap.h"

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
    /* 2**63 or more: a table key if below 2**64 (engine hashes are, half of them).
     * Not PyLong_AsUnsignedLongLong: before 3.12 it goes through a byte array. */
    out->negative = 0;
#if PY_VERSION_HEX >= 0x030D0000
    int flags = Py_ASNATIVEBYTES_NATIVE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER |
                Py_ASNATIVEBYTES_REJECT_NEGATIVE;
    Py_ssize_t needed = PyLong_AsNativeBytes(key, &out->bits, sizeof out->bits, flags);
    if (needed < 0)
        PyErr_Clear();
    return needed >= 0 && (size_t)needed <= sizeof out->bits;
#else
    if (_PyLong_NumBits(key) > 64)
        return 0;
    out->bits = PyLong_AsUnsignedLongLongMask(key);
    return 1;
#endif
}

PyObject *wordmap_key_object(uint64_t bits, uint8_t ctrl)
{
    return ctrl & WORDMAP_NEGATIVE ? PyLong_FromLongLong((long long)bits)
                           : PyLong_FromUnsignedLongLong(bits);
}

/* dst[0..n) = src[0..n), n at most WORDMAP_MAX_LANES + 1: not memcpy, which is a library
 * call per entry for a few words. */
static inline void copy_words(uint64_t *dst, const uint64_t *src, size_t n)
{
    switch (n) {
    case 5:
        dst[4] = src[4];
        /* fall through */
    case 4:
        dst[3] = src[3];
        /* fall through */
    case 3:
        dst[2] = src[2];
        /* fall through */
    case 2:
        dst[1] = src[1];
        /* fall through */
    default:
        dst[0] = src[0];
    }
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
        copy_words(slots + i * width, entry, width);
    }
    PyMem_Free(old_ctrl);
    PyMem_Free(old_slots);
    return 0;
}

int wordmap_reserve(WordMap *map, Py_ssize_t more)
{
    size_t capacity = map->ctrl == NULL ? 0 : map->mask + 1;
    if ((size_t)(map->filled + more) * 4 <= capacity * 3)
        return 0;
    size_t wanted = MIN_CAPACITY; /* above a load of 3/4: grow or clean, to at most 3/8 */
    while (wanted * 3 < (size_t)(map->used + more) * 8)
        wanted <<= 1;
    return rehash(map, wanted);
}

/* Fill slot i (not full) with key and its lanes. */
static void put(WordMap *map, size_t i, WordKey key, const uint64_t *lanes)
{
    if (map->ctrl[i] == WORDMAP_EMPTY)
        map->filled++;
    map->ctrl[i] = full(key);
    uint64_t *entry = map->slots + i * wordmap_stride(map);
    entry[0] = key.bits;
    copy_words(entry + 1, lanes, (size_t)map->lanes);
    map->used++;
}

int wordmap_insert_new(WordMap *map, WordKey key, const uint64_t *lanes)
{
    if (wordmap_reserve(map, 1) < 0)
        return -1;
    size_t i = home(map, key.bits);
    while (map->ctrl[i] & WORDMAP_FULL)
        i = (i + 1) & map->mask;
    put(map, i, key, lanes);
    return 0;
}

int wordmap_insert_absent(WordMap *map, WordKey key, const uint64_t *lanes)
{
    uint8_t want = full(key);
    size_t free_slot = SIZE_MAX;
    size_t i = home(map, key.bits);
    for (; map->ctrl[i] != WORDMAP_EMPTY; i = (i + 1) & map->mask) {
        if (map->ctrl[i] == want && map->slots[i * wordmap_stride(map)] == key.bits)
            return 0;
        if (map->ctrl[i] == WORDMAP_DELETED && free_slot == SIZE_MAX)
            free_slot = i;
    }
    put(map, free_slot == SIZE_MAX ? i : free_slot, key, lanes);
    return 1;
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
