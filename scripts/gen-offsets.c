/*
 * Prints, as JSON, the layout pyprobe's frame walker needs for the CPython whose headers
 * it is compiled against.  Built and run by scripts/gen-offsets.sh; the output is
 * crates/cpython/offsets/3.X.json.  Compile with -DPy_BUILD_CORE and -I of the version's include dir.
 *
 * Two kinds of file:
 *   "offsets"        (3.7 - 3.12): offsetof/sizeof of the structures the walker reads.
 *   "debug_offsets"  (3.13+): where in `_Py_DebugOffsets` (at the start of `_PyRuntime`)
 *                    each offset the walker needs is found; the offsets themselves are
 *                    read from the live process.  Plus what `_Py_DebugOffsets` lacks
 *                    (unicode state bits, sizeof(PyCompactUnicodeObject)).
 */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#if PY_VERSION_HEX < 0x03070000
#error "pyprobe's walker needs CPython 3.7 or newer (_PyRuntime)"
#endif

#if PY_VERSION_HEX >= 0x03090000
#include "internal/pycore_runtime.h"
#include "internal/pycore_pystate.h"
#include "internal/pycore_interp.h"
#elif PY_VERSION_HEX >= 0x03080000
#include "internal/pycore_pystate.h"
#else
#include "internal/pystate.h"
#endif
#if PY_VERSION_HEX >= 0x030B0000
#include "internal/pycore_frame.h"
#include "internal/pycore_code.h"
#else
#include "frameobject.h"
#endif
#if PY_VERSION_HEX >= 0x030E0000
#include "internal/pycore_debug_offsets.h"
#endif

#ifndef SOURCE
#define SOURCE "unknown"
#endif

static int first = 1;

static void open_obj(const char *name) {
    printf("%s\n  \"%s\": {", first ? "" : ",", name);
    first = 0;
}

static int first_field;

#define OBJ(name) (open_obj(name), first_field = 1)
#define CLOSE() printf("}")
#define FIELD(name, value) \
    (printf("%s\"%s\": %lu", first_field ? "" : ", ", name, (unsigned long)(value)), first_field = 0)
#define NULLFIELD(name) (printf("%s\"%s\": null", first_field ? "" : ", ", name), first_field = 0)

/* The bit index of a one-bit-wide (or lowest bit of a) bitfield of `state`, found by
 * setting it in a zeroed object: offsetof cannot name bitfields. */
#define STATE_BIT(field, value)                                                   \
    ({                                                                            \
        PyASCIIObject o;                                                          \
        memset(&o, 0, sizeof o);                                                  \
        o.state.field = (value);                                                  \
        unsigned int w;                                                           \
        memcpy(&w, (char *)&o + offsetof(PyASCIIObject, state), sizeof w);        \
        __builtin_ctz(w);                                                         \
    })

static void unicode_bits(void) {
    FIELD("kind_shift", STATE_BIT(kind, 1));
    FIELD("compact_bit", STATE_BIT(compact, 1));
    FIELD("ascii_bit", STATE_BIT(ascii, 1));
}

