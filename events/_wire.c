/* Event batches decoded in C: the fast path of events.schema.decode_batch.
 *
 * decode(payload) reads a msgpack KVEventBatch straight from its bytes and returns the
 * batch msgspec's typed decoder (events.schema's spec) would return, with one difference:
 * each BlockStored's token_ids is a TokenIds, the token ids packed as native uint32 (no
 * Python int per token; events._keys hashes them from the buffer). It returns None for
 * anything outside the shape vLLM >= 0.33 and kvroute send (an array batch of float ts,
 * map events with "type" first, known fields once each with their declared types, token
 * ids within uint32, no ext values outside Any fields): the caller then runs the Python
 * decoder, so what that path accepts, rejects or counts is unchanged. Fields typed Any
 * (extra_keys' entries, locality, ownership, session_id) are handed, as their exact byte
 * span, to the msgspec decoder given to bind(). Invariant: decode(p) is None or equals
 * the typed decoder's result for p; it never accepts bytes the typed decoder rejects.
 * tests/native/test_wire.py checks that over random and mutated batches.
 */
#include "_wire.h"

#include <string.h>

/* What bind() was given. */
static PyObject *batch_type, *stored_type, *removed_type, *cleared_type, *any_decode;

/* Fields of BlockStored in declaration order; BlockRemoved's are a subset. */
enum {
    F_BLOCK_HASHES,
    F_PARENT_BLOCK_HASH,
    F_TOKEN_IDS,
    F_BLOCK_SIZE,
    F_LORA_ID,
    F_MEDIUM,
    F_LORA_NAME,
    F_EXTRA_KEYS,
    F_GROUP_IDX,
    F_KV_CACHE_SPEC_KIND,
    F_KV_CACHE_SPEC_SLIDING_WINDOW,
    F_LOCALITY,
    F_OWNERSHIP,
    F_SESSION_ID,
    F_LOOKAHEAD_TOKEN_IDS,
    NUM_FIELDS,
};

static const char *const FIELD_NAMES[NUM_FIELDS] = {
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    "lookahead_token_ids",
};

/* The declared type of each field, as this decoder reads it. */
typedef enum {
    T_HASHES,       /* list[int | bytes] */
    T_HASH_OR_NIL,  /* int | bytes | None */
    T_TOKENS,       /* list[int] read as TokenIds */
    T_INT,          /* int */
    T_INT_OR_NIL,   /* int | None */
    T_STR_OR_NIL,   /* str | None */
    T_ANY_LIST,     /* list[Any] | None */
    T_ANY,          /* Any (nil read here, the rest by msgspec) */
    T_INTS_OR_NIL,  /* list[int] | None */
} FieldType;

static const FieldType FIELD_TYPES[NUM_FIELDS] = {
    T_HASHES,     T_HASH_OR_NIL, T_TOKENS, T_INT,        T_INT_OR_NIL,
    T_STR_OR_NIL, T_STR_OR_NIL,  T_ANY_LIST, T_INT_OR_NIL, T_STR_OR_NIL,
    T_INT_OR_NIL, T_ANY,         T_ANY,    T_ANY,        T_INTS_OR_NIL,
};

/* Each event type: its tag, the fields it has (in order) and those without a default. */
typedef struct {
    const char *tag;
    PyObject **type;
    int num_fields;
    const int *fields;
    int num_required;
} EventKind;

static const int STORED_FIELDS[] = {
    F_BLOCK_HASHES, F_PARENT_BLOCK_HASH, F_TOKEN_IDS, F_BLOCK_SIZE, F_LORA_ID,
    F_MEDIUM, F_LORA_NAME, F_EXTRA_KEYS, F_GROUP_IDX, F_KV_CACHE_SPEC_KIND,
    F_KV_CACHE_SPEC_SLIDING_WINDOW, F_LOCALITY, F_OWNERSHIP, F_SESSION_ID,
    F_LOOKAHEAD_TOKEN_IDS,
};
static const int REMOVED_FIELDS[] = {F_BLOCK_HASHES, F_MEDIUM, F_GROUP_IDX, F_LOCALITY,
                                     F_OWNERSHIP};

