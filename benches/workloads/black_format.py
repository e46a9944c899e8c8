"""A real program from PyPI: black formats a copy of this interpreter's typing.py.
Black (pure Python) is installed by scripts/bench.sh into target/pypi/black; the
copy is fresh each run, so black's cache never skips the work."""
import os
import shutil
import sys
import tempfile
import typing

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "target", "pypi", "black"))
import black  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    target = os.path.join(tmp, "typing_copy.py")
    shutil.copy(typing.__file__, target)
    sys.argv = ["black", "-q", "--fast", target]
    try:
        black.patched_main()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
print("done")
