/* RESP command packing in C for the index's writes: bytes, str and 64-bit ints.
 *
 * pack_command(args) returns the same bytes as hiredis.pack_command(args) when every
 * argument is exactly bytes, str or an int that fits in 64 signed bits (or a PackedArgs
 * of pack_args, spliced in as the ints it holds), and None otherwise (the caller then
 * packs with hiredis). hiredis formats an int through its
 * str(), about 0.35 µs per argument; an index write carries one int per router key, so
 * that was most of the client's packing time. tests/native/test_native.py compares the
 * two on random commands.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static Py_ssize_t digits(unsigned long long m)
{
    Py_ssize_t n = 1;
    for (unsigned long long bound = 10; n < 20 && m >= bound; bound *= 10)
        n++;
    return n;
}

static unsigned long long magnitude(long long v)
{
    return v < 0 ? (unsigned long long)0 - (unsigned long long)v : (unsigned long long)v;
}

static Py_ssize_t int_len(long long v) { return (v < 0) + digits(magnitude(v)); }

/* "00" "01" ... "99": two digits per division (filled at import). */
static char digit_pairs[200];

/* Writes the decimal of v, len == int_len(v) characters, at out; returns the position
 * after it. */
static char *put_int(char *out, long long v, Py_ssize_t len)
{
    char *end = out + len;
    char *p = end;
    unsigned long long m = magnitude(v);
    for (; m >= 100; m /= 100) {
        p -= 2;
        memcpy(p, digit_pairs + 2 * (m % 100), 2);
    }
    if (m >= 10) {
        p -= 2;
        memcpy(p, digit_pairs + 2 * m, 2);
    } else {
        *--p = (char)('0' + m);
    }
    if (v < 0)
        *--p = '-';
    return end;
}

/* "<prefix><len>\r\n" */
static char *put_header(char *out, char prefix, Py_ssize_t len)
{
    *out++ = prefix;
    out = put_int(out, len, int_len(len));
    *out++ = '\r';
    *out++ = '\n';
    return out;
}

static Py_ssize_t header_len(Py_ssize_t len) { return 3 + int_len(len); }

/* One argument's payload: its bytes (*data, *len) or, for an int, *data NULL and *value.
 * 0 when the argument is of another kind (the command is declined). */
static int payload(PyObject *item, const char **data, Py_ssize_t *len, long long *value)
{
    if (PyBytes_CheckExact(item)) {
        *data = PyBytes_AS_STRING(item);
        *len = PyBytes_GET_SIZE(item);
        return 1;
    }
    if (PyUnicode_CheckExact(item)) {
        *data = PyUnicode_AsUTF8AndSize(item, len);
        if (*data == NULL) { /* lone surrogates: hiredis reports them */
            PyErr_Clear();
            return 0;
        }
        return 1;
    }
    if (PyLong_CheckExact(item)) {
        int overflow = 0;
        *value = PyLong_AsLongLongAndOverflow(item, &overflow);
        *data = NULL;
        *len = int_len(*value);
        return !overflow;
    }
    return 0;
}

/* PackedArgs: int arguments already in RESP, made by pack_args; pack_command splices one
 * in as len() arguments. An index write carries its router keys so: one object instead
 * of thousands of ints in the argument list and the tuples redis-py copies it into,
 * which the garbage collector would walk whenever it ran during the write. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t count;
    PyObject *data; /* bytes */
} PackedArgs;

static void packed_dealloc(PackedArgs *self)
{
    Py_XDECREF(self->data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t packed_len(PackedArgs *self) { return self->count; }

static PySequenceMethods packed_as_sequence = {.sq_length = (lenfunc)packed_len};

static PyTypeObject PackedArgsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router.store._resp.PackedArgs",
    .tp_basicsize = sizeof(PackedArgs),
    .tp_dealloc = (destructor)packed_dealloc,
    .tp_as_sequence = &packed_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_doc = "Int arguments packed by pack_args: pack_command sends them as len() arguments.",
};

/* Sizes items[0..n): the arguments they make (*nargs) and the RESP bytes (*total, headers
 * of each argument included, not the command's); ints' values go to values[i]. 0 when an
 * item is of another kind. */
static int measure(PyObject *const *items, Py_ssize_t n, long long *values, Py_ssize_t *nargs,
                   Py_ssize_t *total)
{
    const char *data;
    Py_ssize_t len;
    *nargs = *total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_IS_TYPE(items[i], &PackedArgsType)) {
            PackedArgs *packed = (PackedArgs *)items[i];
            *nargs += packed->count;
            *total += PyBytes_GET_SIZE(packed->data);
            continue;
        }
        if (!payload(items[i], &data, &len, &values[i]))
            return 0;
        *nargs += 1;
        *total += header_len(len) + len + 2;
    }
    return 1;
}

