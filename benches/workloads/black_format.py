"""A real program from PyPI: black formats a copy of its own trans.py (2,530 lines;
one file, so black works in this process; not one of the interpreter's own modules,
which may use syntax newer than black parses, as 3.15's `lazy import`). Black (pure
Python) is installed by scripts/bench.sh into target/pypi/black; the copy is fresh
each run, so black's cache never skips the work."""
import os
import shutil
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "target", "pypi", "black"))
import black  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    target = os.path.join(tmp, "trans_copy.py")
    shutil.copy(os.path.join(os.path.dirname(black.__file__), "trans.py"), target)
    sys.argv = ["black", "-q", "--fast", target]
    try:
        black.patched_main()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
print("done")
