/* RESP command packing in C for the index's writes: bytes, str and 64-bit ints.
 *
 * pack_command(args) returns the same bytes as hiredis.pack_command(args) when every
 * argument is exactly bytes, str or an int that fits in 64 signed bits, and None
 * otherwise (the caller then packs with hiredis). hiredis formats an int through its
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

static PyObject *pack_command(PyObject *module, PyObject *args)
{
    (void)module;
    if (!PyTuple_Check(args)) {
        PyErr_SetString(PyExc_TypeError, "pack_command takes a tuple");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    /* The ints' values, read once (an index write is mostly ints). */
    long long *values = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(long long));
    if (values == NULL)
        return PyErr_NoMemory();
    const char *data;
    Py_ssize_t len;
    Py_ssize_t total = header_len(n);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!payload(PyTuple_GET_ITEM(args, i), &data, &len, &values[i])) {
            PyMem_Free(values);
            Py_RETURN_NONE;
        }
        total += header_len(len) + len + 2;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) {
        PyMem_Free(values);
        return NULL;
    }
    char *p = put_header(PyBytes_AS_STRING(out), '*', n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(args, i);
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
    PyMem_Free(values);
    return out;
}

static PyMethodDef methods[] = {
    {"pack_command", pack_command, METH_O,
     "pack_command(args: tuple) -> bytes | None\n\n"
     "One RESP command, or None when an argument is not bytes, str or a 64-bit int."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "router._resp", "RESP command packing in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__resp(void)
{
    for (int i = 0; i < 100; i++) {
        digit_pairs[2 * i] = (char)('0' + i / 10);
        digit_pairs[2 * i + 1] = (char)('0' + i % 10);
    }
    return PyModule_Create(&module_def);
}