/* Writes the arguments items[0..n) (measured: values read) at p; returns the end. */
static char *put_items(char *p, PyObject *const *items, Py_ssize_t n, const long long *values)
{
    const char *data;
    Py_ssize_t len;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (Py_IS_TYPE(item, &PackedArgsType)) {
            PyObject *bytes = ((PackedArgs *)item)->data;
            memcpy(p, PyBytes_AS_STRING(bytes), (size_t)PyBytes_GET_SIZE(bytes));
            p += PyBytes_GET_SIZE(bytes);
            continue;
        }
        if (PyLong_CheckExact(item)) {
            len = int_len(values[i]);
            p = put_header(p, '$', len);
            p = put_int(p, values[i], len);
        } else {
            long long unused;
            payload(item, &data, &len, &unused);
            p = put_header(p, '$', len);
            memcpy(p, data, (size_t)len);
            p += len;
        }
        *p++ = '\r';
        *p++ = '\n';
    }
    return p;
}

/* The bytes of items[0..n), with the command's "*<nargs>" header when command is set;
 * Py_None when an item is of another kind (NULL with an exception on failure). */
static PyObject *pack(PyObject *const *items, Py_ssize_t n, int command)
{
    long long *values = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(long long));
    if (values == NULL)
        return PyErr_NoMemory();
    Py_ssize_t nargs, total;
    if (!measure(items, n, values, &nargs, &total)) {
        PyMem_Free(values);
        Py_RETURN_NONE;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total + (command ? header_len(nargs) : 0));
    if (out != NULL) {
        char *p = PyBytes_AS_STRING(out);
        if (command)
            p = put_header(p, '*', nargs);
        put_items(p, items, n, values);
    }
    PyMem_Free(values);
    return out;
}

static PyObject *pack_command(PyObject *module, PyObject *args)
{
    (void)module;
    if (!PyTuple_Check(args)) {
        PyErr_SetString(PyExc_TypeError, "pack_command takes a tuple");
        return NULL;
    }
    return pack(&PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args), 1);
}

static PyObject *pack_args(PyObject *module, PyObject *ints)
{
    (void)module;
    if (!PyList_CheckExact(ints)) {
        PyErr_SetString(PyExc_TypeError, "pack_args takes a list of ints");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ints);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(PyList_GET_ITEM(ints, i))) {
            PyErr_SetString(PyExc_TypeError, "pack_args takes a list of ints");
            return NULL;
        }
    }
    PyObject *data = pack(&PyList_GET_ITEM(ints, 0), n, 0);
    if (data == Py_None) {
        Py_DECREF(data);
        PyErr_SetString(PyExc_OverflowError, "pack_args takes ints that fit in 64 signed bits");
        return NULL;
    }
    if (data == NULL)
        return NULL;
    PackedArgs *out = PyObject_New(PackedArgs, &PackedArgsType);
    if (out == NULL) {
        Py_DECREF(data);
        return NULL;
    }
    out->count = n;
    out->data = data;
    return (PyObject *)out;
}

/* fixed_decimals(ints) -> bytes | None: each int of a list right-aligned in 20 characters
 * (Python's b"%20d" of each, joined), or None when the argument is not a list of ints
 * that fit in 64 signed bits (the caller then formats in Python). The index lookup's key
 * argument: ~0.1 ms for 512 keys by Python's formatting, a few µs here. */
static PyObject *fixed_decimals(PyObject *module, PyObject *ints)
{
    (void)module;
    if (!PyList_CheckExact(ints))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(ints);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 20 * n);
    if (out == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(ints, i);
        int overflow = 0;
        long long v = PyLong_CheckExact(item) ? PyLong_AsLongLongAndOverflow(item, &overflow) : 0;
        if (!PyLong_CheckExact(item) || overflow || (v == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        Py_ssize_t len = int_len(v); /* at most 20: "-9223372036854775808" */
        memset(p, ' ', (size_t)(20 - len));
        p = put_int(p + 20 - len, v, len);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"pack_command", pack_command, METH_O,
     "pack_command(args: tuple) -> bytes | None\n\n"
     "One RESP command, or None when an argument is not bytes, str, a 64-bit int or\n"
     "PackedArgs."},
    {"pack_args", pack_args, METH_O,
     "pack_args(ints: list[int]) -> PackedArgs\n\n"
     "The ints as RESP arguments, which pack_command sends as len(result) arguments."},
    {"fixed_decimals", fixed_decimals, METH_O,
     "fixed_decimals(ints: list[int]) -> bytes | None\n\n"
     "Each int right-aligned in 20 characters, or None when not a list of 64-bit ints."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "router.store._resp", "RESP command packing in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__resp(void)
{
    for (int i = 0; i < 100; i++) {
        digit_pairs[2 * i] = (char)('0' + i / 10);
        digit_pairs[2 * i + 1] = (char)('0' + i % 10);
    }
    if (PyType_Ready(&PackedArgsType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL &&
        PyModule_AddObjectRef(module, "PackedArgs", (PyObject *)&PackedArgsType) < 0)
        Py_CLEAR(module);
    return module;
}
