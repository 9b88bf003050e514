/* WordMap: a compact map from 64-bit ints to packed words, for the engine-hash bridge.
 *
 * The bridge keeps a million entries per router in three maps whose keys are 64-bit
 * ints and whose values are words of one to four 64-bit lanes (router.ingest._native.words). As
 * dicts each entry costs a slot, an index and up to three int objects scattered over the
 * heap, so an insert or lookup misses the cache several times. A WordMap stores key and
 * lanes inline in one open-addressing table (linear probing, power-of-two capacity,
 * tombstones, a control byte per slot kept apart): two cache lines per probe, no
 * objects, and a caller can prefetch a batch's slots so that their misses overlap.
 *
 * It behaves as a mapping of ints to ints (only ints: not tracked by the garbage
 * collector, it must never hold a container). A key is any int from -2**63 to
 * 2**64 - 1 (engine hashes are unsigned 64-bit, or signed where an engine used Python's
 * hash()): its 64 bits, and its sign in the slot's control byte. Entries that do not fit
 * (a key that is no such int, such as an older vLLM's bytes hashes, or a value wider
 * than the lanes, such as a key's packed children on a branch) live in a plain dict
 * beside the table. Invariant: a key is in at most one of the two.
 */
#ifndef KVROUTE_WORDMAP_H
#define KVROUTE_WORDMAP_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define WORDMAP_MAX_LANES 4

typedef struct {
    PyObject_HEAD
    int lanes;
    Py_ssize_t used;   /* full slots */
    Py_ssize_t filled; /* full and deleted slots */
    size_t mask;       /* capacity - 1; 0 before the first insert */
    int shift;         /* 64 - log2(capacity) */
    uint8_t *ctrl;     /* per slot: EMPTY, DELETED, or FULL (| NEGATIVE) */
    uint64_t *slots;   /* per slot: the key, then its lanes */
    PyObject *extra;   /* dict of what does not fit, or NULL */
} WordMap;

extern PyTypeObject WordMapType;

/* A slot's control byte. */
enum { WORDMAP_EMPTY = 0, WORDMAP_FULL = 1, WORDMAP_DELETED = 2, WORDMAP_NEGATIVE = 4 };

/* 64-bit words per slot: the key, then its lanes. */
static inline size_t wordmap_stride(const WordMap *map) { return (size_t)map->lanes + 1; }

/* The key held in a full slot, as an int (a new reference). */
PyObject *wordmap_key_object(uint64_t bits, uint8_t ctrl);

/* Free the table and the side dict: the map is empty. */
void wordmap_release(WordMap *map);

/* A table key: an int's 64 bits and whether it is negative. */
typedef struct {
    uint64_t bits;
    uint8_t negative;
} WordKey;

/* The non-negative int whose little-endian 64-bit lanes are lanes[0..count), count at
 * most WORDMAP_MAX_LANES (a new reference; NULL with an exception on failure). */
PyObject *wordmap_int(const uint64_t *lanes, int count);

/* Whether key (any object) is a table key, stored in *out; never raises. */
int wordmap_key(PyObject *key, WordKey *out);

/* The slot holding key, or -1. */
Py_ssize_t wordmap_find(const WordMap *map, WordKey key);

/* Insert a key known to be absent; 0, or -1 with MemoryError set. */
int wordmap_insert_new(WordMap *map, WordKey key, const uint64_t *lanes);

/* Make room for `more` inserts without a rehash (slots found before stay valid); 0, or
 * -1 with MemoryError set. */
int wordmap_reserve(WordMap *map, Py_ssize_t more);

/* Insert key unless the table holds it, in one probe: 1 inserted, 0 held (nothing
 * changed). The caller reserved room (wordmap_reserve); the side dict is not looked at. */
int wordmap_insert_absent(WordMap *map, WordKey key, const uint64_t *lanes);

/* Delete the entry in a full slot. */
void wordmap_delete_at(WordMap *map, Py_ssize_t slot);

/* Start loading the slots where keys[0..count) are (or would go) into the cache: the
 * lookups that follow then overlap their memory accesses instead of waiting in turn. */
void wordmap_prefetch(const WordMap *map, const WordKey *keys, Py_ssize_t count);

/* Whether the side dict holds key (0 or 1; -1 with an exception). */
int wordmap_extra_holds(const WordMap *map, PyObject *key);

#endif
