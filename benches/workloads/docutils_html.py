"""A real program from PyPI: docutils renders forty copies of the reStructuredText fixture to HTML,
ROUNDS times in one process (default 5). docutils (pure Python) is installed by
scripts/bench.sh into target/pypi/docutils."""
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "target", "pypi", "docutils"))
import docutils.core  # noqa: E402

source = os.path.join(here, "..", "..", "fixtures", "python", "sample.rst")
with open(source, encoding="utf-8") as f:
    # The fixture forty times over: a document of some 20 kB, as a real page is.
    text = f.read() * 40
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    docutils.core.publish_string(text, writer_name="html5", settings_overrides={"report_level": 5})
print("done")
