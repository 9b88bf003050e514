/* Router block keys in C: the hot path of events.hashing.router_block_keys.
 *
 * block_keys(token_ids, block_size, parent) returns the same list as the pure-Python
 * events.hashing.router_block_keys: per full block, XXH3-64 of the block's token ids as
 * native-order uint32 bytes, seeded with the previous key, top bit cleared. Inputs of
 * 17-128 bytes (block sizes 5-32, the common ones) are hashed here, written from the
 * XXH3 specification; every other length calls xxhash.xxh3_64_intdigest, so the two
 * paths can never disagree on what is outside the short-input range. tests/test_native.py
 * checks this module against the Python package byte for byte. Token ids held in a buffer
 * of native uint32 (events._wire.TokenIds, array('I')) are hashed where they lie.
 *
 * Errors are those of the Python function: OverflowError for a token id outside uint32,
 * TypeError for a token id that is not an int.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h> /* included by Python.h from 3.11 on */
#endif
#include <stdint.h>
#include <string.h>

#if defined(__SIZEOF_INT128__) && defined(__BYTE_ORDER__) && \
    __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define KEYS_NATIVE_XXH3 1
#else
#define KEYS_NATIVE_XXH3 0
#endif

#define KEY_MASK ((UINT64_C(1) << 63) - 1)
/* A block's token bytes are hashed from this stack buffer when they fit. */
#define STACK_TOKENS 256

static PyObject *xxh3_intdigest; /* xxhash.xxh3_64_intdigest */

#if KEYS_NATIVE_XXH3
/* The first 128 bytes of the XXH3 default secret (all that inputs up to 128 bytes read). */
static const uint8_t SECRET[128] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
    0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3,
    0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc,
    0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
    0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65,
    0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
    0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9,
    0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
    0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
};

static inline uint64_t read64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline uint64_t fold128(uint64_t a, uint64_t b)
{
    unsigned __int128 product = (unsigned __int128)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *secret, uint64_t seed)
{
    uint64_t lo = read64(in) ^ (read64(secret) + seed);
    uint64_t hi = read64(in + 8) ^ (read64(secret + 8) - seed);
    return fold128(lo, hi);
}

/* XXH3-64 of 17..128 bytes with a seed: pairs of 16-byte lanes from both ends, folded
 * against the secret, then the final avalanche. */
static uint64_t xxh3_17to128(const uint8_t *in, size_t len, uint64_t seed)
{
    uint64_t acc = (uint64_t)len * UINT64_C(0x9E3779B185EBCA87);
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += mix16(in + 48, SECRET + 96, seed);
                acc += mix16(in + len - 64, SECRET + 112, seed);
            }
            acc += mix16(in + 32, SECRET + 64, seed);
            acc += mix16(in + len - 48, SECRET + 80, seed);
        }
        acc += mix16(in + 16, SECRET + 32, seed);
        acc += mix16(in + len - 32, SECRET + 48, seed);
    }
    acc += mix16(in, SECRET, seed);
    acc += mix16(in + len - 16, SECRET + 16, seed);
    acc ^= acc >> 37;
    acc *= UINT64_C(0x165667919E3779F9);
    return acc ^ (acc >> 32);
}
#endif

/* XXH3-64 of a buffer through the Python package; -1 with an exception set on failure
 * (a valid digest is returned as the top-bit-cleared key, so -1 never collides). */
static int64_t xxh3_python(const uint8_t *in, size_t len, uint64_t seed)
{
    PyObject *data = PyBytes_FromStringAndSize((const char *)in, (Py_ssize_t)len);
    PyObject *seed_obj = PyLong_FromUnsignedLongLong(seed);
    PyObject *digest = NULL;
    if (data != NULL && seed_obj != NULL) {
        PyObject *args[2] = {data, seed_obj};
        digest = PyObject_Vectorcall(xxh3_intdigest, args, 2, NULL);
    }
    Py_XDECREF(data);
    Py_XDECREF(seed_obj);
    if (digest == NULL)
        return -1;
    uint64_t value = PyLong_AsUnsignedLongLong(digest);
    Py_DECREF(digest);
    if (value == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    return (int64_t)(value & KEY_MASK);
}

/* Whether item is an int of one internal digit (below 2**30 at least, as token ids
 * are), its value in *out: read without a call. */
static inline int one_digit(PyObject *item, uint32_t *out)
{
    if (!PyLong_CheckExact(item))
        return 0;
#if PY_VERSION_HEX >= 0x030C0000
    PyLongObject *v = (PyLongObject *)item;
    if (!PyUnstable_Long_IsCompact(v) || PyUnstable_Long_CompactValue(v) < 0)
        return 0;
    *out = (uint32_t)PyUnstable_Long_CompactValue(v);
#else
    if (Py_SIZE(item) != 1)
        return 0;
    *out = (uint32_t)((PyLongObject *)item)->ob_digit[0];
#endif
    return 1;
}

/* Token ids as uint32; 0 on success, -1 with the Python function's exception. */
static int read_tokens(PyObject *const *items, Py_ssize_t count, uint32_t *out)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = items[i];
        if (one_digit(item, &out[i]))
            continue;
        if (!PyLong_Check(item)) {
            PyErr_Format(PyExc_TypeError, "token id must be int, not %.100s",
                         Py_TYPE(item)->tp_name);
            return -1;
        }
        unsigned long long value = PyLong_AsUnsignedLongLong(item);
        if (value == (unsigned long long)-1 && PyErr_Occurred())
            return -1; /* negative or above 64 bits: OverflowError */
        if (value > UINT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "token id does not fit in 32 bits");
            return -1;
        }
        out[i] = (uint32_t)value;
    }
    return 0;
}

