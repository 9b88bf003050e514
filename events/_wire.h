/* The C event decoder's shared parts: the TokenIds type and the msgpack reader.
 *
 * events._wire is built from three files: _wire_tokens.c (TokenIds: token ids packed as
 * native uint32), _wire_msgpack.c (bounds-checked reading of msgpack values) and
 * _wire.c (the batch, the module). Every reader returns OK, DECLINE (not read: the bytes
 * are not what was asked for, or not the shape the C path reads; no exception set) or
 * FAIL (a Python exception is set, e.g. MemoryError). A reader that declines may have
 * advanced the Reader: the caller abandons the whole payload then.
 */
#ifndef KVROUTE_WIRE_H
#define KVROUTE_WIRE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if UINT_MAX != 0xFFFFFFFFu
#error "TokenIds exports its buffer as 'I' (unsigned int): 32 bits wide"
#endif

/* ---- TokenIds (_wire_tokens.c) ---- */

typedef struct {
    PyObject_VAR_HEAD
    uint32_t ids[1];
} TokenIds;

extern PyTypeObject TokenIdsType;

/* A TokenIds of count ids, not yet filled in; NULL with an exception on failure. */
TokenIds *tokens_new_empty(Py_ssize_t count);

/* ---- msgpack reading (_wire_msgpack.c) ---- */

enum { OK = 0, DECLINE = 1, FAIL = -1 };

/* Nesting depth of a value skipped or spanned before the decoder gives the batch to
 * the Python path (real batches nest 4 deep). */
#define MAX_DEPTH 32

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Reader;

static inline int need(const Reader *r, size_t count)
{
    return (size_t)(r->end - r->p) >= count;
}

/* Reads a width-byte unsigned big-endian number. */
static inline int read_be(Reader *r, int width, uint64_t *out)
{
    if (!need(r, (size_t)width))
        return DECLINE;
    uint64_t value = 0;
    for (int i = 0; i < width; i++)
        value = (value << 8) | r->p[i];
    *out = value;
    r->p += width;
    return OK;
}

/* Steps over a nil and says 1 if the next value is one, else 0. */
static inline int is_nil(Reader *r)
{
    if (need(r, 1) && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* Whether the next value is an array (not consumed). */
static inline int at_array(const Reader *r)
{
    return need(r, 1) && ((*r->p >= 0x90 && *r->p <= 0x9f) || *r->p == 0xdc || *r->p == 0xdd);
}

/* A msgpack int: *negative says whether it is below 0 (then *value holds it as int64
 * bits), else *value is the unsigned value. Inline: it runs once per token id. */
static inline int read_int(Reader *r, uint64_t *value, int *negative)
{
    if (!need(r, 1))
        return DECLINE;
    uint8_t head = *r->p++;
    *negative = 0;
    if (head <= 0x7f) {
        *value = head;
        return OK;
    }
    if (head >= 0xe0) {
        *value = (uint64_t)(int64_t)(int8_t)head;
        *negative = 1;
        return OK;
    }
    int width;
    int is_signed;
    switch (head) {
    case 0xcc: width = 1; is_signed = 0; break;
    case 0xcd: width = 2; is_signed = 0; break;
    case 0xce: width = 4; is_signed = 0; break;
    case 0xcf: width = 8; is_signed = 0; break;
    case 0xd0: width = 1; is_signed = 1; break;
    case 0xd1: width = 2; is_signed = 1; break;
    case 0xd2: width = 4; is_signed = 1; break;
    case 0xd3: width = 8; is_signed = 1; break;
    default: return DECLINE;
    }
    uint64_t raw;
    if (read_be(r, width, &raw) != OK)
        return DECLINE;
    if (is_signed) {
        int shift = 64 - 8 * width;
        int64_t signed_value = (int64_t)(raw << shift) >> shift; /* sign-extend */
        *value = (uint64_t)signed_value;
        *negative = signed_value < 0;
    } else {
        *value = raw;
    }
    return OK;
}

/* An int read by read_int as a Python int; NULL with an exception on failure. */
PyObject *int_object(uint64_t value, int negative);
/* Array and map headers: *count elements (pairs), each bound by what is left to read. */
int read_array(Reader *r, Py_ssize_t *count);
int read_map(Reader *r, Py_ssize_t *count);
/* A str (want_str) or bin: its bytes at *data, *size long. */
int read_raw(Reader *r, int want_str, const uint8_t **data, Py_ssize_t *size);
/* A str object; DECLINE on a non-str or bytes that are not UTF-8. */
int read_str(Reader *r, PyObject **out);
/* OK if the bytes are UTF-8, else DECLINE. */
int utf8_ok(const uint8_t *data, Py_ssize_t size);
/* Steps over one value (any type but ext; strings checked to be UTF-8). */
int skip(Reader *r, int depth);

#endif
