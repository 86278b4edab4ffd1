/* Fused loops of the dense (XOR, byte-shuffled) record path: swarm.codec._dense.
 *
 * A dense record's body is the XOR of the old and new bit patterns, split into byte
 * planes (plane j holds byte j, counted from the least significant, of every element).
 * numpy rebuilds the elements with a widening shift and an OR per plane, then counts
 * and XORs in more passes; each pass reads and writes the whole block again. These
 * loops do it in one pass per block, with the GIL released:
 *
 *   unshuffle(planes, itemsize, n, start, stop, out[, base, new]) -> changed
 *       out[k] = element k (start <= k < stop) of the planes; with ``base`` and ``new``
 *       also new[k] = base[k] ^ out[k]. Returns how many of the elements are not 0.
 *   unshuffle_parts(parts, out[, base, new]) -> changed
 *       the same, with plane j's bytes of the elements in the buffer parts[j], so that
 *       planes that lie in several pieces (a record never joined) are read where they are.
 *   xor_into(planes, itemsize, n, start, stop, target) -> changed
 *       target[k] ^= element k of the planes, in place; returns how many are not 0.
 *
 * ``planes`` is any C-contiguous buffer of itemsize * n bytes; ``out``, ``base``,
 * ``new`` and ``target`` hold (stop - start) elements of ``itemsize`` bytes each, in
 * the machine's byte order (as numpy's unsigned views of a tensor do). Sizes are
 * checked before anything is read or written: a mismatch is a ValueError.
 * swarm.codec.records falls back to numpy where this module is not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Element k of the planes: plane j holds byte j from the least significant. The plane
 * pointers are restrict-qualified and the width a constant, so each loop below is a
 * straight byte interleave the compiler vectorizes. */
#define ELEMENT(T, P, k)                                                                   \
    ({                                                                                     \
        T x_ = 0;                                                                          \
        for (int j_ = (int)sizeof(T) - 1; j_ >= 0; j_--)                                   \
            x_ = (T)((x_ << 4 << 4) | P[j_][k]);                                           \
        x_;                                                                                \
    })

#define SUB ((Py_ssize_t)1 << 20) /* elements per narrow count (far below 2^32) */

/* AVX2 where the CPU has it (GCC's function multiversioning, chosen once at load), else
 * the baseline build. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* One loop per width, so the compiler vectorizes each (no per-element width test). */
#define DEFINE_LOOPS(T, W)                                                                 \
    CLONES static Py_ssize_t unshuffle_##W(const uint8_t *const *planes, Py_ssize_t m,            \
                                    uint8_t *restrict out, const uint8_t *restrict base,   \
                                    uint8_t *restrict new_)                                \
    {                                                                                      \
        const uint8_t *restrict P[W];                                                      \
        for (int j = 0; j < W; j++)                                                        \
            P[j] = planes[j];                                                              \
        Py_ssize_t changed = 0;                                                            \
        T *restrict o = (T *)out;                                                          \
        const T *restrict b = (const T *)base;                                             \
        T *restrict nw = (T *)new_;                                                        \
        for (Py_ssize_t k0 = 0; k0 < m; k0 += SUB) {                                       \
            Py_ssize_t k1 = k0 + SUB < m ? k0 + SUB : m;                                   \
            uint32_t c = 0; /* a narrow counter: the count vectorizes with the loop */     \
            if (base == NULL) {                                                            \
                for (Py_ssize_t k = k0; k < k1; k++) {                                     \
                    T x = ELEMENT(T, P, k);                                                \
                    c += x != 0;                                                           \
                    o[k] = x;                                                              \
                }                                                                          \
            } else {                                                                       \
                for (Py_ssize_t k = k0; k < k1; k++) {                                     \
                    T x = ELEMENT(T, P, k);                                                \
                    c += x != 0;                                                           \
                    o[k] = x;                                                              \
                    nw[k] = b[k] ^ x;                                                      \
                }                                                                          \
            }                                                                              \
            changed += c;                                                                  \
        }                                                                                  \
        return changed;                                                                    \
    }                                                                                      \
    CLONES static Py_ssize_t xor_into_##W(const uint8_t *p, Py_ssize_t n, Py_ssize_t s,           \
                                   Py_ssize_t e, uint8_t *restrict target)                 \
    {                                                                                      \
        const uint8_t *restrict P[W];                                                      \
        for (int j = 0; j < W; j++)                                                        \
            P[j] = p + (Py_ssize_t)j * n + s;                                              \
        Py_ssize_t changed = 0, m = e - s;                                                 \
        T *restrict t = (T *)target;                                                       \
        for (Py_ssize_t k0 = 0; k0 < m; k0 += SUB) {                                       \
            Py_ssize_t k1 = k0 + SUB < m ? k0 + SUB : m;                                   \
            uint32_t c = 0;                                                                \
            for (Py_ssize_t k = k0; k < k1; k++) {                                         \
                T x = ELEMENT(T, P, k);                                                    \
                c += x != 0;                                                               \
                t[k] ^= x;                                                                 \
            }                                                                              \
            changed += c;                                                                  \
        }                                                                                  \
        return changed;                                                                    \
    }

