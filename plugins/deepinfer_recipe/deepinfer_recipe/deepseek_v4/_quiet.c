/* The V4 parser's quiet push in C: one call per streamed piece of a long tool argument.
 *
 * Why C: a served model pushes a few characters at a time, and a Python-level call costs more
 * than everything else the parser does per piece. quiet_push(text) stores a piece with no
 * full-width bar (U+FF5C, part of every closing marker) and returns the shared empty
 * ParsedOutput; any other piece goes to the Python fallback, which takes over. Pieces are kept
 * as UTF-8 in a bytearray (grown with over-allocation), so the parser later decodes one buffer
 * instead of joining a list of tiny strings. Same behaviour as the pure-Python closure in
 * parser.py, which is used wherever this file cannot be compiled.
 *
 * make(buffer: bytearray, nothing, fallback) -> quiet_push
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define BAR 0xFF5C

/* state: (buffer, nothing, fallback), a tuple owned by the function object */
static PyObject *quiet_push(PyObject *state, PyObject *text) {
    if (PyUnicode_CheckExact(text)) {
        Py_ssize_t length = PyUnicode_GET_LENGTH(text);
        int bar_free = PyUnicode_KIND(text) == PyUnicode_1BYTE_KIND
            || PyUnicode_FindChar(text, BAR, 0, length, 1) == -1;
        if (bar_free) {
            Py_ssize_t size;
            const char *utf8 = PyUnicode_AsUTF8AndSize(text, &size);
            if (utf8 != NULL) {
                PyObject *buffer = PyTuple_GET_ITEM(state, 0);
                Py_ssize_t used = PyByteArray_GET_SIZE(buffer);
                if (PyByteArray_Resize(buffer, used + size) < 0)
                    return NULL;
                memcpy(PyByteArray_AS_STRING(buffer) + used, utf8, (size_t)size);
                PyObject *nothing = PyTuple_GET_ITEM(state, 1);
                Py_INCREF(nothing);
                return nothing;
            }
            PyErr_Clear(); /* e.g. a lone surrogate: not UTF-8, the Python path keeps it */
        }
    }
    return PyObject_CallOneArg(PyTuple_GET_ITEM(state, 2), text);
}

static PyMethodDef quiet_push_def = {"quiet_push", quiet_push, METH_O,
                                     "Store a bar-free piece, else hand it to the fallback."};

static PyObject *make(PyObject *module, PyObject *args) {
    PyObject *buffer, *nothing, *fallback;
    if (!PyArg_ParseTuple(args, "O!OO:make", &PyByteArray_Type, &buffer, &nothing, &fallback))
        return NULL;
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "make: fallback must be callable");
        return NULL;
    }
    PyObject *state = PyTuple_Pack(3, buffer, nothing, fallback);
    if (state == NULL)
        return NULL;
    PyObject *push = PyCFunction_New(&quiet_push_def, state);
    Py_DECREF(state);
    return push;
}

static PyMethodDef methods[] = {
    {"make", make, METH_VARARGS, "make(buffer, nothing, fallback) -> quiet_push"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_quiet", NULL, -1, methods};

PyMODINIT_FUNC PyInit__quiet(void) { return PyModule_Create(&module); }
