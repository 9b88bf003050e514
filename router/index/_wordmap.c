/* WordMap (see _wordmap.h): the table, and the Python mapping protocol over it. */
#include "_wordmap.h"

#include <string.h>

enum { EMPTY = 0, FULL = 1, DELETED = 2, NEGATIVE = 4 };
#define MIN_CAPACITY 8

static inline size_t stride(const WordMap *map) { return (size_t)map->lanes + 1; }

static inline size_t home(const WordMap *map, uint64_t key)
{
    return (size_t)((key * UINT64_C(0x9E3779B97F4A7C15)) >> map->shift);
}

static inline uint8_t full(WordKey key) { return (uint8_t)(FULL | (key.negative ? NEGATIVE : 0)); }

Py_ssize_t wordmap_find(const WordMap *map, WordKey key)
{
    if (map->ctrl == NULL)
        return -1;
    uint8_t want = full(key);
    for (size_t i = home(map, key.bits);; i = (i + 1) & map->mask) {
        if (map->ctrl[i] == EMPTY)
            return -1;
        if (map->ctrl[i] == want && map->slots[i * stride(map)] == key.bits)
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

static PyObject *key_object(uint64_t bits, uint8_t ctrl)
{
    return ctrl & NEGATIVE ? PyLong_FromLongLong((long long)bits)
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
        if (!(old_ctrl[j] & FULL))
            continue;
        const uint64_t *entry = old_slots + j * width;
        size_t i = home(map, entry[0]);
        while (ctrl[i] != EMPTY)
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
    while (map->ctrl[i] & FULL)
        i = (i + 1) & map->mask;
    if (map->ctrl[i] == EMPTY)
        map->filled++;
    map->ctrl[i] = full(key);
    uint64_t *entry = map->slots + i * stride(map);
    entry[0] = key.bits;
    memcpy(entry + 1, lanes, (size_t)map->lanes * sizeof(uint64_t));
    map->used++;
    return 0;
}

void wordmap_delete_at(WordMap *map, Py_ssize_t slot)
{
    map->ctrl[slot] = DELETED;
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
        __builtin_prefetch(map->slots + slot * stride(map));
    }
#else
    (void)map, (void)keys, (void)count;
#endif
}

int wordmap_extra_holds(const WordMap *map, PyObject *key)
{
    return map->extra == NULL ? 0 : PyDict_Contains(map->extra, key);
}

/* -- conversions -------------------------------------------------------------------- */

/* A value as lanes: 1, or 0 when it does not fit (not a non-negative int that narrow). */
static int table_value(const WordMap *map, PyObject *value, uint64_t *lanes)
{
    if (!PyLong_Check(value))
        return 0;
    size_t n = (size_t)map->lanes * 8;
    uint8_t bytes[WORDMAP_MAX_LANES * 8];
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t needed = PyLong_AsNativeBytes(
        value, bytes, (Py_ssize_t)n,
        Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER |
            Py_ASNATIVEBYTES_REJECT_NEGATIVE);
    if (needed < 0 || (size_t)needed > n) {
        PyErr_Clear();
        return 0;
    }
#else
    if (_PyLong_AsByteArray((PyLongObject *)value, bytes, n, 1, 0) < 0) {
        PyErr_Clear();
        return 0;
    }
#endif
    for (int l = 0; l < map->lanes; l++) {
        uint64_t lane = 0;
        for (int b = 7; b >= 0; b--)
            lane = lane << 8 | bytes[l * 8 + b];
        lanes[l] = lane;
    }
    return 1;
}

static PyObject *lanes_value(const WordMap *map, const uint64_t *lanes)
{
    uint8_t bytes[WORDMAP_MAX_LANES * 8];
    for (int l = 0; l < map->lanes; l++)
        for (int b = 0; b < 8; b++)
            bytes[l * 8 + b] = (uint8_t)(lanes[l] >> (8 * b));
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(bytes, (Py_ssize_t)map->lanes * 8,
                                          Py_ASNATIVEBYTES_LITTLE_ENDIAN |
                                              Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
#else
    return _PyLong_FromByteArray(bytes, (size_t)map->lanes * 8, 1, 0);
#endif
}

/* -- the mapping protocol ------------------------------------------------------------ */

/* The value of key (new reference), or NULL: with KeyError set when missing. */
static PyObject *lookup(WordMap *map, PyObject *key)
{
    WordKey k;
    if (wordmap_key(key, &k)) {
        Py_ssize_t slot = wordmap_find(map, k);
        if (slot >= 0)
            return lanes_value(map, map->slots + (size_t)slot * stride(map) + 1);
    }
    PyObject *found = map->extra == NULL ? NULL : PyDict_GetItemWithError(map->extra, key);
    if (found != NULL)
        return Py_NewRef(found);
    if (!PyErr_Occurred())
        PyErr_SetObject(PyExc_KeyError, key);
    return NULL;
}

/* Remove key; 1 if it was held, 0 if not, -1 on error. */
static int discard(WordMap *map, PyObject *key)
{
    WordKey k;
    if (wordmap_key(key, &k)) {
        Py_ssize_t slot = wordmap_find(map, k);
        if (slot >= 0) {
            wordmap_delete_at(map, slot);
            return 1;
        }
    }
    int held = wordmap_extra_holds(map, key);
    if (held > 0 && PyDict_DelItem(map->extra, key) < 0)
        return -1;
    return held;
}

static int store(WordMap *map, PyObject *key, PyObject *value)
{
    if (!PyLong_Check(value)) { /* ints only: the map then never holds a reference cycle */
        PyErr_Format(PyExc_TypeError, "WordMap values are ints, not %.100s",
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    WordKey k;
    uint64_t lanes[WORDMAP_MAX_LANES];
    if (wordmap_key(key, &k) && table_value(map, value, lanes)) {
        Py_ssize_t slot = wordmap_find(map, k);
        if (slot >= 0) {
            memcpy(map->slots + (size_t)slot * stride(map) + 1, lanes,
                   (size_t)map->lanes * sizeof(uint64_t));
            return 0;
        }
        if (map->extra != NULL && PyDict_GET_SIZE(map->extra) > 0 && discard(map, key) < 0)
            return -1;
        return wordmap_insert_new(map, k, lanes);
    }
    if (PyObject_Hash(key) == -1)
        return -1;
    if (discard(map, key) < 0)
        return -1;
    if (map->extra == NULL && (map->extra = PyDict_New()) == NULL)
        return -1;
    return PyDict_SetItem(map->extra, key, value);
}

static Py_ssize_t wm_length(PyObject *self)
{
    WordMap *map = (WordMap *)self;
    return map->used + (map->extra == NULL ? 0 : PyDict_GET_SIZE(map->extra));
}

static PyObject *wm_subscript(PyObject *self, PyObject *key) { return lookup((WordMap *)self, key); }

static int wm_ass_subscript(PyObject *self, PyObject *key, PyObject *value)
{
    WordMap *map = (WordMap *)self;
    if (value != NULL)
        return store(map, key, value);
    int held = discard(map, key);
    if (held == 0)
        PyErr_SetObject(PyExc_KeyError, key);
    return held > 0 ? 0 : -1;
}

static int wm_contains(PyObject *self, PyObject *key)
{
    WordMap *map = (WordMap *)self;
    WordKey k;
    if (wordmap_key(key, &k) && wordmap_find(map, k) >= 0)
        return 1;
    return wordmap_extra_holds(map, key);
}

static PyObject *wm_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    PyObject *found = lookup((WordMap *)self, args[0]);
    if (found != NULL || !PyErr_ExceptionMatches(PyExc_KeyError))
        return found;
    PyErr_Clear();
    return Py_NewRef(nargs == 2 ? args[1] : Py_None);
}

static PyObject *wm_pop(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    PyObject *found = lookup((WordMap *)self, args[0]);
    if (found == NULL) {
        if (nargs == 1 || !PyErr_ExceptionMatches(PyExc_KeyError))
            return NULL;
        PyErr_Clear();
        return Py_NewRef(args[1]);
    }
    if (discard((WordMap *)self, args[0]) < 0) {
        Py_DECREF(found);
        return NULL;
    }
    return found;
}

static void release(WordMap *map)
{
    PyMem_Free(map->ctrl);
    PyMem_Free(map->slots);
    map->ctrl = NULL;
    map->slots = NULL;
    map->mask = 0;
    map->used = map->filled = 0;
    Py_CLEAR(map->extra);
}

static PyObject *wm_clear(PyObject *self, PyObject *unused)
{
    (void)unused;
    release((WordMap *)self);
    Py_RETURN_NONE;
}

/* Every entry as a list: what 0 = keys, 1 = values, 2 = (key, value) tuples. */
static PyObject *listing(WordMap *map, int what)
{
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    size_t capacity = map->ctrl == NULL ? 0 : map->mask + 1;
    for (size_t i = 0; i < capacity; i++) {
        if (!(map->ctrl[i] & FULL))
            continue;
        const uint64_t *entry = map->slots + i * stride(map);
        PyObject *key = what == 1 ? NULL : key_object(entry[0], map->ctrl[i]);
        PyObject *value = what == 0 ? NULL : lanes_value(map, entry + 1);
        PyObject *item = what == 0 ? key : what == 1 ? value : PyTuple_Pack(2, key, value);
        if (what == 2) {
            Py_XDECREF(key);
            Py_XDECREF(value);
        }
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    if (map->extra != NULL) {
        PyObject *rest = what == 0   ? PyDict_Keys(map->extra)
                         : what == 1 ? PyDict_Values(map->extra)
                                     : PyDict_Items(map->extra);
        Py_ssize_t end = PyList_GET_SIZE(out);
        if (rest == NULL || PyList_SetSlice(out, end, end, rest) < 0) {
            Py_XDECREF(rest);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(rest);
    }
    return out;
}

static PyObject *wm_keys(PyObject *self, PyObject *unused)
{
    (void)unused;
    return listing((WordMap *)self, 0);
}

static PyObject *wm_values(PyObject *self, PyObject *unused)
{
    (void)unused;
    return listing((WordMap *)self, 1);
}

static PyObject *wm_items(PyObject *self, PyObject *unused)
{
    (void)unused;
    return listing((WordMap *)self, 2);
}

static PyObject *wm_iter(PyObject *self)
{
    PyObject *keys = listing((WordMap *)self, 0);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *wm_update(PyObject *self, PyObject *other)
{
    PyObject *items = PyMapping_Items(other);
    if (items == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "update() needs a mapping");
            Py_DECREF(items);
            return NULL;
        }
        if (store((WordMap *)self, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1)) < 0) {
            Py_DECREF(items);
            return NULL;
        }
    }
    Py_DECREF(items);
    Py_RETURN_NONE;
}

static int wm_init(PyObject *self, PyObject *args, PyObject *kwargs)
{
    WordMap *map = (WordMap *)self;
    int lanes;
    static char *names[] = {"lanes", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i", names, &lanes))
        return -1;
    if (lanes < 1 || lanes > WORDMAP_MAX_LANES) {
        PyErr_Format(PyExc_ValueError, "lanes must be 1 to %d", WORDMAP_MAX_LANES);
        return -1;
    }
    release(map);
    map->lanes = lanes;
    return 0;
}

static void wm_dealloc(PyObject *self)
{
    release((WordMap *)self);
    Py_TYPE(self)->tp_free(self);
}

static PyMethodDef wm_methods[] = {
    {"get", (PyCFunction)(void (*)(void))wm_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))wm_pop, METH_FASTCALL, "pop(key[, default])"},
    {"clear", wm_clear, METH_NOARGS, "Remove every entry."},
    {"keys", wm_keys, METH_NOARGS, "A list of the keys."},
    {"values", wm_values, METH_NOARGS, "A list of the values."},
    {"items", wm_items, METH_NOARGS, "A list of (key, value) pairs."},
    {"update", wm_update, METH_O, "Store every entry of a mapping."},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods wm_as_mapping = {wm_length, wm_subscript, wm_ass_subscript};
static PySequenceMethods wm_as_sequence = {.sq_contains = wm_contains};

PyTypeObject WordMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router.index._runs.WordMap",
    .tp_basicsize = sizeof(WordMap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "WordMap(lanes): a compact map of 64-bit ints to words of lanes 64-bit lanes "
              "(see router/index/_wordmap.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = wm_init,
    .tp_dealloc = wm_dealloc,
    .tp_as_mapping = &wm_as_mapping,
    .tp_as_sequence = &wm_as_sequence,
    .tp_iter = wm_iter,
    .tp_methods = wm_methods,
};