DEFINE_LOOPS(uint8_t, 1)
DEFINE_LOOPS(uint16_t, 2)
DEFINE_LOOPS(uint32_t, 4)
DEFINE_LOOPS(uint64_t, 8)

static int check_geometry(const Py_buffer *planes, int itemsize, Py_ssize_t n,
                          Py_ssize_t start, Py_ssize_t stop)
{
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "itemsize must be 1, 2, 4 or 8, not %d", itemsize);
        return -1;
    }
    if (n < 0 || planes->len != (Py_ssize_t)itemsize * n) {
        PyErr_Format(PyExc_ValueError, "planes hold %zd bytes, not %d x %zd", planes->len,
                     itemsize, n);
        return -1;
    }
    if (start < 0 || start > stop || stop > n) {
        PyErr_Format(PyExc_ValueError, "elements %zd..%zd are not within 0..%zd", start, stop, n);
        return -1;
    }
    return 0;
}

static int check_room(const Py_buffer *b, const char *what, int itemsize, Py_ssize_t count)
{
    if (b->len != (Py_ssize_t)itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, not %zd elements of %d", what,
                     b->len, count, itemsize);
        return -1;
    }
    return 0;
}

/* ``base`` and ``new`` (both, or both None) of ``count`` elements: 0, or -1 with an error
 * set. Release them with ``release_base_new`` either way. */
