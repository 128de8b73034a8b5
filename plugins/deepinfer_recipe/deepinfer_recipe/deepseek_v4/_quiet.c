/* The V4 parser's front object in C: push() stores quiet pieces without a Python frame.
 *
 * Why C: a served model pushes a long tool argument a few characters at a time, and on a small
 * CPU one Python-level call per piece costs more than the whole one-shot parse of the text.
 * push is a method of this (final) type, so CPython's specialized call reaches it directly.
 *
 * Front(logic, nothing): logic is the Python parser (DeepSeekV4Parser). While _q_on is set
 * (inside a tool-call block, no closing marker possibly in progress) a str piece with no
 * full-width bar (U+FF5C, part of every closing marker) is appended to an internal UTF-8
 * buffer and `nothing` (the shared empty ParsedOutput) is returned. Every other piece goes to
 * logic._push(text), which takes the stored text (_take()) and does the general work; finish()
 * is logic.finish(). Where this file cannot be compiled the parser is used without a front
 * (its pure-Python quiet push behaves the same).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#define BAR 0xFF5C

typedef struct {
    PyObject_HEAD
    PyObject *logic;
    PyObject *nothing;
    char *data; /* UTF-8 of the stored pieces */
    Py_ssize_t size, capacity;
    char on;
} Front;

static PyObject *push_name, *finish_name; /* interned "_push", "finish" */

static int store(Front *self, const char *bytes, Py_ssize_t n) {
    if (self->size + n > self->capacity) {
        Py_ssize_t capacity = (self->size + n) * 2 + 64;
        char *data = PyMem_Realloc(self->data, (size_t)capacity);
        if (data == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->data = data;
        self->capacity = capacity;
    }
    memcpy(self->data + self->size, bytes, (size_t)n);
    self->size += n;
    return 0;
}

static PyObject *front_push(Front *self, PyObject *text) {
    if (self->on && PyUnicode_CheckExact(text)) {
        if (PyUnicode_IS_COMPACT_ASCII(text)) {
            if (store(self, (const char *)PyUnicode_DATA(text), PyUnicode_GET_LENGTH(text)) < 0)
                return NULL;
            Py_INCREF(self->nothing);
            return self->nothing;
        }
        Py_ssize_t length = PyUnicode_GET_LENGTH(text);
        if (PyUnicode_KIND(text) == PyUnicode_1BYTE_KIND || PyUnicode_FindChar(text, BAR, 0, length, 1) == -1) {
            Py_ssize_t n;
            const char *utf8 = PyUnicode_AsUTF8AndSize(text, &n);
            if (utf8 != NULL) {
                if (store(self, utf8, n) < 0)
                    return NULL;
                Py_INCREF(self->nothing);
                return self->nothing;
            }
            PyErr_Clear(); /* e.g. a lone surrogate (not UTF-8): the Python path keeps it */
        }
    }
    return PyObject_CallMethodOneArg(self->logic, push_name, text);
}

static PyObject *front_finish(Front *self, PyObject *unused) {
    return PyObject_CallMethodNoArgs(self->logic, finish_name);
}

static PyObject *front_take(Front *self, PyObject *unused) {
    PyObject *text = PyUnicode_DecodeUTF8(self->data, self->size, "strict");
    if (text != NULL)
        self->size = 0;
    return text;
}

static PyObject *front_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *logic, *nothing;
    static char *names[] = {"logic", "nothing", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:Front", names, &logic, &nothing))
        return NULL;
    Front *self = (Front *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(logic);
    self->logic = logic;
    Py_INCREF(nothing);
    self->nothing = nothing;
    return (PyObject *)self;
}

static int front_traverse(Front *self, visitproc visit, void *arg) {
    Py_VISIT(self->logic); /* the logic refers back to its front: a cycle the GC must see */
    Py_VISIT(self->nothing);
    return 0;
}

static int front_clear(Front *self) {
    Py_CLEAR(self->logic);
    Py_CLEAR(self->nothing);
    return 0;
}

static void front_dealloc(Front *self) {
    PyObject_GC_UnTrack(self);
    front_clear(self);
    PyMem_Free(self->data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef front_methods[] = {
    {"push", (PyCFunction)front_push, METH_O, "Store a quiet piece, else logic._push(text)."},
    {"finish", (PyCFunction)front_finish, METH_NOARGS, "logic.finish()"},
    {"_take", (PyCFunction)front_take, METH_NOARGS, "The stored text (and forget it)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef front_members[] = {
    {"logic", T_OBJECT, offsetof(Front, logic), READONLY, "the Python parser"},
    {"_q_on", T_BOOL, offsetof(Front, on), 0, "whether push stores bar-free pieces"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject FrontType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "deepinfer_recipe.deepseek_v4._quiet.Front",
    .tp_basicsize = sizeof(Front),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The V4 parser's push in C for quiet pieces; everything else goes to the Python parser.",
    .tp_new = front_new,
    .tp_dealloc = (destructor)front_dealloc,
    .tp_traverse = (traverseproc)front_traverse,
    .tp_clear = (inquiry)front_clear,
    .tp_methods = front_methods,
    .tp_members = front_members,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_quiet", NULL, -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__quiet(void) {
    if (push_name == NULL && (push_name = PyUnicode_InternFromString("_push")) == NULL)
        return NULL;
    if (finish_name == NULL && (finish_name = PyUnicode_InternFromString("finish")) == NULL)
        return NULL;
    if (PyType_Ready(&FrontType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&FrontType);
    if (PyModule_AddObject(m, "Front", (PyObject *)&FrontType) < 0) {
        Py_DECREF(&FrontType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
