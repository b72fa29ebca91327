/* The per-batch path's C state: what base.py does in Python, for a full batch without a
   Python frame.

   Ring      a bounded queue of int64 nanoseconds: the loop appends, a reader takes all
             (bytes, in order). Full, it drops its oldest value, as a deque with maxlen.
   Counts    the base of recorder.LoaderRecorder: the counters the loop bumps (batches,
             samples, last_batch_ns) and the two rings it writes (fetch, step), set by
             the subclass.
   Timed     the base of iterator.TimedIterator: __next__ times each next() of the
             iterator it holds (_it) with two CLOCK_MONOTONIC readings (perf_counter_ns's
             clock) and records a full batch in _rec. Everything else (the first batch, a
             batch to walk, the end, an error) is a call of the Python subclass's _first,
             _walk, _exhausted or _raised; the subclass holds its own fields.
   address   where a numpy block's rows start, for beat (a tensor says its data_ptr()).
   beat      a worker's row update at the end of each batch (workerblock.py): clocks,
             counts and its thread's run-queue wait written into its row of the shared
             block, without a Python object touched (a freshly forked worker pays for
             each page it writes). The row's layout is layout.py's, read at import.

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
#define LAYOUT_MODULE "dataloader_exporter.instrument.hotpath.layout"

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
    Py_ssize_t maxlen;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &maxlen)) return NULL;
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
    .tp_name = "dataloader_exporter.instrument.hotpath._hotpath.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(maxlen): a bounded queue of int64 nanoseconds: append, len, take.",
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
    Ring *fetch;  /* NULL until the subclass sets it */
    Ring *step;
} Counts;

static PyTypeObject CountsType;

/* Counts(...) takes any arguments (a subclass's own). */
static PyObject *Counts_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    return type->tp_alloc(type, 0);
}

/* No cycle runs through a Counts' own fields (its rings refer to nothing). */
static void Counts_dealloc(Counts *c) {
    Py_CLEAR(c->fetch);
    Py_CLEAR(c->step);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* A ring field: None until set; only a Ring may be set, and never deleted. */
static PyObject *Counts_get_ring(Counts *c, void *closure) {
    Ring *r = *(Ring **)((char *)c + (size_t)closure);
    if (r == NULL) Py_RETURN_NONE;
    return Py_NewRef((PyObject *)r);
}

static int Counts_set_ring(Counts *c, PyObject *v, void *closure) {
    if (v == NULL || !PyObject_TypeCheck(v, &RingType)) {
        PyErr_SetString(PyExc_TypeError, "a Counts' ring must be a Ring");
        return -1;
    }
    Ring **slot = (Ring **)((char *)c + (size_t)closure);
    Py_XSETREF(*slot, (Ring *)Py_NewRef(v));
    return 0;
}

static PyMemberDef Counts_members[] = {
    {"batches", T_LONGLONG, offsetof(Counts, batches), 0, "Batches handed out."},
    {"samples", T_LONGLONG, offsetof(Counts, samples), 0, "Samples handed out."},
    {"last_batch_ns", T_LONGLONG, offsetof(Counts, last_batch_ns), 0,
     "perf_counter_ns of the last batch handed out (0: none yet)."},
    {NULL},
};

static PyGetSetDef Counts_getset[] = {
    {"fetch", (getter)Counts_get_ring, (setter)Counts_set_ring,
     "The fetch waits not read yet (a Ring).", (void *)offsetof(Counts, fetch)},
    {"step", (getter)Counts_get_ring, (setter)Counts_set_ring,
     "The steps not read yet (a Ring).", (void *)offsetof(Counts, step)},
    {NULL},
};

static PyTypeObject CountsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dataloader_exporter.instrument.hotpath._hotpath.Counts",
    .tp_basicsize = sizeof(Counts),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "What the loop writes for one (loader, rank).",
    .tp_new = Counts_new,
    .tp_dealloc = (destructor)Counts_dealloc,
    .tp_members = Counts_members,
    .tp_getset = Counts_getset,
};

/* ---------------------------------------------------------------- Timed */

typedef struct {
    PyObject_HEAD
    PyObject *it;    /* _it: the iterator timed */
    Counts *rec;     /* _rec: where its batches are recorded */
    long long last;  /* _last: perf_counter_ns of its last batch (0: none yet) */
    long long mark;  /* _mark: while rec.batches < mark a batch is full, nothing is due */
    long long size;  /* _size: a full batch's samples */
} Timed;

static PyObject *str_first, *str_walk, *str_exhausted, *str_raised;

static int Timed_traverse(Timed *t, visitproc visit, void *arg) {
    Py_VISIT(t->it);
    Py_VISIT(t->rec);
    return 0;
}

