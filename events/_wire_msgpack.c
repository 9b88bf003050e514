/* Bounds-checked reading of msgpack values for the C event decoder (see _wire.h).
 *
 * No length is trusted: a collection's count must fit in the bytes left (one per
 * element), a string's or binary's size likewise, so a truncated or lying payload
 * declines before anything is allocated for it.
 */
#include "_wire.h"

PyObject *int_object(uint64_t value, int negative)
{
    return negative ? PyLong_FromLongLong((long long)value)
                    : PyLong_FromUnsignedLongLong(value);
}

/* A collection header whose head byte is fix_base..fix_base+fix_count-1 or one of the
 * 16/32-bit forms; the count must fit in what is left (each element takes a byte). */
static int read_header(Reader *r, uint8_t fix_base, uint8_t fix_count, uint8_t head16,
                       Py_ssize_t per_item, Py_ssize_t *count)
{
    if (!need(r, 1))
        return DECLINE;
    uint8_t head = *r->p++;
    uint64_t n;
    if (head >= fix_base && head < fix_base + fix_count)
        n = head - fix_base;
    else if (head == head16 && read_be(r, 2, &n) == OK)
        ;
    else if (head == head16 + 1 && read_be(r, 4, &n) == OK)
        ;
    else
        return DECLINE;
    if (n > (uint64_t)(r->end - r->p) / (uint64_t)per_item)
        return DECLINE; /* truncated, or a length no payload of this size can hold */
    *count = (Py_ssize_t)n;
    return OK;
}

int read_array(Reader *r, Py_ssize_t *count)
{
    return read_header(r, 0x90, 16, 0xdc, 1, count);
}

int read_map(Reader *r, Py_ssize_t *count)
{
    return read_header(r, 0x80, 16, 0xde, 2, count);
}

/* A string or binary: its bytes at *data, *size long. */
int read_raw(Reader *r, int want_str, const uint8_t **data, Py_ssize_t *size)
{
    if (!need(r, 1))
        return DECLINE;
    uint8_t head = *r->p;
    uint64_t n;
    int width;
    if (want_str && head >= 0xa0 && head <= 0xbf) {
        r->p++;
        n = head - 0xa0;
        width = 0;
    } else if (want_str && head >= 0xd9 && head <= 0xdb) {
        width = 1 << (head - 0xd9);
    } else if (!want_str && head >= 0xc4 && head <= 0xc6) {
        width = 1 << (head - 0xc4);
    } else {
        return DECLINE;
    }
    if (width) {
        r->p++;
        if (read_be(r, width, &n) != OK)
            return DECLINE;
    }
    if (!need(r, n))
        return DECLINE;
    *data = r->p;
    *size = (Py_ssize_t)n;
    r->p += n;
    return OK;
}

/* A str object, or DECLINE on a non-str or bytes that are not UTF-8. */
int read_str(Reader *r, PyObject **out)
{
    const uint8_t *data;
    Py_ssize_t size;
    if (read_raw(r, 1, &data, &size) != OK)
        return DECLINE;
    *out = PyUnicode_DecodeUTF8((const char *)data, size, NULL);
    if (*out != NULL)
        return OK;
    if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
        return FAIL;
    PyErr_Clear();
    return DECLINE;
}

int utf8_ok(const uint8_t *data, Py_ssize_t size)
{
    PyObject *text = PyUnicode_DecodeUTF8((const char *)data, size, NULL);
    if (text != NULL) {
        Py_DECREF(text);
        return OK;
    }
    if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
        return FAIL;
    PyErr_Clear();
    return DECLINE;
}

/* Steps over one value (any type but ext, strings checked to be UTF-8). */
int skip(Reader *r, int depth)
{
    if (!need(r, 1) || depth > MAX_DEPTH)
        return DECLINE;
    uint8_t head = *r->p;
    Py_ssize_t count;
    const uint8_t *data;
    uint64_t ignored;
    int negative;
    if (head <= 0x7f || head >= 0xe0 || (head >= 0xcc && head <= 0xd3))
        return read_int(r, &ignored, &negative);
    if (head == 0xc0 || head == 0xc2 || head == 0xc3) {
        r->p++;
        return OK;
    }
    if (head == 0xca || head == 0xcb) {
        r->p++;
        return read_be(r, head == 0xca ? 4 : 8, &ignored);
    }
    if ((head >= 0xa0 && head <= 0xbf) || (head >= 0xd9 && head <= 0xdb)) {
        if (read_raw(r, 1, &data, &count) != OK)
            return DECLINE;
        return utf8_ok(data, count);
    }
    if (head >= 0xc4 && head <= 0xc6)
        return read_raw(r, 0, &data, &count);
    int is_map = (head >= 0x80 && head <= 0x8f) || head == 0xde || head == 0xdf;
    int status = is_map ? read_map(r, &count) : read_array(r, &count);
    if (status != OK)
        return status; /* also ext and 0xc1: not read here */
    for (Py_ssize_t i = 0; i < count * (is_map ? 2 : 1); i++) {
        status = skip(r, depth + 1);
        if (status != OK)
            return status;
    }
    return OK;
}