static const EventKind KINDS[] = {
    {"BlockStored", &stored_type, 15, STORED_FIELDS, 7},
    {"BlockRemoved", &removed_type, 5, REMOVED_FIELDS, 2},
    {"AllBlocksCleared", &cleared_type, 0, NULL, 0},
};
#define NUM_KINDS ((int)(sizeof KINDS / sizeof KINDS[0]))

static int equals(const uint8_t *data, Py_ssize_t size, const char *name)
{
    return (size_t)size == strlen(name) && memcmp(data, name, (size_t)size) == 0;
}

static int read_int_object(Reader *r, PyObject **out)
{
    uint64_t value;
    int negative;
    if (read_int(r, &value, &negative) != OK)
        return DECLINE;
    *out = int_object(value, negative);
    return *out == NULL ? FAIL : OK;
}

static int read_hash(Reader *r, PyObject **out)
{
    if (need(r, 1) && *r->p >= 0xc4 && *r->p <= 0xc6) {
        const uint8_t *data;
        Py_ssize_t size;
        if (read_raw(r, 0, &data, &size) != OK)
            return DECLINE;
        *out = PyBytes_FromStringAndSize((const char *)data, size);
        return *out == NULL ? FAIL : OK;
    }
    return read_int_object(r, out);
}

/* An array whose items read_item reads, as a list. */
static int read_list(Reader *r, int (*read_item)(Reader *, PyObject **), PyObject **out)
{
    Py_ssize_t count;
    if (read_array(r, &count) != OK)
        return DECLINE;
    PyObject *list = PyList_New(count);
    if (list == NULL)
        return FAIL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item;
        int status = read_item(r, &item);
        if (status != OK) {
            Py_DECREF(list);
            return status;
        }
        PyList_SET_ITEM(list, i, item);
    }
    *out = list;
    return OK;
}

static int read_tokens(Reader *r, PyObject **out)
{
    Py_ssize_t count;
    if (read_array(r, &count) != OK)
        return DECLINE;
    TokenIds *tokens = tokens_new_empty(count);
    if (tokens == NULL)
        return FAIL;
    /* The widths token ids come in are read here, through a local cursor (perf: a call
     * per token, or the cursor kept in memory, was most of a 32-block batch's decode);
     * any other int goes through read_int. */
    const uint8_t *p = r->p;
    const uint8_t *end = r->end;
    for (Py_ssize_t i = 0; i < count; i++) {
        size_t left = (size_t)(end - p);
        if (left >= 1 && p[0] <= 0x7f) {
            tokens->ids[i] = p[0];
            p += 1;
        } else if (left >= 3 && p[0] == 0xcd) {
            tokens->ids[i] = (uint32_t)p[1] << 8 | p[2];
            p += 3;
        } else if (left >= 5 && p[0] == 0xce) {
            tokens->ids[i] = (uint32_t)p[1] << 24 | (uint32_t)p[2] << 16 |
                             (uint32_t)p[3] << 8 | p[4];
            p += 5;
        } else {
            uint64_t value;
            int negative;
            r->p = p;
            /* A token id outside uint32 stays a Python int (the Python path): the
             * bridge counts the event malformed. */
            if (read_int(r, &value, &negative) != OK || negative || value > UINT32_MAX) {
                Py_DECREF(tokens);
                return DECLINE;
            }
            tokens->ids[i] = (uint32_t)value;
            p = r->p;
        }
    }
    r->p = p;
    *out = (PyObject *)tokens;
    return OK;
}

