/* Base class of the V4 parser whose push() stores quiet pieces in C.
 *
 * Why C: a served model pushes a long tool argument a few characters at a time, and on a small
 * CPU one Python-level call per piece (plus the attribute lookup of a per-instance push) costs
 * more than the whole one-shot parse of the text. As a method of the parser's base type, push
 * is found by CPython's specialized method lookup and runs with no Python frame.
 *
 * push(text): while _q_on is set (the parser is inside a tool-call block and no closing marker
 * can be in progress), a str piece with no full-width bar (U+FF5C, part of every closing
 * marker) is appended as UTF-8 to _q_buffer and _q_nothing (the shared empty ParsedOutput) is
 * returned. Anything else goes to the Python method _push(text), which flushes the buffer and
 * does the general work. The parser keeps a pure-Python equivalent for machines where this
 * file cannot be compiled.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#define BAR 0xFF5C

typedef struct {
    PyObject_HEAD
    PyObject *buffer;  /* bytearray, UTF-8 of the stored pieces */
    PyObject *nothing; /* returned for a stored piece */
    char on;           /* quiet state: store bar-free pieces */
} QuietBase;

static PyObject *general_push_name; /* interned "_push" */

static PyObject *quiet_push(QuietBase *self, PyObject *text) {
    if (self->on && self->nothing != NULL && PyUnicode_CheckExact(text)) {
        Py_ssize_t length = PyUnicode_GET_LENGTH(text);
        if (PyUnicode_KIND(text) == PyUnicode_1BYTE_KIND || PyUnicode_FindChar(text, BAR, 0, length, 1) == -1) {
            Py_ssize_t size;
            const char *utf8 = PyUnicode_AsUTF8AndSize(text, &size);
            if (utf8 != NULL) {
                Py_ssize_t used = PyByteArray_GET_SIZE(self->buffer);
                if (PyByteArray_Resize(self->buffer, used + size) < 0)
                    return NULL;
                memcpy(PyByteArray_AS_STRING(self->buffer) + used, utf8, (size_t)size);
                Py_INCREF(self->nothing);
                return self->nothing;
            }
            PyErr_Clear(); /* e.g. a lone surrogate (not UTF-8): the Python path keeps it */
        }
    }
    return PyObject_CallMethodOneArg((PyObject *)self, general_push_name, text);
}

static PyObject *quiet_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    QuietBase *self = (QuietBase *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->buffer = PyByteArray_FromStringAndSize(NULL, 0);
    if (self->buffer == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void quiet_dealloc(QuietBase *self) {
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->nothing);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef quiet_methods[] = {
    {"push", (PyCFunction)quiet_push, METH_O, "Store a quiet piece, else hand it to self._push."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef quiet_members[] = {
    {"_q_buffer", T_OBJECT, offsetof(QuietBase, buffer), READONLY, "stored pieces, UTF-8"},
    {"_q_nothing", T_OBJECT, offsetof(QuietBase, nothing), 0, "returned for a stored piece"},
    {"_q_on", T_BOOL, offsetof(QuietBase, on), 0, "whether push stores bar-free pieces"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject QuietBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "deepinfer_recipe.deepseek_v4._quiet.QuietBase",
    .tp_basicsize = sizeof(QuietBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Base of the V4 parser: push() stores quiet pieces without a Python frame.",
    .tp_new = quiet_new,
    .tp_dealloc = (destructor)quiet_dealloc,
    .tp_methods = quiet_methods,
    .tp_members = quiet_members,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_quiet", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__quiet(void) {
    if (general_push_name == NULL && (general_push_name = PyUnicode_InternFromString("_push")) == NULL)
        return NULL;
    if (PyType_Ready(&QuietBaseType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&QuietBaseType);
    if (PyModule_AddObject(m, "QuietBase", (PyObject *)&QuietBaseType) < 0) {
        Py_DECREF(&QuietBaseType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
