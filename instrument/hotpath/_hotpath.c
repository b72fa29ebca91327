/* The per-batch path of an instrumented loader in C: what hotpath_base.py does in Python.

   Ring      a bounded queue of int64 nanoseconds: the loop appends, a reader takes all
             (bytes, in order). Full, it drops its oldest value, as a deque with maxlen.
   Counts    the base of hotpath_recorder.LoaderRecorder: batches, samples, last_batch_ns
             and the fetch and step rings the loop writes.
   Timed     the base of hotpath_iterator.TimedIterator: __next__ times each next() of the
             iterator it holds with two CLOCK_MONOTONIC readings (perf_counter_ns's clock)
             and records a full batch without a call into Python. Everything else (the
             first batch, a batch to walk, the end, an error) is a call of the Python
             subclass's _first, _walk, _exhausted or _raised.
   beat      a worker's row update at the end of each batch (hotpath_workerblock.py):
             clocks, counts and its thread's run-queue wait written into its row of the
             shared block, without a Python object touched (a freshly forked worker
             pays for each page it writes).

   Every call here holds the interpreter lock and none releases it: a reader's take()
   and the loop's append never interleave. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#ifndef __linux__
/* perf_counter_ns reads CLOCK_MONOTONIC on Linux only: elsewhere the Python build runs. */
#error "the per-batch path in C is built on Linux only"
#endif

#define MAX_RING ((Py_ssize_t)1 << 40)  /* values a ring may keep: 8 TiB, far past any use */

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---------------------------------------------------------------- Ring */

typedef struct {
    PyObject_HEAD
    int64_t *buf;
    Py_ssize_t cap;   /* a power of two, or 0 */
    Py_ssize_t head;  /* the oldest value's index */
    Py_ssize_t len;
    Py_ssize_t maxlen;
} Ring;

static PyTypeObject RingType;

/* Appends v; at maxlen the oldest value goes. A failed allocation drops v: the loop
   must never fail for a measurement. */
static inline void ring_push(Ring *r, int64_t v) {
    if (r->len == r->cap) {
        if (r->cap >= r->maxlen) {
            if (r->cap == 0) return;
            r->buf[r->head] = v;
            r->head = (r->head + 1) & (r->cap - 1);
            return;
        }
        Py_ssize_t cap = r->cap ? r->cap * 2 : 1024;
        if (cap > r->maxlen) cap = r->maxlen;
        int64_t *buf = PyMem_RawMalloc((size_t)cap * sizeof(int64_t));
        if (buf == NULL) return;
        Py_ssize_t first = r->cap - r->head < r->len ? r->cap - r->head : r->len;
        if (r->len) {
            memcpy(buf, r->buf + r->head, (size_t)first * sizeof(int64_t));
            memcpy(buf + first, r->buf, (size_t)(r->len - first) * sizeof(int64_t));
        }
        PyMem_RawFree(r->buf);
        r->buf = buf;
        r->cap = cap;
        r->head = 0;
    }
    r->buf[(r->head + r->len) & (r->cap - 1)] = v;
    r->len++;
}

static PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"maxlen", NULL};
    Py_ssize_t maxlen = 1 << 17;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n", kwlist, &maxlen)) return NULL;
    if (maxlen < 1) {
        PyErr_SetString(PyExc_ValueError, "maxlen must be at least 1");
        return NULL;
    }
    if (maxlen > MAX_RING) {
        PyErr_Format(PyExc_OverflowError, "maxlen must be at most %zd", (Py_ssize_t)MAX_RING);
        return NULL;
    }
    Py_ssize_t p = 1;
    while (p < maxlen) p <<= 1;  /* a power of two, for the index mask */
    Ring *r = (Ring *)type->tp_alloc(type, 0);
    if (r == NULL) return NULL;
    r->maxlen = p;
    return (PyObject *)r;
}

static void Ring_dealloc(Ring *r) {
    PyMem_RawFree(r->buf);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *Ring_append(Ring *r, PyObject *arg) {
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    ring_push(r, (int64_t)v);
    Py_RETURN_NONE;
}

/* All values, oldest first, as native int64 bytes; the ring is left empty. */
static PyObject *Ring_take(Ring *r, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, r->len * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL) return NULL;
    char *dst = PyBytes_AS_STRING(out);
    if (r->len) {
        Py_ssize_t first = r->cap - r->head < r->len ? r->cap - r->head : r->len;
        memcpy(dst, r->buf + r->head, (size_t)first * sizeof(int64_t));
        memcpy(dst + first * sizeof(int64_t), r->buf,
               (size_t)(r->len - first) * sizeof(int64_t));
    }
    r->head = 0;
    r->len = 0;
    return out;
}