/* A value of an Any field: its bytes decoded by msgspec's own decoder. */
static int read_any(Reader *r, PyObject **out)
{
    const uint8_t *start = r->p;
    int status = skip(r, 0);
    if (status != OK)
        return status;
    PyObject *span = PyMemoryView_FromMemory((char *)start, r->p - start, PyBUF_READ);
    if (span == NULL)
        return FAIL;
    *out = PyObject_CallOneArg(any_decode, span);
    Py_DECREF(span);
    if (*out != NULL)
        return OK;
    PyErr_Clear(); /* msgspec said no: the Python path will say how */
    return DECLINE;
}

static int read_field(Reader *r, FieldType type, PyObject **out)
{
    switch (type) {
    case T_HASHES:
        return read_list(r, read_hash, out);
    case T_TOKENS:
        return read_tokens(r, out);
    case T_INT:
        return read_int_object(r, out);
    default:
        break;
    }
    if (is_nil(r)) {
        *out = Py_NewRef(Py_None);
        return OK;
    }
    switch (type) {
    case T_HASH_OR_NIL:
        return read_hash(r, out);
    case T_INT_OR_NIL:
        return read_int_object(r, out);
    case T_STR_OR_NIL:
        return read_str(r, out);
    case T_INTS_OR_NIL:
        return read_list(r, read_int_object, out);
    case T_ANY:
        return read_any(r, out);
    case T_ANY_LIST:
        return at_array(r) ? read_any(r, out) : DECLINE;
    default:
        return DECLINE;
    }
}

/* One event: a map whose first key is "type" naming a known kind. */
static int read_event(Reader *r, PyObject **out)
{
    Py_ssize_t num_keys;
    const uint8_t *data;
    Py_ssize_t size;
    if (read_map(r, &num_keys) != OK || num_keys < 1)
        return DECLINE;
    if (read_raw(r, 1, &data, &size) != OK || !equals(data, size, "type") ||
        read_raw(r, 1, &data, &size) != OK)
        return DECLINE;
    const EventKind *kind = NULL;
    for (int k = 0; k < NUM_KINDS; k++) {
        if (equals(data, size, KINDS[k].tag))
            kind = &KINDS[k];
    }
    if (kind == NULL)
        return DECLINE;
    PyObject *values[NUM_FIELDS] = {NULL};
    int status = OK;
    int num_required = 0;
    for (Py_ssize_t i = 1; i < num_keys && status == OK; i++) {
        if (read_raw(r, 1, &data, &size) != OK) {
            status = DECLINE;
            break;
        }
        int slot = -1;
        for (int f = 0; f < kind->num_fields; f++) {
            if (equals(data, size, FIELD_NAMES[kind->fields[f]])) {
                slot = f;
                break;
            }
        }
        if (slot < 0) {
            /* An unknown key (a newer field) is skipped, as msgspec does; "type" twice
             * is left to the Python path. */
            status = equals(data, size, "type") ? DECLINE : utf8_ok(data, size);
            if (status == OK)
                status = skip(r, 1);
            continue;
        }
        if (values[slot] != NULL) { /* a key twice */
            status = DECLINE;
            break;
        }
        status = read_field(r, FIELD_TYPES[kind->fields[slot]], &values[slot]);
        num_required += status == OK && slot < kind->num_required;
    }
    if (status == OK && num_required < kind->num_required)
        status = DECLINE;
    if (status == OK) {
        for (int f = kind->num_required; f < kind->num_fields; f++) {
            if (values[f] == NULL)
                values[f] = Py_NewRef(Py_None);
        }
        *out = PyObject_Vectorcall(*kind->type, values, (size_t)kind->num_fields, NULL);
        if (*out == NULL)
            status = FAIL;
    }
    for (int f = 0; f < kind->num_fields; f++)
        Py_XDECREF(values[f]);
    return status;
}

