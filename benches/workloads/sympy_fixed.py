"""A real program from PyPI with a fixed amount of work: sympy expands, integrates
and factors, ROUNDS times (default 6). Where sympy imports (it is not installed by
the benchmarks' scripts)."""
import sys

import sympy as sp

x, y = sp.symbols("x y")
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    sp.expand((x + y + i) ** 10)
    sp.integrate(sp.sin(x) * sp.exp(x) * x**2, x)
    sp.factor(x**6 - y**6 + i)