static Py_ssize_t Ring_length(Ring *r) { return r->len; }

static PyObject *Ring_get_maxlen(Ring *r, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(r->maxlen);
}

static PyMethodDef Ring_methods[] = {
    {"append", (PyCFunction)Ring_append, METH_O, "Appends an int (nanoseconds)."},
    {"take", (PyCFunction)Ring_take, METH_NOARGS,
     "All values, oldest first, as native int64 bytes; the ring is left empty."},
    {NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"maxlen", (getter)Ring_get_maxlen, NULL, "The most values kept (a power of two).", NULL},
    {NULL},
};

static PySequenceMethods Ring_as_sequence = {.sq_length = (lenfunc)Ring_length};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dataloader_exporter.instrument._hotpath.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A bounded queue of int64 nanoseconds: append, len, take.",
    .tp_new = Ring_new,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
    .tp_as_sequence = &Ring_as_sequence,
};

/* ---------------------------------------------------------------- Counts */

typedef struct {
    PyObject_HEAD
    long long batches;
    long long samples;
    long long last_batch_ns;
    long long first_at_ns;
    long long epochs;
    Ring *fetch;
    Ring *step;
    Ring *first;
} Counts;

static PyTypeObject CountsType;

static PyObject *new_ring(Py_ssize_t maxlen) {
    return PyObject_CallFunction((PyObject *)&RingType, "n", maxlen);
}

/* Counts(...) takes any arguments (a subclass's own); its rings hold MAX_UNREAD, set by
   the subclass's __init__ through _rings(maxlen) when it differs. */
static PyObject *Counts_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Counts *c = (Counts *)type->tp_alloc(type, 0);
    if (c == NULL) return NULL;
    c->fetch = (Ring *)new_ring(1 << 17);
    c->step = (Ring *)new_ring(1 << 17);
    c->first = (Ring *)new_ring(1 << 17);
    if (c->fetch == NULL || c->step == NULL || c->first == NULL) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

/* No cycle runs through a Counts' own fields (its rings refer to nothing). */
static void Counts_dealloc(Counts *c) {
    Py_CLEAR(c->fetch);
    Py_CLEAR(c->step);
    Py_CLEAR(c->first);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyObject *Counts_rings(Counts *c, PyObject *arg) {
    Py_ssize_t maxlen = PyLong_AsSsize_t(arg);
    if (maxlen == -1 && PyErr_Occurred()) return NULL;
    PyObject *f = new_ring(maxlen), *s = new_ring(maxlen), *b = new_ring(maxlen);
    if (f == NULL || s == NULL || b == NULL) {
        Py_XDECREF(f);
        Py_XDECREF(s);
        Py_XDECREF(b);
        return NULL;
    }
    Py_SETREF(c->fetch, (Ring *)f);
    Py_SETREF(c->step, (Ring *)s);
    Py_SETREF(c->first, (Ring *)b);
    Py_RETURN_NONE;
}

static PyMemberDef Counts_members[] = {
    {"batches", T_LONGLONG, offsetof(Counts, batches), 0, "Batches handed out."},
    {"samples", T_LONGLONG, offsetof(Counts, samples), 0, "Samples handed out."},
    {"last_batch_ns", T_LONGLONG, offsetof(Counts, last_batch_ns), 0,
     "perf_counter_ns of the last batch handed out (0: none yet)."},
    {"first_at_ns", T_LONGLONG, offsetof(Counts, first_at_ns), 0,
     "perf_counter_ns of the latest epoch's first batch (0: none yet)."},
    {"epochs", T_LONGLONG, offsetof(Counts, epochs), 0, "Epochs begun (first batches)."},
    {"fetch", T_OBJECT, offsetof(Counts, fetch), READONLY, "The fetch waits not read yet."},
    {"step", T_OBJECT, offsetof(Counts, step), READONLY, "The steps not read yet."},
    {"first", T_OBJECT, offsetof(Counts, first), READONLY,
     "The first batches' waits since iter() not read yet."},
    {NULL},
};

static PyMethodDef Counts_methods[] = {
    {"_rings", (PyCFunction)Counts_rings, METH_O, "New, empty rings of maxlen values."},
    {NULL},
};

static PyTypeObject CountsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dataloader_exporter.instrument._hotpath.Counts",
    .tp_basicsize = sizeof(Counts),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "What the loop writes for one (loader, rank).",
    .tp_new = Counts_new,
    .tp_dealloc = (destructor)Counts_dealloc,
    .tp_members = Counts_members,
    .tp_methods = Counts_methods,
};

