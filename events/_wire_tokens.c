/* TokenIds: a BlockStored's token ids as the C decoder gives them (see _wire.h).
 *
 * Immutable native uint32s in the object itself: a sequence of ints (an int index gives
 * an int, a slice a list), equal to a list or tuple of the same ints (so a batch decoded
 * in C equals the one the Python decoder gives), unhashable like a list, pickled as its
 * list, with a read-only buffer of format 'I' that events._keys hashes directly.
 */
#include "_wire.h"

#include <stddef.h>
#include <string.h>
TokenIds *tokens_new_empty(Py_ssize_t count)
{
    return PyObject_NewVar(TokenIds, &TokenIdsType, count);
}

/* TokenIds(iterable of ints in [0, 2**32)). */
static PyObject *tokens_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *source;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "TokenIds() takes no keyword arguments");
        return NULL;
    }
    if (type != &TokenIdsType) {
        PyErr_SetString(PyExc_TypeError, "TokenIds cannot be subclassed");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O:TokenIds", &source))
        return NULL;
    PyObject *seq = PySequence_Fast(source, "TokenIds() takes an iterable of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    TokenIds *self = tokens_new_empty(count);
    if (self == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyLong_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "token id must be int, not %.100s",
                         Py_TYPE(items[i])->tp_name);
            goto fail;
        }
        unsigned long long value = PyLong_AsUnsignedLongLong(items[i]);
        if (value == (unsigned long long)-1 && PyErr_Occurred())
            goto fail;
        if (value > UINT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "token id does not fit in 32 bits");
            goto fail;
        }
        self->ids[i] = (uint32_t)value;
    }
    Py_DECREF(seq);
    return (PyObject *)self;
fail:
    Py_DECREF(seq);
    Py_DECREF(self);
    return NULL;
}

static Py_ssize_t tokens_len(PyObject *self)
{
    return Py_SIZE(self);
}

static PyObject *tokens_item(PyObject *self, Py_ssize_t i)
{
    if (i < 0 || i >= Py_SIZE(self)) {
        PyErr_SetString(PyExc_IndexError, "TokenIds index out of range");
        return NULL;
    }
    return PyLong_FromUnsignedLong(((TokenIds *)self)->ids[i]);
}

static PyObject *tokens_list(TokenIds *self, Py_ssize_t start, Py_ssize_t step,
                             Py_ssize_t count)
{
    PyObject *list = PyList_New(count);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *value = PyLong_FromUnsignedLong(self->ids[start + i * step]);
        if (value == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, value);
    }
    return list;
}

/* An int index gives an int, a slice a list (as a list's slice would). */
static PyObject *tokens_subscript(PyObject *self, PyObject *key)
{
    if (PySlice_Check(key)) {
        Py_ssize_t start, stop, step;
        if (PySlice_Unpack(key, &start, &stop, &step) < 0)
            return NULL;
        Py_ssize_t count = PySlice_AdjustIndices(Py_SIZE(self), &start, &stop, step);
        return tokens_list((TokenIds *)self, start, step, count);
    }
    Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (i < 0)
        i += Py_SIZE(self);
    return tokens_item(self, i);
}

static PyObject *tokens_tolist(PyObject *self, PyObject *unused)
{
    (void)unused;
    return tokens_list((TokenIds *)self, 0, 1, Py_SIZE(self));
}

static PyObject *tokens_reduce(PyObject *self, PyObject *unused)
{
    PyObject *list = tokens_tolist(self, unused);
    return list == NULL ? NULL : Py_BuildValue("(O(N))", (PyObject *)&TokenIdsType, list);
}

/* Equal to another TokenIds or a list or tuple of the same ints (so a decoded batch
 * equals the one the Python decoder gives); anything else is not compared. */
