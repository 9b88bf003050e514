/* The engine-hash bridge's bulk store in C: the hot path of router.index.runs.store_run.
 *
 * store_run(copies, keys, children, hashes, run_keys, tag, parent, tier, indexed) -> bool
 * does exactly what the pure-Python router.index.runs.store_run_py does to the bridge's
 * three maps (same words, same checks, same undo), minus the interpreter. On dicts the
 * words of router.ingest._native.words are built from their 64-bit lanes (wordmap_int) instead of
 * through shifts of Python ints; on WordMaps (the bridge's maps where this module is
 * built, _wordmap.h) their lanes are written straight into the tables, the run's slots
 * prefetched first. tests/native/test_native.py runs both on the same inputs.
 *
 * Invariant: on False the three dicts are as they were on entry. Whether an insert found
 * its item held is read from the dict's size, never from the identity of the value
 * returned (small ints are shared objects: a new word can be the very object held).
 */
#include "_wordmap.h"

#include <string.h>

#define NONE_KEY (UINT64_C(1) << 63)
/* The words' lanes (router.ingest._native.words): a copy's counts and key; a key's counts, tag with
 * the indexed bit on top, parent; a children entry's single child. */
#define COPY_LANES 2
#define KEY_LANES 3
#define CHILD_LANES 1
#define INDEXED_BIT NONE_KEY

/* Whether the three objects are the bridge's WordMaps, of the words' lanes. */
static int bridge_tables(PyObject *copies, PyObject *key_words, PyObject *children)
{
    return Py_IS_TYPE(copies, &WordMapType) && Py_IS_TYPE(key_words, &WordMapType) &&
           Py_IS_TYPE(children, &WordMapType) && ((WordMap *)copies)->lanes == COPY_LANES &&
           ((WordMap *)key_words)->lanes == KEY_LANES &&
           ((WordMap *)children)->lanes == CHILD_LANES;
}
/* A router key (int below 2**63); (uint64_t)-1 with an exception set if it is not one. */
static uint64_t key_value(PyObject *key)
{
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(key, &overflow); /* the fast one */
    if (value >= 0 && overflow == 0)
        return (uint64_t)value;
    if (value == -1 && PyErr_Occurred())
        return (uint64_t)-1;
    /* Out of range: OverflowError where no uint64 (as for a token id), else ValueError. */
    uint64_t bits = PyLong_AsUnsignedLongLong(key);
    if (bits == (uint64_t)-1 && PyErr_Occurred())
        return bits;
    PyErr_SetString(PyExc_ValueError, "router key out of the 63-bit range");
    return (uint64_t)-1;
}

/* Remove items[0..count) from dict (each was inserted by this call). */
static void undo(PyObject *dict, PyObject *const *items, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++)
        if (PyDict_DelItem(dict, items[i]) < 0)
            PyErr_Clear(); /* cannot happen: the item was just inserted */
}

/* Insert items[i] -> value(i) for every i < count unless an item is already present
 * (then undo and return 0); -1 on error (also undone). value(i) is a new reference: the
 * int of word's word_lanes lanes with lane `at` set to lanes[i], or (word NULL) values[i]. */
static int insert_all(PyObject *dict, PyObject *const *items, Py_ssize_t count, uint64_t *word,
                      int word_lanes, const uint64_t *lanes, int at, PyObject *const *values)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *value;
        if (word != NULL) {
            word[at] = lanes[i];
            value = wordmap_int(word, word_lanes);
        } else {
            value = Py_NewRef(values[i]);
        }
        Py_ssize_t size = PyDict_GET_SIZE(dict);
        PyObject *held = value == NULL ? NULL : PyDict_SetDefault(dict, items[i], value);
        /* Held before, or earlier in the run (not identity: small ints are shared). */
        int repeated = held != NULL && PyDict_GET_SIZE(dict) == size;
        Py_XDECREF(value); /* the dict holds it when it was inserted */
        if (held == NULL || repeated) {
            undo(dict, items, i);
            return held == NULL ? -1 : 0;
        }
    }
    return 1;
}