/* ---------------------------------------------------------------- Timed */

#define BYTES_EVERY 256  /* hotpath_iterator.BYTES_EVERY: batches between two bytes samples */

typedef struct {
    PyObject_HEAD
    PyObject *it;       /* _it: the iterator timed */
    Counts *rec;        /* _rec: where its batches are recorded */
    long long last;     /* _last: perf_counter_ns of its last batch (0: none yet) */
    long long mark;     /* _mark: while rec.batches < mark a batch is full, nothing is due */
    long long size;     /* _size: a full batch's samples */
    /* The subclass's state (hotpath_iterator.TimedIterator says what each holds). */
    PyObject *count;    /* _count */
    PyObject *sized;    /* _sized: (size, sampler), or None */
    long long end;      /* _end */
    PyObject *owner;    /* _owner */
    long long start;    /* _start */
    long long gen;      /* _gen */
    long long probe;    /* _probe */
    PyObject *retry;    /* _retry */
    PyObject *resume;   /* _resume */
    char done;          /* _done */
    char quick;         /* _quick: its first batch is recorded here (quick_first) */
} Timed;

static PyObject *str_first, *str_walk, *str_exhausted, *str_raised, *str_epochs, *str_shape;
static PyObject *tensor_type;  /* torch.Tensor (set_tensor_type), or NULL */
static PyObject *one;          /* the int 1 */

static int Timed_traverse(Timed *t, visitproc visit, void *arg) {
    Py_VISIT(t->it);
    Py_VISIT(t->rec);
    Py_VISIT(t->count);
    Py_VISIT(t->sized);
    Py_VISIT(t->owner);
    Py_VISIT(t->retry);
    Py_VISIT(t->resume);
    return 0;
}

static int Timed_clear(Timed *t) {
    Py_CLEAR(t->it);
    Py_CLEAR(t->rec);
    Py_CLEAR(t->count);
    Py_CLEAR(t->sized);
    Py_CLEAR(t->owner);
    Py_CLEAR(t->retry);
    Py_CLEAR(t->resume);
    return 0;
}

static void Timed_dealloc(Timed *t) {
    PyObject_GC_UnTrack(t);
    Timed_clear(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* The slow paths: a method of the subclass with (batch, int). Steals batch. */
static PyObject *call2(Timed *t, PyObject *name, PyObject *batch, long long n) {
    PyObject *num = PyLong_FromLongLong(n);
    if (num == NULL) {
        Py_DECREF(batch);
        return NULL;
    }
    PyObject *args[3] = {(PyObject *)t, batch, num};
    PyObject *out = PyObject_VectorcallMethod(name, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                              NULL);
    Py_DECREF(batch);
    Py_DECREF(num);
    return out;
}

/* An error raised here that an `except Exception` would catch is cleared (1); any other
   (KeyboardInterrupt, SystemExit) is left set (0). */
static int clear_exception(void) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return 0;
    PyErr_Clear();
    return 1;
}

/* hotpath_batch.collated_len's common cases: a torch.Tensor, or a list, tuple or dict
   whose first item is one, its first dimension. 1 with *n set; 0 where the Python
   counter must say (any other batch, a 0-d tensor, an error, which is cleared). */
static int collated_count(PyObject *batch, long long *n) {
    if (tensor_type == NULL) return 0;
    PyObject *x = NULL;
    if (Py_IS_TYPE(batch, (PyTypeObject *)tensor_type)) {
        x = batch;
    } else if (PyList_CheckExact(batch) || PyTuple_CheckExact(batch)) {
        if (PySequence_Fast_GET_SIZE(batch) > 0) x = PySequence_Fast_GET_ITEM(batch, 0);
    } else if (PyDict_CheckExact(batch)) {
        Py_ssize_t pos = 0;
        PyObject *key;
        PyDict_Next(batch, &pos, &key, &x);
    }
    if (x == NULL || !Py_IS_TYPE(x, (PyTypeObject *)tensor_type)) return 0;
    PyObject *shape = PyObject_GetAttr(x, str_shape);
    if (shape == NULL) return clear_exception() ? 0 : -1;
    int ok = 0;
    if (PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) > 0
        && PyLong_CheckExact(PyTuple_GET_ITEM(shape, 0))) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 0));
        if (v == -1 && PyErr_Occurred()) PyErr_Clear();
        else {
            *n = v;
            ok = 1;
        }
    }
    Py_DECREF(shape);
    return ok;
}