static int Timed_clear(Timed *t) {
    Py_CLEAR(t->it);
    Py_CLEAR(t->rec);
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
    if (!t->last) return call2(t, str_first, batch, t1);
    ring_push(rec->step, t0 - t->last);
    t->last = rec->last_batch_ns = t1;
    long long b = ++rec->batches;
    if (b < t->mark) {
        rec->samples += t->size;
        return batch;
    }
    return call2(t, str_walk, batch, b);
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

/* Only a Counts whose rings are set: Timed_next writes them without a check. */
static int Timed_set_rec(Timed *t, PyObject *v, void *Py_UNUSED(closure)) {
    if (v == NULL || !PyObject_TypeCheck(v, &CountsType)
        || ((Counts *)v)->fetch == NULL || ((Counts *)v)->step == NULL) {
        PyErr_SetString(PyExc_TypeError, "_rec must be a Counts with its rings set");
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
    .tp_name = "dataloader_exporter.instrument.hotpath._hotpath.Timed",
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

/* ---------------------------------------------------------------- beat */

/* A worker's row of the shared block: its fields' indices, from layout.py. */
static struct {
    Py_ssize_t cpu, samples, heartbeat, pid, uncounted, miscounted, wait, first_cpu,
        first_wait, first_beat;
} row_at;
static long fd_unopened;
static char schedstat[64];

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
    if (n < 0) row[row_at.uncounted] += 1;
    else row[row_at.samples] += n;
    if (miscounted) row[row_at.miscounted] += 1;
    if (!row[row_at.pid]) row[row_at.pid] = (int64_t)getpid();
    if (fd == fd_unopened) fd = open(schedstat, O_RDONLY | O_CLOEXEC);
    row[row_at.cpu] = clock_of(CLOCK_PROCESS_CPUTIME_ID);
    row[row_at.heartbeat] = clock_of(CLOCK_REALTIME);
    row[row_at.wait] = fd >= 0 ? wait_ns((int)fd) : -1;
    if (!row[row_at.first_beat]) {
        row[row_at.first_cpu] = row[row_at.cpu];
        row[row_at.first_wait] = row[row_at.wait];
        row[row_at.first_beat] = row[row_at.heartbeat];
    }
    return PyLong_FromLong(fd < 0 ? -1 : fd);
}

/* The address of a writable, contiguous buffer's first byte: a numpy block's first row
   (a tensor's is its data_ptr()). */
static PyObject *address(PyObject *Py_UNUSED(m), PyObject *obj) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *out = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return out;
}

/* layout.py's integer `name` into *out, within [lo, hi). */
static int layout_int(PyObject *layout, const char *name, long lo, long hi, long *out) {
    PyObject *v = PyObject_GetAttrString(layout, name);
    if (v == NULL) return -1;
    long x = PyLong_AsLong(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < lo || x >= hi) {
        PyErr_Format(PyExc_ValueError, "%s.%s = %ld is out of range", LAYOUT_MODULE, name, x);
        return -1;
    }
    *out = x;
    return 0;
}

/* The row's layout, the fd not yet opened and schedstat's path, from layout.py. */
static int read_layout(void) {
    PyObject *layout = PyImport_ImportModule(LAYOUT_MODULE);
    if (layout == NULL) return -1;
    PyObject *fields = PyObject_GetAttrString(layout, "ROW_FIELDS");
    Py_ssize_t n = fields != NULL ? PyObject_Size(fields) : -1;
    Py_XDECREF(fields);
    struct { const char *name; Py_ssize_t *at; } named[] = {
        {"CPU", &row_at.cpu}, {"SAMPLES", &row_at.samples}, {"HEARTBEAT", &row_at.heartbeat},
        {"PID", &row_at.pid}, {"UNCOUNTED", &row_at.uncounted},
        {"MISCOUNTED", &row_at.miscounted}, {"WAIT", &row_at.wait},
        {"FIRST_CPU", &row_at.first_cpu}, {"FIRST_WAIT", &row_at.first_wait},
        {"FIRST_BEAT", &row_at.first_beat},
    };
    int ok = n > 0;
    for (size_t i = 0; ok && i < sizeof named / sizeof named[0]; i++) {
        long x = 0;
        ok = layout_int(layout, named[i].name, 0, (long)n, &x) == 0;
        *named[i].at = x;
    }
    ok = ok && layout_int(layout, "FD_UNOPENED", -1000, -1, &fd_unopened) == 0;
    PyObject *path = ok ? PyObject_GetAttrString(layout, "SCHEDSTAT") : NULL;
    const char *s = path != NULL ? PyUnicode_AsUTF8(path) : NULL;
    if (s != NULL && strlen(s) < sizeof schedstat) strcpy(schedstat, s);
    else if (s != NULL) PyErr_SetString(PyExc_ValueError, "layout.SCHEDSTAT is too long");
    ok = s != NULL && schedstat[0];
    Py_XDECREF(path);
    Py_DECREF(layout);
    if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "layout.ROW_FIELDS");
    return ok ? 0 : -1;
}

/* ---------------------------------------------------------------- module */

static PyMethodDef module_methods[] = {
    {"beat", (PyCFunction)(void (*)(void))beat, METH_FASTCALL,
     "beat(address, samples, miscounted, fd) -> fd: a worker's row at the end of a batch "
     "(workerblock.py_beat says what it writes)."},
    {"address", (PyCFunction)address, METH_O,
     "address(buffer) -> int: a writable contiguous buffer's first byte (a block's)."},
    {NULL},
};

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dataloader_exporter.instrument.hotpath._hotpath",
    .m_doc = "The per-batch path's C state (base.py is the same in Python).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__hotpath(void) {
    if (PyType_Ready(&RingType) < 0 || PyType_Ready(&CountsType) < 0
        || PyType_Ready(&TimedType) < 0 || read_layout() < 0)
        return NULL;
    str_first = PyUnicode_InternFromString("_first");
    str_walk = PyUnicode_InternFromString("_walk");
    str_exhausted = PyUnicode_InternFromString("_exhausted");
    str_raised = PyUnicode_InternFromString("_raised");
    if (!str_first || !str_walk || !str_exhausted || !str_raised) return NULL;
    PyObject *m = PyModule_Create(&hotpath_module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Ring", (PyObject *)&RingType) < 0
        || PyModule_AddObjectRef(m, "Counts", (PyObject *)&CountsType) < 0
        || PyModule_AddObjectRef(m, "Timed", (PyObject *)&TimedType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