static void table_undo(WordMap *map, const WordKey *keys, Py_ssize_t count)
{
    for (Py_ssize_t j = 0; j < count; j++)
        wordmap_delete_at(map, wordmap_find(map, keys[j]));
}

/* Insert keys[i] -> lanes for i < count (lane `at` of `lanes` set to values[i]) unless a
 * key is held or repeats (then undo, 0); -1 on error (undone). The caller reserved room
 * for count inserts. */
static int table_insert_all(WordMap *map, PyObject *const *items, const WordKey *keys,
                            Py_ssize_t count, uint64_t *lanes, int at, const uint64_t *values)
{
    int extra = map->extra != NULL && PyDict_GET_SIZE(map->extra) > 0;
    Py_ssize_t i = 0;
    int held = 0;
    for (; i < count; i++) {
        /* A table key is in the side dict only with a value wider than the lanes. */
        held = extra ? wordmap_extra_holds(map, items[i]) : 0;
        if (held != 0)
            break;
        lanes[at] = values[i];
        if (!wordmap_insert_absent(map, keys[i], lanes)) {
            held = 1;
            break;
        }
    }
    if (i == count)
        return 1;
    table_undo(map, keys, i);
    return held < 0 ? -1 : 0;
}

/* store_run on WordMaps: 1 stored, 0 not the common case (an engine hash that is not a
 * 64-bit int never is: the caller folds such runs block by block), -1 on error.
 * copy_word, key_word: the words' lanes (the key and the parent set per block). */
static int store_in_tables(WordMap *copies, WordMap *key_words, WordMap *children,
                           PyObject *const *hash_items, PyObject *const *key_items,
                           const uint64_t *keys, const uint64_t *parents, Py_ssize_t n,
                           uint64_t *copy_word, uint64_t *key_word)
{
    WordKey *hashes = PyMem_Malloc((size_t)n * 2 * sizeof(WordKey));
    if (hashes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    WordKey *run_keys = hashes + n;
    int done = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        run_keys[i] = (WordKey){keys[i], 0};
        if (!wordmap_key(hash_items[i], &hashes[i]))
            done = 0;
    }
    if (done == 1 && (wordmap_reserve(copies, n) < 0 || wordmap_reserve(key_words, n) < 0 ||
                      wordmap_reserve(children, n) < 0))
        done = -1; /* before the prefetches: a rehash moves the slots */
    if (done == 1) {
        wordmap_prefetch(copies, hashes, n);
        wordmap_prefetch(key_words, run_keys, n);
        wordmap_prefetch(children, run_keys, n - 1);
    }
    if (done == 1)
        done = table_insert_all(copies, hash_items, hashes, n, copy_word, 1, keys);
    if (done == 1) {
        done = table_insert_all(key_words, key_items, run_keys, n, key_word, 2, parents);
        if (done == 1) {
            uint64_t child[1];
            done = table_insert_all(children, key_items, run_keys, n - 1, child, 0, keys + 1);
            if (done != 1)
                table_undo(key_words, run_keys, n);
        }
        if (done != 1)
            table_undo(copies, hashes, n);
    }
    PyMem_Free(hashes);
    return done;
}