/* The first batch of an iterator built with quick set (iter_start._kept_iter: a kept plan
   whose first batch needs nothing but its records): what TimedIterator._first does for
   it, without a Python frame of its own. Where anything here cannot do it (a batch
   collated_count cannot count, the bytes sample due, the owner's count), before any
   change, the subclass's _first does all of it. Steals batch. */
static PyObject *quick_first(Timed *t, PyObject *batch, int64_t t1) {
    Counts *rec = t->rec;
    t->quick = 0;
    long long n = 0;
    int counted = collated_count(batch, &n);
    if (counted < 0) {
        Py_DECREF(batch);
        return NULL;
    }
    if (!counted || t->owner == NULL || (rec->batches + 1) % BYTES_EVERY == 0)
        return call2(t, str_first, batch, t1);
    PyObject *e = PyObject_GetAttr(t->owner, str_epochs), *e1 = NULL;
    if (e != NULL) {
        e1 = PyNumber_Add(e, one);
        Py_DECREF(e);
    }
    if (e1 == NULL || PyObject_SetAttr(t->owner, str_epochs, e1) < 0) {
        Py_XDECREF(e1);
        if (!clear_exception()) {
            Py_DECREF(batch);
            return NULL;
        }
        return call2(t, str_first, batch, t1);
    }
    Py_DECREF(e1);
    /* From here on nothing fails but the sampler's len(), as in _arm. */
    Py_CLEAR(t->retry);
    rec->first_at_ns = t1;
    ring_push(rec->first, t1 - t->start);
    rec->epochs++;
    t->last = rec->last_batch_ns = t1;
    long long b = ++rec->batches;
    rec->samples += n;
    PyObject *sized = t->sized;
    if (sized == NULL || sized == Py_None) return batch;
    long long size = PyTuple_Check(sized) && PyTuple_GET_SIZE(sized) == 2
        ? PyLong_AsLongLong(PyTuple_GET_ITEM(sized, 0)) : -1;
    long long full = 0;
    if (size > 0) {
        Py_ssize_t len = PyObject_Size(PyTuple_GET_ITEM(sized, 1));
        if (len >= 0) full = len / size;
    }
    if (PyErr_Occurred() && !clear_exception()) {
        Py_DECREF(batch);
        return NULL;
    }
    if (n != size || full < 2 || t->probe || (t->resume != NULL && t->resume != Py_None)) {
        Py_CLEAR(t->sized);
        return batch;
    }
    long long end = t->end = b + full - 1;
    t->size = size;
    if (b >= end) {
        t->mark = 0;
        Py_CLEAR(t->sized);
        return batch;
    }
    long long next = (b / BYTES_EVERY + 1) * BYTES_EVERY;
    t->mark = end + 1 < next ? end + 1 : next;
    return batch;
}

/* next() of the held iterator ended it or raised: the subclass's _exhausted() at its
   end (then the same end: no exception, or the same StopIteration), _raised(exc) for an
   Exception (what it returns is the batch; what it raises goes on); anything else goes
   on untouched. Each runs with the exception being handled, as in an `except` block: what
   it raises has it as __context__, and a bare `raise` raises it. */
static PyObject *ended(Timed *t) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int stop = type == NULL || PyErr_GivenExceptionMatches(type, PyExc_StopIteration);
    if (!stop && !PyErr_GivenExceptionMatches(type, PyExc_Exception)) {
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    PyObject *saved = NULL;
    if (type != NULL) {
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL) PyException_SetTraceback(value, tb);
        saved = PyErr_GetHandledException();
        PyErr_SetHandledException(value);   /* as inside `except ... as e:` */
    }
    PyObject *r = stop ? PyObject_CallMethodNoArgs((PyObject *)t, str_exhausted)
                       : PyObject_CallMethodOneArg((PyObject *)t, str_raised, value);
    if (type != NULL) {
        PyErr_SetHandledException(saved);
        Py_XDECREF(saved);
    }
    if (stop && r != NULL) {
        Py_DECREF(r);
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return r;
}