static int read_batch(Reader *r, PyObject **out)
{
    Py_ssize_t length, num_events;
    uint64_t bits;
    double ts;
    if (read_array(r, &length) != OK || length < 2 || length > 3 || !need(r, 1))
        return DECLINE;
    if (*r->p == 0xcb) {
        r->p++;
        if (read_be(r, 8, &bits) != OK)
            return DECLINE;
        memcpy(&ts, &bits, sizeof ts);
    } else if (*r->p == 0xca) {
        float narrow;
        uint32_t narrow_bits;
        r->p++;
        if (read_be(r, 4, &bits) != OK)
            return DECLINE;
        narrow_bits = (uint32_t)bits;
        memcpy(&narrow, &narrow_bits, sizeof narrow);
        ts = narrow;
    } else {
        return DECLINE;
    }
    if (read_array(r, &num_events) != OK)
        return DECLINE;
    PyObject *items[3] = {NULL, PyList_New(num_events), NULL};
    int status = items[1] == NULL ? FAIL : OK;
    for (Py_ssize_t i = 0; i < num_events && status == OK; i++) {
        PyObject *event = NULL;
        status = read_event(r, &event);
        if (status == OK)
            PyList_SET_ITEM(items[1], i, event);
    }
    if (status == OK)
        status = length == 3 ? read_field(r, T_INT_OR_NIL, &items[2]) : OK;
    if (status == OK && r->p != r->end)
        status = DECLINE; /* trailing bytes */
    if (status == OK && (items[0] = PyFloat_FromDouble(ts)) == NULL)
        status = FAIL;
    if (status == OK) {
        *out = PyObject_Vectorcall(batch_type, items, length, NULL);
        if (*out == NULL)
            status = FAIL;
    }
    for (int i = 0; i < 3; i++)
        Py_XDECREF(items[i]);
    return status;
}

static PyObject *decode(PyObject *module, PyObject *payload)
{
    (void)module;
    if (batch_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "events._wire.bind() was not called");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Reader reader = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len};
    PyObject *batch = NULL;
    int status = read_batch(&reader, &batch);
    PyBuffer_Release(&view);
    if (status == FAIL)
        return NULL;
    if (status == DECLINE)
        Py_RETURN_NONE;
    return batch;
}

/* bind(batch_type, stored_type, removed_type, cleared_type, any_decode): the classes
 * decode() builds (their fields must be the ones this file reads, in order) and the
 * decoder of Any values. */
static PyObject *bind(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "bind(batch_type, stored_type, removed_type, cleared_type, any_decode)");
        return NULL;
    }
    for (int k = 0; k < NUM_KINDS; k++) {
        PyObject *fields = PyObject_GetAttrString(args[k + 1], "__struct_fields__");
        if (fields == NULL)
            return NULL;
        int same = PyTuple_Check(fields) && PyTuple_GET_SIZE(fields) == KINDS[k].num_fields;
        for (int f = 0; same && f < KINDS[k].num_fields; f++) {
            PyObject *name = PyTuple_GET_ITEM(fields, f);
            same = PyUnicode_Check(name) &&
                   PyUnicode_CompareWithASCIIString(name, FIELD_NAMES[KINDS[k].fields[f]]) == 0;
        }
        Py_DECREF(fields);
        if (!same) {
            PyErr_Format(PyExc_TypeError, "%s's fields are not the ones events._wire reads",
                         KINDS[k].tag);
            return NULL;
        }
    }
    PyObject **slots[5] = {&batch_type, &stored_type, &removed_type, &cleared_type,
                           &any_decode};
    for (int i = 0; i < 5; i++)
        Py_XSETREF(*slots[i], Py_NewRef(args[i]));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_O,
     "decode(payload) -> KVEventBatch | None\n\n"
     "The batch, with token ids as TokenIds, or None when the payload is not in the "
     "shape this decoder reads (then decode it in Python)."},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(batch_type, stored_type, removed_type, cleared_type, any_decode)\n\n"
     "The classes decode() builds and the decoder of fields typed Any."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "events._wire", "Event batches decoded in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__wire(void)
{
    if (PyType_Ready(&TokenIdsType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "TokenIds", (PyObject *)&TokenIdsType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