static PyObject *tokens_richcompare(PyObject *self, PyObject *other, int op)
{
    if (op != Py_EQ && op != Py_NE)
        Py_RETURN_NOTIMPLEMENTED;
    Py_ssize_t count = Py_SIZE(self);
    const uint32_t *ids = ((TokenIds *)self)->ids;
    int equal;
    if (Py_TYPE(other) == &TokenIdsType) {
        equal = Py_SIZE(other) == count &&
                memcmp(ids, ((TokenIds *)other)->ids, (size_t)count * sizeof(uint32_t)) == 0;
    } else if (PyList_Check(other) || PyTuple_Check(other)) {
        equal = PySequence_Size(other) == count;
        for (Py_ssize_t i = 0; equal && i < count; i++) {
            /* A list may change while compared (a __eq__ of its items): re-read it. */
            if (PySequence_Size(other) != count) {
                equal = 0;
                break;
            }
            PyObject *item = PySequence_Fast_GET_ITEM(other, i);
            Py_INCREF(item);
            PyObject *value = PyLong_FromUnsignedLong(ids[i]);
            int same = value == NULL ? -1 : PyObject_RichCompareBool(item, value, Py_EQ);
            Py_XDECREF(value);
            Py_DECREF(item);
            if (same < 0)
                return NULL;
            equal = same;
        }
    } else {
        Py_RETURN_NOTIMPLEMENTED;
    }
    return PyBool_FromLong(op == Py_EQ ? equal : !equal);
}

static PyObject *tokens_repr(PyObject *self)
{
    PyObject *list = tokens_tolist(self, NULL);
    if (list == NULL)
        return NULL;
    PyObject *repr = PyUnicode_FromFormat("TokenIds(%R)", list);
    Py_DECREF(list);
    return repr;
}

/* A read-only, C-contiguous buffer of uint32 ('I'). */
static int tokens_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
    if (flags & PyBUF_WRITABLE) {
        PyErr_SetString(PyExc_BufferError, "TokenIds is read-only");
        view->obj = NULL;
        return -1;
    }
    view->obj = Py_NewRef(self);
    view->buf = ((TokenIds *)self)->ids;
    view->len = Py_SIZE(self) * (Py_ssize_t)sizeof(uint32_t);
    view->readonly = 1;
    view->itemsize = sizeof(uint32_t);
    view->format = (flags & PyBUF_FORMAT) ? "I" : NULL;
    view->ndim = 1;
    view->shape = (flags & PyBUF_ND) ? &((PyVarObject *)self)->ob_size : NULL;
    view->strides = (flags & PyBUF_STRIDES) ? &view->itemsize : NULL;
    view->suboffsets = NULL;
    view->internal = NULL;
    return 0;
}

static PySequenceMethods tokens_as_sequence = {
    .sq_length = tokens_len,
    .sq_item = tokens_item,
};

static PyMappingMethods tokens_as_mapping = {
    .mp_length = tokens_len,
    .mp_subscript = tokens_subscript,
};

static PyBufferProcs tokens_as_buffer = {
    .bf_getbuffer = tokens_getbuffer,
};

static PyMethodDef tokens_methods[] = {
    {"tolist", tokens_tolist, METH_NOARGS, "The token ids as a list of ints."},
    {"__reduce__", tokens_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyObject *tokens_iter(PyObject *self)
{
    return PySeqIter_New(self);
}

PyTypeObject TokenIdsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "events._wire.TokenIds",
    .tp_doc = "TokenIds(iterable)\n\nImmutable token ids packed as native uint32: a "
              "sequence of ints, equal to a list of the same ints, with a buffer ('I').",
    .tp_basicsize = offsetof(TokenIds, ids),
    .tp_itemsize = sizeof(uint32_t),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_SEQUENCE,
    .tp_new = tokens_tp_new,
    .tp_repr = tokens_repr,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_richcompare = tokens_richcompare,
    .tp_iter = tokens_iter,
    .tp_as_sequence = &tokens_as_sequence,
    .tp_as_mapping = &tokens_as_mapping,
    .tp_as_buffer = &tokens_as_buffer,
    .tp_methods = tokens_methods,
};