int main(void) {
    printf("{\n  \"python\": \"%d.%d\",\n  \"py_version\": \"%s\",\n", PY_MAJOR_VERSION,
           PY_MINOR_VERSION, PY_VERSION);
    printf("  \"source\": \"%s\",\n  \"generated_by\": \"scripts/gen-offsets.sh\",\n", SOURCE);
#if PY_VERSION_HEX >= 0x030D0000
    printf("  \"kind\": \"debug_offsets\"");
    first = 0;
    OBJ("debug_offsets");
    FIELD("size", sizeof(_Py_DebugOffsets));
    FIELD("cookie", offsetof(_Py_DebugOffsets, cookie));
    FIELD("version", offsetof(_Py_DebugOffsets, version));
    FIELD("free_threaded", offsetof(_Py_DebugOffsets, free_threaded));
#define D(path) FIELD(#path, offsetof(_Py_DebugOffsets, path))
    D(runtime_state.size);
    D(runtime_state.interpreters_head);
    D(interpreter_state.size);
    D(interpreter_state.next);
    D(interpreter_state.threads_head);
    /* The GIL: the interpreter's `ceval.gil` pointer, and its own `_gil`'s fields. */
    D(interpreter_state.ceval_gil);
    D(interpreter_state.gil_runtime_state);
    D(interpreter_state.gil_runtime_state_locked);
    D(interpreter_state.gil_runtime_state_holder);
    D(thread_state.size);
    D(thread_state.next);
    D(thread_state.interp);
    D(thread_state.current_frame);
#if PY_VERSION_HEX >= 0x030F0000
    /* The frame every whole stack ends at: a walk ending elsewhere was torn. */
    D(thread_state.base_frame);
#endif
    D(thread_state.thread_id);
    D(thread_state.native_thread_id);
    D(interpreter_frame.size);
    D(interpreter_frame.previous);
    D(interpreter_frame.executable);
    D(interpreter_frame.instr_ptr);
    D(interpreter_frame.owner);
#if PY_VERSION_HEX >= 0x030E0000
    D(interpreter_frame.tlbc_index);
    D(code_object.co_tlbc);
#endif
    D(code_object.size);
    D(code_object.filename);
    D(code_object.name);
    D(code_object.qualname);
    D(code_object.linetable);
    D(code_object.firstlineno);
    D(code_object.co_code_adaptive);
    D(pyobject.size);
    D(pyobject.ob_type);
    D(bytes_object.size);
    D(bytes_object.ob_size);
    D(bytes_object.ob_sval);
    D(unicode_object.size);
    D(unicode_object.state);
    D(unicode_object.length);
    D(unicode_object.asciiobject_size);
    /* A frame's local variables (dump --locals): their values, names and kinds. */
    D(interpreter_frame.localsplus);
    D(code_object.localsplusnames);
    D(code_object.localspluskinds);
    D(tuple_object.ob_item);
#if PY_VERSION_HEX >= 0x030E0000
    /* asyncio tasks (--async, dump --async): a coroutine's own frame, and the set a
       task's awaiters are kept in when it has several. */
    D(gen_object.size);
    D(gen_object.gi_iframe);
    /* What a suspended coroutine awaits: its state (suspended in an await) and
       the top of its frame's value stack, where the awaited object is. */
    D(gen_object.gi_frame_state);
    D(interpreter_frame.stackpointer);
    D(set_object.size);
    D(set_object.table);
    D(set_object.mask);
#endif
#undef D
    CLOSE();
    OBJ("unicode_object");
    /* Not in _Py_DebugOffsets before 3.15 (compactunicodeobject_size). */
    FIELD("compact_size", sizeof(PyCompactUnicodeObject));
    unicode_bits();
    CLOSE();
    OBJ("frame");
    /* Frames with owner >= this are interpreter/C-stack shims, not Python code. */
    FIELD("first_shim_owner", 3);
#if PY_VERSION_HEX >= 0x030E0000
    /* _PyStackRef tag bits to mask off f_executable. */
    FIELD("tag_mask", 3);
    /* gi_frame_state (a byte) of a coroutine suspended in an await. */
    FIELD("yield_from_state", (unsigned char)FRAME_SUSPENDED_YIELD_FROM);
#if PY_VERSION_HEX >= 0x030F0000
    FIELD("yield_from_locked_state", (unsigned char)FRAME_SUSPENDED_YIELD_FROM_LOCKED);
#else
    FIELD("yield_from_locked_state", (unsigned char)FRAME_SUSPENDED_YIELD_FROM);
#endif
#else
    FIELD("tag_mask", 0);
#endif
    CLOSE();
#else /* 3.7 - 3.12 */
    printf("  \"kind\": \"offsets\"");
    first = 0;
    OBJ("runtime_state");
    FIELD("interpreters_head", offsetof(_PyRuntimeState, interpreters.head));
#if PY_VERSION_HEX >= 0x030C0000
    /* 3.12 keeps the current thread state in a thread-local: see ceval_gil. */
    NULLFIELD("gilstate_tstate_current");
#else
    /* The thread state holding the GIL; NULL while none does. */
    FIELD("gilstate_tstate_current", offsetof(_PyRuntimeState, gilstate.tstate_current));
#endif
    CLOSE();
    OBJ("interpreter_state");
    FIELD("next", offsetof(PyInterpreterState, next));
#if PY_VERSION_HEX >= 0x030B0000
    FIELD("threads_head", offsetof(PyInterpreterState, threads.head));
#else
    FIELD("threads_head", offsetof(PyInterpreterState, tstate_head));
#endif
#if PY_VERSION_HEX >= 0x030C0000
    /* A pointer to the GIL the interpreter uses (its own `_gil`, or the main one's). */
    FIELD("ceval_gil", offsetof(PyInterpreterState, ceval.gil));
#else
    NULLFIELD("ceval_gil");
#endif
    CLOSE();
#if PY_VERSION_HEX >= 0x030C0000
    OBJ("gil_runtime_state");
    FIELD("last_holder", offsetof(struct _gil_runtime_state, last_holder));
    FIELD("locked", offsetof(struct _gil_runtime_state, locked));
    CLOSE();
#endif
    OBJ("thread_state");
    FIELD("size", sizeof(PyThreadState));
    FIELD("next", offsetof(PyThreadState, next));
    FIELD("interp", offsetof(PyThreadState, interp));
    FIELD("thread_id", offsetof(PyThreadState, thread_id));
#if PY_VERSION_HEX >= 0x030B0000
    NULLFIELD("frame");
    FIELD("cframe", offsetof(PyThreadState, cframe));
    FIELD("cframe_current_frame", offsetof(_PyCFrame, current_frame));
    FIELD("native_thread_id", offsetof(PyThreadState, native_thread_id));
#else
    FIELD("frame", offsetof(PyThreadState, frame));
    NULLFIELD("cframe");
    NULLFIELD("cframe_current_frame");
    NULLFIELD("native_thread_id");
#endif
    CLOSE();
#if PY_VERSION_HEX >= 0x030B0000
    OBJ("interpreter_frame");
    FIELD("size", sizeof(_PyInterpreterFrame));
    FIELD("previous", offsetof(_PyInterpreterFrame, previous));
    FIELD("executable", offsetof(_PyInterpreterFrame, f_code));
    FIELD("instr_ptr", offsetof(_PyInterpreterFrame, prev_instr));
    FIELD("owner", offsetof(_PyInterpreterFrame, owner));
#if PY_VERSION_HEX >= 0x030C0000
    FIELD("first_shim_owner", FRAME_OWNED_BY_CSTACK);
    NULLFIELD("is_entry");
#else
    NULLFIELD("first_shim_owner");
    /* 3.11: the outermost frame of each call of the eval loop is marked. */
    FIELD("is_entry", offsetof(_PyInterpreterFrame, is_entry));
#endif
    CLOSE();
#else
    OBJ("frame_object");
    FIELD("size", sizeof(PyFrameObject));
    FIELD("back", offsetof(PyFrameObject, f_back));
    FIELD("code", offsetof(PyFrameObject, f_code));
    FIELD("lasti", offsetof(PyFrameObject, f_lasti));
    CLOSE();
#endif
    OBJ("code_object");
    FIELD("size", sizeof(PyCodeObject));
    FIELD("filename", offsetof(PyCodeObject, co_filename));
    FIELD("name", offsetof(PyCodeObject, co_name));
#if PY_VERSION_HEX >= 0x030B0000
    FIELD("qualname", offsetof(PyCodeObject, co_qualname));
    FIELD("linetable", offsetof(PyCodeObject, co_linetable));
    FIELD("code_adaptive", offsetof(PyCodeObject, co_code_adaptive));
#elif PY_VERSION_HEX >= 0x030A0000
    NULLFIELD("qualname");
    FIELD("linetable", offsetof(PyCodeObject, co_linetable));
    NULLFIELD("code_adaptive");
#else
    NULLFIELD("qualname");
    FIELD("linetable", offsetof(PyCodeObject, co_lnotab));
    NULLFIELD("code_adaptive");
#endif
    FIELD("firstlineno", offsetof(PyCodeObject, co_firstlineno));
    CLOSE();
    printf(",\n  \"line_table\": \"%s\"",
           PY_VERSION_HEX >= 0x030B0000   ? "locations"
           : PY_VERSION_HEX >= 0x030A0000 ? "linetable310"
                                          : "lnotab");
    /* f_lasti counts bytes up to 3.9 and code units (2 bytes) in 3.10. */
    printf(",\n  \"lasti_unit\": %d", PY_VERSION_HEX >= 0x030A0000 ? 2 : 1);
    OBJ("pyobject");
    FIELD("ob_type", offsetof(PyObject, ob_type));
    CLOSE();
    OBJ("bytes_object");
    FIELD("ob_size", offsetof(PyVarObject, ob_size));
    FIELD("ob_sval", offsetof(PyBytesObject, ob_sval));
    CLOSE();
    OBJ("unicode_object");
    FIELD("length", offsetof(PyASCIIObject, length));
    FIELD("state", offsetof(PyASCIIObject, state));
    FIELD("ascii_size", sizeof(PyASCIIObject));
    FIELD("compact_size", sizeof(PyCompactUnicodeObject));
    unicode_bits();
    CLOSE();
    /* A frame's local variables (dump --locals): where the values start in a frame,
     * and where the code object names them. */
    OBJ("locals");
#if PY_VERSION_HEX >= 0x030B0000
    FIELD("frame_localsplus", offsetof(_PyInterpreterFrame, localsplus));
    FIELD("code_localsplusnames", offsetof(PyCodeObject, co_localsplusnames));
    FIELD("code_localspluskinds", offsetof(PyCodeObject, co_localspluskinds));
#else
    FIELD("frame_localsplus", offsetof(PyFrameObject, f_localsplus));
    FIELD("code_nlocals", offsetof(PyCodeObject, co_nlocals));
    FIELD("code_varnames", offsetof(PyCodeObject, co_varnames));
    FIELD("code_cellvars", offsetof(PyCodeObject, co_cellvars));
    FIELD("code_freevars", offsetof(PyCodeObject, co_freevars));
#endif
    /* The names are a tuple's items. */
    FIELD("tuple_items", offsetof(PyTupleObject, ob_item));
    CLOSE();
#endif
#if PY_VERSION_HEX < 0x030E0000
    /* sys.modules: before 3.14, asyncio's tasks are found from its module
       (`asyncio.tasks._all_tasks`, `_scheduled_tasks`, `_current_tasks`). */
    OBJ("imports");
#if PY_VERSION_HEX >= 0x030C0000
    FIELD("interpreter_modules", offsetof(PyInterpreterState, imports.modules));
#else
    FIELD("interpreter_modules", offsetof(PyInterpreterState, modules));
#endif
    CLOSE();
#endif
    printf("\n}\n");
    return 0;
}
