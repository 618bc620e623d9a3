"""Build the one compiled module, ``toktier.native._engine`` (Cython over a C++17 header).

Everything else about the package is declared in pyproject.toml.  The extension is
required: `pip install .` fails loudly without a C++ compiler rather than installing a
package whose fast engine silently never runs.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

ext = Extension(
    "toktier.native._engine",
    sources=["toktier/native/_engine.pyx"],
    include_dirs=["toktier/native"],
    depends=["toktier/native/engine.hpp", "toktier/native/repair.hpp", "toktier/native/workers.hpp"],  # rebuild when a header changes
    language="c++",
    extra_compile_args=["-O3", "-std=c++17", "-fno-strict-aliasing", "-fvisibility=hidden", "-fno-semantic-interposition"],
)

setup(ext_modules=cythonize([ext], compiler_directives={"language_level": "3"}, quiet=True))
