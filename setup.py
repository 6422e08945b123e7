from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    # No contraction into fused multiply-adds: the compiled core must round every float
    # exactly as the Python reference does.
    Extension(
        "sched_core._core", ["sched_core/_core.pyx"], extra_compile_args=["-O3", "-ffp-contract=off"]
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    )
)
