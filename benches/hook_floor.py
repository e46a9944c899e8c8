#!/usr/bin/env python3
"""Runs a script with a hook that does nothing, set where pyprobe's hook engine sets its
own, and no tracer at all.

    python hook_floor.py SCRIPT [ARGS...]

What the interpreter itself spends calling a hook at every Python call and return is
the floor under any exact tracer inside it (pyprobe's hook engine, cProfile); the
benchmark reports it as `hook floor`. The hook is set as pyprobe's is:

* CPython 3.12 and later: a `sys.monitoring` tool whose callbacks, for the events
  pyprobe's hook asks for (start, resume, return, yield, unwind, throw), are a builtin
  that takes any two or three arguments and returns at once (`slice`, whose one-object
  cache makes it allocate nothing).
* CPython 3.7 to 3.11: a C profile function (`PyEval_SetProfile`) of three bytes,
  `xor eax, eax; ret`, written into a page of its own: called for every call and
  return, Python's and C's, it returns 0. This thread only: the workloads that run it
  have one.
"""
import atexit
import ctypes
import mmap
import runpy
import sys

# A tool id pyprobe does not use (its own is 4).
TOOL = 5


def monitoring_floor():
    monitoring = sys.monitoring
    events = monitoring.events
    wanted = (events.PY_START, events.PY_RESUME, events.PY_RETURN, events.PY_YIELD,
              events.PY_UNWIND, events.PY_THROW)
    monitoring.use_tool_id(TOOL, "hook floor")
    mask = 0
    for event in wanted:
        monitoring.register_callback(TOOL, event, slice)
        mask |= event
    monitoring.set_events(TOOL, mask)


def profile_floor():
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    page.write(b"\x31\xc0\xc3")  # xor eax, eax; ret
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
        sys.exit(f"hook_floor: mprotect: errno {ctypes.get_errno()}")
    set_profile = ctypes.pythonapi.PyEval_SetProfile
    set_profile.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    set_profile.restype = None
    set_profile(address, None)
    # Taken off before the interpreter tears its modules down, and the page never
    # unmapped (a reference that is never given back): no call into a freed page.
    atexit.register(set_profile, None, None)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(page))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.version_info >= (3, 12):
        monitoring_floor()
    else:
        profile_floor()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