static PyObject *Timed_next(Timed *t) {
    PyObject *it = t->it;
    if (it == NULL || t->rec == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a timed iterator without its iterator");
        return NULL;
    }
    iternextfunc next = Py_TYPE(it)->tp_iternext;
    if (next == NULL) {  /* as next() says it, and an error like any other */
        PyErr_Format(PyExc_TypeError, "'%.200s' object is not an iterator",
                     Py_TYPE(it)->tp_name);
        return ended(t);
    }
    if (Py_EnterRecursiveCall(" in a timed iterator")) return ended(t);  /* _it loops back */
    Py_INCREF(it);
    int64_t t0 = now_ns();
    PyObject *batch = next(it);
    Py_DECREF(it);
    Py_LeaveRecursiveCall();
    if (batch == NULL) return ended(t);
    int64_t t1 = now_ns();
    Counts *rec = t->rec;
    ring_push(rec->fetch, t1 - t0);
    if (t->last) {
        ring_push(rec->step, t0 - t->last);
        t->last = rec->last_batch_ns = t1;
        long long b = ++rec->batches;
        if (b < t->mark) {
            rec->samples += t->size;
            return batch;
        }
        return call2(t, str_walk, batch, b);
    }
    if (t->quick) return quick_first(t, batch, t1);
    return call2(t, str_first, batch, t1);
}

/* An attribute it does not have is its iterator's (as TimedIterator passes everything
   else through), but for names that start with "__". */
static PyObject *Timed_getattro(PyObject *self, PyObject *name) {
    PyObject *v = PyObject_GenericGetAttr(self, name);
    if (v != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) return v;
    PyObject *it = ((Timed *)self)->it;
    if (it == NULL || !PyUnicode_Check(name)
        || (PyUnicode_GET_LENGTH(name) >= 2 && PyUnicode_READ_CHAR(name, 0) == '_'
            && PyUnicode_READ_CHAR(name, 1) == '_'))
        return NULL;
    PyErr_Clear();
    return PyObject_GetAttr(it, name);
}

static PyObject *Timed_get_it(Timed *t, void *Py_UNUSED(closure)) {
    if (t->it == NULL) Py_RETURN_NONE;
    return Py_NewRef(t->it);
}

static int Timed_set_it(Timed *t, PyObject *v, void *Py_UNUSED(closure)) {
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_it cannot be deleted");
        return -1;
    }
    Py_XSETREF(t->it, Py_NewRef(v));
    return 0;
}

static PyObject *Timed_get_rec(Timed *t, void *Py_UNUSED(closure)) {
    if (t->rec == NULL) Py_RETURN_NONE;
    return Py_NewRef((PyObject *)t->rec);
}

static int Timed_set_rec(Timed *t, PyObject *v, void *Py_UNUSED(closure)) {
    if (v == NULL || !PyObject_TypeCheck(v, &CountsType)) {
        PyErr_SetString(PyExc_TypeError, "_rec must be a Counts");
        return -1;
    }
    Py_XSETREF(t->rec, (Counts *)Py_NewRef(v));
    return 0;
}

static PyMemberDef Timed_members[] = {
    {"_last", T_LONGLONG, offsetof(Timed, last), 0,
     "perf_counter_ns of the iterator's last batch (0: none yet)."},
    {"_mark", T_LONGLONG, offsetof(Timed, mark), 0,
     "While rec.batches < _mark a batch holds _size samples and nothing else is due."},
    {"_size", T_LONGLONG, offsetof(Timed, size), 0, "A full batch's samples."},
    {"_count", T_OBJECT, offsetof(Timed, count), 0, "How a batch's samples are counted."},
    {"_sized", T_OBJECT, offsetof(Timed, sized), 0, "(size, sampler) until armed, or None."},
    {"_end", T_LONGLONG, offsetof(Timed, end), 0, "The epoch's last full batch (0: unknown)."},
    {"_owner", T_OBJECT, offsetof(Timed, owner), 0, "The loader's Instruments."},
    {"_start", T_LONGLONG, offsetof(Timed, start), 0, "perf_counter_ns of its iter()."},
    {"_gen", T_LONGLONG, offsetof(Timed, gen), 0, "Its workers' generation (0: none)."},
    {"_probe", T_LONGLONG, offsetof(Timed, probe), 0, "The tuner's next reading (0: none)."},
    {"_retry", T_OBJECT, offsetof(Timed, retry), 0, "The tuner's way back, or None."},
    {"_resume", T_OBJECT, offsetof(Timed, resume), 0, "The tuner's mid-epoch change, or None."},
    {"_done", T_BOOL, offsetof(Timed, done), 0, "Whether its end was recorded."},
    {"_quick", T_BOOL, offsetof(Timed, quick), 0,
     "Whether its first batch is recorded in C (iter_start._kept_iter)."},
    {NULL},
};