/* The key of the block whose token ids are at bytes (nbytes long), chained from *prev;
 * 0, or -1 with an exception set. */
static int chain_block(const uint8_t *bytes, size_t nbytes, uint64_t *prev)
{
#if KEYS_NATIVE_XXH3
    if (nbytes > 16 && nbytes <= 128) {
        *prev = xxh3_17to128(bytes, nbytes, *prev) & KEY_MASK;
        return 0;
    }
#endif
    int64_t digest = xxh3_python(bytes, nbytes, *prev);
    if (digest < 0)
        return -1;
    *prev = (uint64_t)digest;
    return 0;
}

/* Whether view holds native uint32s, C-contiguous (events._wire.TokenIds, array('I')):
 * hashed where they lie, with no int to read. */
static int is_uint32_buffer(const Py_buffer *view)
{
    return view->itemsize == 4 && view->ndim == 1 && view->format != NULL &&
           strcmp(view->format, "I") == 0;
}

static PyObject *block_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "block_keys(token_ids, block_size, parent)");
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    if (block_size == -1 && PyErr_Occurred())
        return NULL;
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    uint64_t prev = PyLong_AsUnsignedLongLong(args[2]);
    if (prev == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer view = {.obj = NULL};
    PyObject *seq = NULL;
    Py_ssize_t num_tokens;
    if (!PyList_CheckExact(args[0]) && PyObject_CheckBuffer(args[0]) &&
        PyObject_GetBuffer(args[0], &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0 &&
        is_uint32_buffer(&view)) {
        num_tokens = view.len / 4;
    } else {
        if (view.obj != NULL)
            PyBuffer_Release(&view);
        PyErr_Clear(); /* a buffer of another layout: read it as a sequence */
        seq = PySequence_Fast(args[0], "token_ids must be a sequence");
        if (seq == NULL)
            return NULL;
        num_tokens = PySequence_Fast_GET_SIZE(seq);
    }
    Py_ssize_t num_blocks = num_tokens / block_size;
    PyObject *keys = PyList_New(num_blocks);
    uint32_t stack[STACK_TOKENS];
    uint32_t *tokens = stack;
    if (keys != NULL && seq != NULL && block_size > STACK_TOKENS) {
        tokens = PyMem_Malloc((size_t)block_size * sizeof(uint32_t));
        if (tokens == NULL)
            PyErr_NoMemory();
    }
    if (keys == NULL || tokens == NULL)
        goto fail;
    size_t nbytes = (size_t)block_size * sizeof(uint32_t);
    for (Py_ssize_t b = 0; b < num_blocks; b++) {
        const uint8_t *bytes;
        if (seq == NULL) {
            bytes = (const uint8_t *)view.buf + (size_t)b * nbytes;
        } else {
            if (read_tokens(PySequence_Fast_ITEMS(seq) + b * block_size, block_size,
                            tokens) < 0)
                goto fail;
            bytes = (const uint8_t *)tokens;
        }
        if (chain_block(bytes, nbytes, &prev) < 0)
            goto fail;
        PyObject *key = PyLong_FromUnsignedLongLong(prev);
        if (key == NULL)
            goto fail;
        PyList_SET_ITEM(keys, b, key);
    }
    if (tokens != stack)
        PyMem_Free(tokens);
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    Py_XDECREF(seq);
    return keys;
fail:
    if (tokens != stack && tokens != NULL)
        PyMem_Free(tokens);
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    Py_XDECREF(keys);
    Py_XDECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"block_keys", (PyCFunction)(void (*)(void))block_keys, METH_FASTCALL,
     "block_keys(token_ids, block_size, parent) -> list[int]\n\n"
     "Router keys of every full block, chained from parent (see "
     "events.hashing.router_block_keys)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "events._keys", "Router block keys in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__keys(void)
{
    PyObject *xxhash = PyImport_ImportModule("xxhash");
    if (xxhash == NULL)
        return NULL;
    xxh3_intdigest = PyObject_GetAttrString(xxhash, "xxh3_64_intdigest");
    Py_DECREF(xxhash);
    if (xxh3_intdigest == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