static int get_base_new(PyObject *base_obj, PyObject *new_obj, Py_buffer *base, Py_buffer *new_,
                        int itemsize, Py_ssize_t count)
{
    if ((base_obj == Py_None) != (new_obj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "base and new go together");
        return -1;
    }
    if (base_obj == Py_None)
        return 0;
    if (PyObject_GetBuffer(base_obj, base, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(new_obj, new_, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return -1;
    if (check_room(base, "base", itemsize, count) < 0 || check_room(new_, "new", itemsize, count) < 0)
        return -1;
    return 0;
}

static void release_base_new(Py_buffer *base, Py_buffer *new_)
{
    if (base->obj != NULL)
        PyBuffer_Release(base);
    if (new_->obj != NULL)
        PyBuffer_Release(new_);
}

/* The loop of the width, over m elements whose plane j starts at P[j], GIL released. */
static Py_ssize_t run_unshuffle(int itemsize, const uint8_t *const *P, Py_ssize_t m,
                                void *out, const void *base, void *new_)
{
    Py_ssize_t changed;
    Py_BEGIN_ALLOW_THREADS
    switch (itemsize) {
    case 1: changed = unshuffle_1(P, m, out, base, new_); break;
    case 2: changed = unshuffle_2(P, m, out, base, new_); break;
    case 4: changed = unshuffle_4(P, m, out, base, new_); break;
    default: changed = unshuffle_8(P, m, out, base, new_); break;
    }
    Py_END_ALLOW_THREADS
    return changed;
}

static PyObject *dense_unshuffle(PyObject *self, PyObject *args)
{
    Py_buffer planes = {0}, out = {0}, base = {0}, new_ = {0};
    int itemsize;
    Py_ssize_t n, start, stop, changed = 0;
    PyObject *base_obj = Py_None, *new_obj = Py_None, *result = NULL;
    if (!PyArg_ParseTuple(args, "y*innnw*|OO:unshuffle", &planes, &itemsize, &n, &start, &stop,
                          &out, &base_obj, &new_obj))
        return NULL;
    if (check_geometry(&planes, itemsize, n, start, stop) < 0 ||
        check_room(&out, "out", itemsize, stop - start) < 0 ||
        get_base_new(base_obj, new_obj, &base, &new_, itemsize, stop - start) < 0)
        goto done;
    {
        const uint8_t *P[8];
        for (int j = 0; j < itemsize; j++)
            P[j] = (const uint8_t *)planes.buf + (Py_ssize_t)j * n + start;
        changed = run_unshuffle(itemsize, P, stop - start, out.buf, base.buf, new_.buf);
    }
    result = PyLong_FromSsize_t(changed);
done:
    PyBuffer_Release(&planes);
    PyBuffer_Release(&out);
    release_base_new(&base, &new_);
    return result;
}

/* unshuffle_parts(parts, out[, base, new]): as ``unshuffle``, with plane j's bytes of
 * the elements given as buffer parts[j] (a sequence of itemsize buffers of m bytes each,
 * e.g. views of where each plane's bytes lie in a record that was never joined), out
 * (and base, new) of m elements. */
static PyObject *dense_unshuffle_parts(PyObject *self, PyObject *args)
{
    Py_buffer parts[8], out = {0}, base = {0}, new_ = {0};
    int itemsize = 0, got = 0;
    Py_ssize_t m = 0, changed = 0;
    PyObject *seq = NULL, *fast = NULL, *base_obj = Py_None, *new_obj = Py_None, *result = NULL;
    if (!PyArg_ParseTuple(args, "Ow*|OO:unshuffle_parts", &seq, &out, &base_obj, &new_obj))
        return NULL;
    fast = PySequence_Fast(seq, "parts must be a sequence of buffers");
    if (fast == NULL)
        goto done;
    itemsize = (int)PySequence_Fast_GET_SIZE(fast);
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "parts must hold 1, 2, 4 or 8 planes, not %d", itemsize);
        goto done;
    }
    if (out.len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, not whole elements of %d", out.len,
                     itemsize);
        goto done;
    }
    m = out.len / itemsize;
    for (; got < itemsize; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &parts[got],
                               PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (parts[got].len != m) {
            PyErr_Format(PyExc_ValueError, "plane %d holds %zd bytes, not %zd", got,
                         parts[got].len, m);
            got++;
            goto done;
        }
    }
    if (get_base_new(base_obj, new_obj, &base, &new_, itemsize, m) < 0)
        goto done;
    {
        const uint8_t *P[8];
        for (int j = 0; j < itemsize; j++)
            P[j] = parts[j].buf;
        changed = run_unshuffle(itemsize, P, m, out.buf, base.buf, new_.buf);
    }
    result = PyLong_FromSsize_t(changed);
done:
    for (int j = 0; j < got; j++)
        PyBuffer_Release(&parts[j]);
    Py_XDECREF(fast);
    PyBuffer_Release(&out);
    release_base_new(&base, &new_);
    return result;
}

static PyObject *dense_xor_into(PyObject *self, PyObject *args)
{
    Py_buffer planes = {0}, target = {0};
    int itemsize;
    Py_ssize_t n, start, stop, changed = 0;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*innnw*:xor_into", &planes, &itemsize, &n, &start, &stop,
                          &target))
        return NULL;
    if (check_geometry(&planes, itemsize, n, start, stop) < 0 ||
        check_room(&target, "target", itemsize, stop - start) < 0)
        goto done;
    {
        const uint8_t *p = planes.buf;
        uint8_t *t = target.buf;
        Py_BEGIN_ALLOW_THREADS
        switch (itemsize) {
        case 1: changed = xor_into_1(p, n, start, stop, t); break;
        case 2: changed = xor_into_2(p, n, start, stop, t); break;
        case 4: changed = xor_into_4(p, n, start, stop, t); break;
        default: changed = xor_into_8(p, n, start, stop, t); break;
        }
        Py_END_ALLOW_THREADS
    }
    result = PyLong_FromSsize_t(changed);
done:
    PyBuffer_Release(&planes);
    PyBuffer_Release(&target);
    return result;
}

static PyMethodDef methods[] = {
    {"unshuffle", dense_unshuffle, METH_VARARGS,
     "unshuffle(planes, itemsize, n, start, stop, out[, base, new]) -> elements not 0"},
    {"unshuffle_parts", dense_unshuffle_parts, METH_VARARGS,
     "unshuffle_parts(parts, out[, base, new]) -> elements not 0 (plane j's bytes: parts[j])"},
    {"xor_into", dense_xor_into, METH_VARARGS,
     "xor_into(planes, itemsize, n, start, stop, target) -> elements not 0"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_dense",
    "Fused one-pass loops of the dense record path (see swarm.codec.records).", -1, methods,
};

PyMODINIT_FUNC PyInit__dense(void)
{
    return PyModule_Create(&module);
}