static PyGetSetDef Timed_getset[] = {
    {"_it", (getter)Timed_get_it, (setter)Timed_set_it, "The iterator timed.", NULL},
    {"_rec", (getter)Timed_get_rec, (setter)Timed_set_rec, "Where batches are recorded.",
     NULL},
    {NULL},
};

static PyObject *Timed_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    return type->tp_alloc(type, 0);
}

static PyTypeObject TimedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dataloader_exporter.instrument._hotpath.Timed",
    .tp_basicsize = sizeof(Timed),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Times each next() of the iterator it holds (_it) into _rec.",
    .tp_new = Timed_new,
    .tp_dealloc = (destructor)Timed_dealloc,
    .tp_traverse = (traverseproc)Timed_traverse,
    .tp_clear = (inquiry)Timed_clear,
    .tp_free = PyObject_GC_Del,
    .tp_getattro = Timed_getattro,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)Timed_next,
    .tp_members = Timed_members,
    .tp_getset = Timed_getset,
};

/* kept(cls, it, rec, owner, start_ns, count, sized, quick): a new cls (a subclass of
   Timed) as TimedIterator(it, owner, start_ns, 0, count, sized, False) makes it, without
   its __init__; quick: its first batch recorded in C where it can be (quick_first). */
static PyObject *kept(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "kept(cls, it, rec, owner, start_ns, count, sized, quick)");
        return NULL;
    }
    PyObject *cls = args[0];
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &TimedType)) {
        PyErr_SetString(PyExc_TypeError, "kept: cls must be a subclass of Timed");
        return NULL;
    }
    if (!PyObject_TypeCheck(args[2], &CountsType)) {
        PyErr_SetString(PyExc_TypeError, "kept: rec must be a Counts");
        return NULL;
    }
    long long start = PyLong_AsLongLong(args[4]);
    int quick = PyObject_IsTrue(args[7]);
    if ((start == -1 && PyErr_Occurred()) || quick < 0) return NULL;
    PyTypeObject *type = (PyTypeObject *)cls;
    Timed *t = (Timed *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    t->it = Py_NewRef(args[1]);
    t->rec = (Counts *)Py_NewRef(args[2]);
    t->owner = Py_NewRef(args[3]);
    t->start = start;
    t->count = Py_NewRef(args[5]);
    t->sized = Py_NewRef(args[6]);
    t->quick = (char)quick;
    return (PyObject *)t;
}

/* set_tensor_type(torch.Tensor): the type whose batches quick_first counts. */
static PyObject *set_tensor_type(PyObject *Py_UNUSED(m), PyObject *arg) {
    if (!PyType_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "set_tensor_type: a type");
        return NULL;
    }
    Py_XSETREF(tensor_type, Py_NewRef(arg));
    Py_RETURN_NONE;
}

/* same_attrs(obj, names, values): whether obj has each attribute named with a value equal
   to the value at its index (== as in a tuple's comparison). Read as getattr() does, never
   through obj.__dict__: once asked for, an instance's __dict__ slows every attribute read
   of it for good (CPython 3.11 stops reading its attributes inline). */
