/* WordMap (see _wordmap.h): the Python mapping protocol over the table of _wordmap.c. */
#include "_wordmap.h"

#include <string.h>

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


/* -- the mapping protocol ------------------------------------------------------------ */

/* The value of key (new reference), or NULL: with KeyError set when missing. */
static PyObject *lookup(WordMap *map, PyObject *key)
{
    WordKey k;
    if (wordmap_key(key, &k)) {
        Py_ssize_t slot = wordmap_find(map, k);
        if (slot >= 0)
            return wordmap_int(map->slots + (size_t)slot * wordmap_stride(map) + 1, map->lanes);
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
            memcpy(map->slots + (size_t)slot * wordmap_stride(map) + 1, lanes,
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

static PyObject *wm_subscript(PyObject *self, PyObject *key)
{
    return lookup((WordMap *)self, key);
}

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


static PyObject *wm_clear(PyObject *self, PyObject *unused)
{
    (void)unused;
    wordmap_release((WordMap *)self);
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
        if (!(map->ctrl[i] & WORDMAP_FULL))
            continue;
        const uint64_t *entry = map->slots + i * wordmap_stride(map);
        PyObject *key = what == 1 ? NULL : wordmap_key_object(entry[0], map->ctrl[i]);
        PyObject *value = what == 0 ? NULL : wordmap_int(entry + 1, map->lanes);
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
    wordmap_release(map);
    map->lanes = lanes;
    return 0;
}

static void wm_dealloc(PyObject *self)
{
    wordmap_release((WordMap *)self);
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
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router.ingest._native._runs.WordMap",
    .tp_basicsize = sizeof(WordMap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "WordMap(lanes): a compact map of 64-bit ints to words of lanes 64-bit lanes "
              "(see router/ingest/_native/_wordmap.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = wm_init,
    .tp_dealloc = wm_dealloc,
    .tp_as_mapping = &wm_as_mapping,
    .tp_as_sequence = &wm_as_sequence,
    .tp_iter = wm_iter,
    .tp_methods = wm_methods,
};