static PyObject *store_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "store_run(copies, keys, children, hashes, run_keys, "
                                         "tag, parent, tier, indexed)");
        return NULL;
    }
    PyObject *copies = args[0], *key_words = args[1], *children = args[2];
    PyObject *hashes = args[3], *run_keys = args[4];
    int tables = bridge_tables(copies, key_words, children);
    int dicts = PyDict_CheckExact(copies) && PyDict_CheckExact(key_words) &&
                PyDict_CheckExact(children);
    if (!(tables || dicts) || !PyList_CheckExact(hashes) || !PyList_CheckExact(run_keys)) {
        PyErr_SetString(PyExc_TypeError, "store_run takes three dicts or the bridge's three "
                                         "WordMaps (2, 3 and 1 lanes), and two lists");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    if (n == 0 || PyList_GET_SIZE(run_keys) != n) {
        PyErr_SetString(PyExc_ValueError, "store_run needs as many keys as hashes, at least one");
        return NULL;
    }
    uint64_t tag = key_value(args[5]);
    if (tag == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    uint64_t parent = NONE_KEY;
    if (args[6] != Py_None) {
        parent = key_value(args[6]);
        if (parent == (uint64_t)-1 && PyErr_Occurred())
            return NULL;
    }
    long tier = PyLong_AsLong(args[7]);
    if (tier == -1 && PyErr_Occurred())
        return NULL;
    if (tier != 0 && tier != 32) {
        PyErr_SetString(PyExc_ValueError, "tier must be 0 (GPU) or 32 (CPU)");
        return NULL;
    }
    int indexed = PyObject_IsTrue(args[8]);
    if (indexed < 0)
        return NULL;

    PyObject *const *hash_items = &PyList_GET_ITEM(hashes, 0);
    PyObject *const *key_items = &PyList_GET_ITEM(run_keys, 0);
    /* Inserting detects what is held already (then undone): the common case, all new,
     * costs one probe per map and block. The last key is not inserted into children. */
    int held = PySequence_Contains(children, key_items[n - 1]);
    if (held < 0)
        return NULL;
    if (held > 0)
        Py_RETURN_FALSE;

    /* keys[i] and parents[i] (the key before it, or the run's parent) as uint64. */
    uint64_t *keys = PyMem_Malloc((size_t)n * 2 * sizeof(uint64_t));
    if (keys == NULL)
        return PyErr_NoMemory();
    uint64_t *parents = keys + n;
    for (Py_ssize_t i = 0; i < n; i++) {
        keys[i] = key_value(key_items[i]);
        if (keys[i] == (uint64_t)-1 && PyErr_Occurred()) {
            PyMem_Free(keys);
            return NULL;
        }
        parents[i] = i == 0 ? parent : keys[i - 1];
    }
    /* The words' lanes; the key (copy) and the parent (key word) are set per block. */
    uint64_t copy_word[COPY_LANES] = {UINT64_C(1) << tier, 0};
    uint64_t key_word[KEY_LANES] = {UINT64_C(1) << tier, tag | (indexed ? INDEXED_BIT : 0), 0};
    int done;
    if (tables) {
        done = store_in_tables((WordMap *)copies, (WordMap *)key_words, (WordMap *)children,
                               hash_items, key_items, keys, parents, n, copy_word, key_word);
        PyMem_Free(keys);
        return done < 0 ? NULL : PyBool_FromLong(done);
    }
    done = insert_all(copies, hash_items, n, copy_word, COPY_LANES, keys, 1, NULL);
    if (done == 1) {
        done = insert_all(key_words, key_items, n, key_word, KEY_LANES, parents, 2, NULL);
        if (done == 1) {
            done = insert_all(children, key_items, n - 1, NULL, 0, NULL, 0, key_items + 1);
            if (done != 1)
                undo(key_words, key_items, n);
        }
        if (done != 1)
            undo(copies, hash_items, n);
    }
    PyMem_Free(keys);
    if (done < 0)
        return NULL;
    if (done == 0)
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* Whether the run of removals can take hash h: its copy and its key's are the last ones,
 * on this tier; its key needs no cascade and its parent's link is a single child. On
 * yes, fills the slots to change and the note (tag, key, mask) when indexed. */
typedef struct {
    Py_ssize_t copy, key, link; /* slots; link -1: the parent's link stays */
    uint64_t tag, router_key;
    int indexed;
} Removal;

static int simple_removal(WordMap *copies, WordMap *key_words, WordMap *children, PyObject *h,
                          uint64_t one, Removal *out)
{
    WordKey hk;
    if (!wordmap_key(h, &hk) || (out->copy = wordmap_find(copies, hk)) < 0)
        return 0;
    const uint64_t *copy = copies->slots + (size_t)out->copy * wordmap_stride(copies) + 1;
    if (copy[1] >= NONE_KEY || copy[0] != one)
        return 0;
    WordKey key = {copy[1], 0};
    if ((out->key = wordmap_find(key_words, key)) < 0)
        return 0;
    const uint64_t *word = key_words->slots + (size_t)out->key * wordmap_stride(key_words) + 1;
    if (word[0] != one)
        return 0;
    out->tag = word[1] & ~INDEXED_BIT;
    out->router_key = key.bits;
    out->indexed = (word[1] & INDEXED_BIT) != 0;
    int extra = children->extra != NULL && PyDict_GET_SIZE(children->extra) > 0;
    if (out->indexed && (wordmap_find(children, key) >= 0 || extra))
        return 0; /* held children to unindex (or maybe, on a branch): the Python path */
    out->link = -1;
    if (word[2] != NONE_KEY) {
        WordKey parent = {word[2], 0};
        out->link = wordmap_find(children, parent);
        if (out->link < 0 && extra)
            return 0; /* the parent may have several children: the Python path */
        if (out->link >= 0) {
            const uint64_t *held = children->slots + (size_t)out->link * wordmap_stride(children);
            if (held[1] != key.bits)
                out->link = -1; /* another single child: the link stays */
        }
    }
    return 1;
}

static PyObject *remove_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "remove_run(copies, keys, children, hashes, start, tier)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[4]);
    long tier = PyLong_AsLong(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyList_CheckExact(args[3]) || start < 0 || (tier != 0 && tier != 32)) {
        PyErr_SetString(PyExc_ValueError, "remove_run: hashes a list, start >= 0, tier 0 or 32");
        return NULL;
    }
    PyObject *notes = PyList_New(0);
    if (notes == NULL)
        return NULL;
    Py_ssize_t i = start, n = PyList_GET_SIZE(args[3]);
    int tables = bridge_tables(args[0], args[1], args[2]);
    WordMap *copies = (WordMap *)args[0], *key_words = (WordMap *)args[1];
    WordMap *children = (WordMap *)args[2];
    uint64_t one = UINT64_C(1) << tier;
    Removal r;
    for (; tables && i < n; i++) {
        if (!simple_removal(copies, key_words, children, PyList_GET_ITEM(args[3], i), one, &r))
            break;
        wordmap_delete_at(copies, r.copy);
        wordmap_delete_at(key_words, r.key);
        if (r.link >= 0)
            wordmap_delete_at(children, r.link);
        if (!r.indexed)
            continue;
        PyObject *note[3] = {PyLong_FromUnsignedLongLong(r.tag),
                             PyLong_FromUnsignedLongLong(r.router_key),
                             PyLong_FromLong(tier == 0 ? 1 : 2)};
        int failed = note[0] == NULL || note[1] == NULL || note[2] == NULL;
        for (int j = 0; j < 3; j++) {
            if (!failed && PyList_Append(notes, note[j]) < 0)
                failed = 1;
            Py_XDECREF(note[j]);
        }
        if (failed) {
            Py_DECREF(notes);
            return NULL;
        }
    }
    PyObject *out = Py_BuildValue("(nN)", i, notes);
    return out;
}

static PyMethodDef methods[] = {
    {"store_run", (PyCFunction)(void (*)(void))store_run, METH_FASTCALL,
     "store_run(copies, keys, children, hashes, run_keys, tag, parent, tier, indexed) -> bool\n\n"
     "Store a run of new blocks in the bridge's maps (see router.ingest._native.runs)."},
    {"remove_run", (PyCFunction)(void (*)(void))remove_run, METH_FASTCALL,
     "remove_run(copies, keys, children, hashes, start, tier) -> (stop, notes)\n\n"
     "Remove hashes[start:stop], the simple removals (see router.ingest._native.runs)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "router.ingest._native._runs", "The bridge's bulk store in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__runs(void)
{
    if (PyType_Ready(&WordMapType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL && PyModule_AddObjectRef(module, "WordMap", (PyObject *)&WordMapType) < 0)
        Py_CLEAR(module);
    return module;
}