static PyObject *same_attrs(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2])
        || PyTuple_GET_SIZE(args[1]) != PyTuple_GET_SIZE(args[2])) {
        PyErr_SetString(PyExc_TypeError, "same_attrs(obj, names, values): tuples of one length");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[1]); i++) {
        PyObject *v = PyObject_GetAttr(args[0], PyTuple_GET_ITEM(args[1], i));
        if (v == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
        int same = PyObject_RichCompareBool(v, PyTuple_GET_ITEM(args[2], i), Py_EQ);
        Py_DECREF(v);
        if (same < 0) return NULL;
        if (!same) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* ---------------------------------------------------------------- module */

static PyObject *clock_ns(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLongLong(now_ns());
}

/* A worker's row of the shared block: the field order of hotpath_workerblock.py. */
enum { CPU, SAMPLES, HEARTBEAT, PID, UNCOUNTED, MISCOUNTED, WAIT, FIRST_CPU, FIRST_WAIT,
       FIRST_BEAT, FIELDS };
#define FD_UNOPENED (-2)

static int64_t clock_of(clockid_t id) {
    struct timespec ts;
    if (clock_gettime(id, &ts) != 0) return 0;
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* This thread's run-queue wait (ns): schedstat's 2nd field, -1 if unreadable. */
static int64_t wait_ns(int fd) {
    char buf[128];
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return -1;
    buf[n] = '\0';
    char *end;
    strtoll(buf, &end, 10);
    if (end == buf) return -1;
    char *second = end;
    long long v = strtoll(second, &end, 10);
    return end == second || v < 0 ? -1 : (int64_t)v;
}

static PyObject *beat(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "beat(address, samples, miscounted, fd)");
        return NULL;
    }
    int64_t *row = (int64_t *)PyLong_AsVoidPtr(args[0]);
    long long n = PyLong_AsLongLong(args[1]);
    int miscounted = PyObject_IsTrue(args[2]);
    long fd = PyLong_AsLong(args[3]);
    if (PyErr_Occurred() || miscounted < 0) return NULL;
    if (row == NULL || ((uintptr_t)row & 7)) {
        PyErr_SetString(PyExc_ValueError, "beat: not a row's address");
        return NULL;
    }
    if (n < 0) row[UNCOUNTED] += 1;
    else row[SAMPLES] += n;
    if (miscounted) row[MISCOUNTED] += 1;
    if (!row[PID]) row[PID] = (int64_t)getpid();
    if (fd == FD_UNOPENED) fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    row[CPU] = clock_of(CLOCK_PROCESS_CPUTIME_ID);
    row[HEARTBEAT] = clock_of(CLOCK_REALTIME);
    row[WAIT] = fd >= 0 ? wait_ns((int)fd) : -1;
    if (!row[FIRST_BEAT]) {
        row[FIRST_CPU] = row[CPU];
        row[FIRST_WAIT] = row[WAIT];
        row[FIRST_BEAT] = row[HEARTBEAT];
    }
    return PyLong_FromLong(fd < 0 ? -1 : fd);
}

static PyMethodDef module_methods[] = {
    {"clock_ns", clock_ns, METH_NOARGS, "The clock Timed reads (perf_counter_ns's)."},
    {"kept", (PyCFunction)(void (*)(void))kept, METH_FASTCALL,
     "kept(cls, it, rec, owner, start_ns, count, sized, quick): a TimedIterator of a kept "
     "plan, without its __init__."},
    {"same_attrs", (PyCFunction)(void (*)(void))same_attrs, METH_FASTCALL,
     "same_attrs(obj, names, values): whether obj has each attribute with an equal value."},
    {"set_tensor_type", set_tensor_type, METH_O,
     "set_tensor_type(torch.Tensor): the type whose batches a quick first batch counts."},
    {"beat", (PyCFunction)(void (*)(void))beat, METH_FASTCALL,
     "beat(address, samples, miscounted, fd) -> fd: a worker's row at the end of a batch "
     "(hotpath_workerblock.beat says what it writes)."},
    {NULL},
};

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dataloader_exporter.instrument._hotpath",
    .m_doc = "The per-batch path in C (hotpath_base.py is the same in Python).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__hotpath(void) {
    if (PyType_Ready(&RingType) < 0 || PyType_Ready(&CountsType) < 0
        || PyType_Ready(&TimedType) < 0)
        return NULL;
    str_first = PyUnicode_InternFromString("_first");
    str_walk = PyUnicode_InternFromString("_walk");
    str_exhausted = PyUnicode_InternFromString("_exhausted");
    str_raised = PyUnicode_InternFromString("_raised");
    str_epochs = PyUnicode_InternFromString("epochs");
    str_shape = PyUnicode_InternFromString("shape");
    one = PyLong_FromLong(1);
    if (!one || !str_first || !str_walk || !str_exhausted || !str_raised || !str_epochs || !str_shape)
        return NULL;
    PyObject *m = PyModule_Create(&hotpath_module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Ring", (PyObject *)&RingType) < 0
        || PyModule_AddObjectRef(m, "Counts", (PyObject *)&CountsType) < 0
        || PyModule_AddObjectRef(m, "Timed", (PyObject *)&TimedType) < 0
        || PyModule_AddIntConstant(m, "BYTES_EVERY", BYTES_EVERY) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
